"""The one loader of the model a training step starts from (SFT and GRPO).

Under DeepSpeed ZeRO-3 (``OptimConfig.partitioned_load``) the model is built partitioned
(``trainer.zero3.load_partitioned``: ``zero.Init`` through transformers'
``HfDeepSpeedConfig``, then filled one gathered tensor at a time), with the same DeepSpeed
configuration ``deepspeed.initialize`` is given afterwards; no rank ever holds it whole, so a
model larger than one GPU (gpt-oss-20b in bf16, 39 GiB, on a 22.5 GiB A10G) loads. Otherwise
each rank loads the whole model onto its device (``core.modeling.load_causal_lm``), which
ZeRO-0/1/2 and the torch backend hold whole anyway. Either way an MXFP4 checkpoint (the hub's
gpt-oss) is dequantized to the training dtype (``core.mxfp4``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from core.modeling import load_causal_lm
from trainer.backends.config import OptimConfig
from trainer.backends.deepspeed import deepspeed_config
from trainer.distributed import DistInfo

log = logging.getLogger(__name__)


def load_training_model(
    path: str | Path,
    dtype: torch.dtype,
    optim: OptimConfig,
    info: DistInfo,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
) -> tuple[torch.nn.Module, dict | None]:
    """The Hugging Face model in ``path`` as the step's backend trains it, and the DeepSpeed
    configuration it was built with (give it to ``make_backend``; None unless the backend is
    DeepSpeed). Collective under ZeRO-3: every rank calls it."""
    ds_config = None
    if optim.trainer.zero:
        from trainer.zero3 import gather_windows

        ds_config = deepspeed_config(
            optim,
            info.device,
            micro_batch_size,
            gradient_accumulation_steps,
            bf16=dtype == torch.bfloat16,
            zero_settings=gather_windows(path, info.world_size) if optim.zero_stage == 3 else None,
        )
    if optim.partitioned_load:
        from trainer.zero3 import load_partitioned

        model = load_partitioned(path, dtype, ds_config, info.device)
    else:
        model = load_causal_lm(path, dtype, info.device)
    held, total = held_parameters(model)
    log.info(
        "rank %d: model loaded %s: %d of %d parameters on this rank",
        info.rank,
        "partitioned" if optim.partitioned_load else "whole",
        held,
        total,
    )
    return model, ds_config


def held_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(held, total)``: parameter elements this rank holds (its ZeRO-3 partitions, or whole
    tensors), and the model's."""
    held = total = 0
    for param in model.parameters():
        partition = getattr(param, "ds_tensor", None)
        held += param.numel() if partition is None else partition.numel()
        total += getattr(param, "ds_numel", param.numel())
    return held, total
