"""Training backends behind one small interface: plain PyTorch (``torch``), DeepSpeed
ZeRO-0/1/2/3 (``deepspeed``) and Megatron-Core (``megatron``, GRPO only); ``make_backend``
picks one by ``OptimConfig.backend``.

Modules: ``config`` (the typed settings presets and step configs import), ``schedule`` (LR
schedule, optimizer), ``interface`` (``TrainingBackend``, ``ResponseBatch``, ``LossFn``,
``DataParallel``: how a loop drives a backend and why N processes match one), and one module
per backend: ``torch`` and ``deepspeed`` here, Megatron's in the Megatron package
(``trainer.megatron.backend``, imported only when it is picked: it needs Megatron-Core). The
backends call ``ResponseBatch.hf_log_probs`` on the micro-batches they are given; they import
nothing of the GRPO recipe.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.backends.config import (
    RECOMPUTE_MODULES,
    MegatronSettings,
    OptimConfig,
    ProcessSettings,
)
from trainer.backends.deepspeed import DeepSpeedBackend, deepspeed_config
from trainer.backends.interface import (
    DataParallel,
    LossFn,
    NonFiniteLossError,
    ResponseBatch,
    TrainingBackend,
)
from trainer.backends.schedule import lr_factor, rebase_schedule
from trainer.backends.torch import TorchBackend
from trainer.distributed import DistInfo

__all__ = [
    "RECOMPUTE_MODULES",
    "DataParallel",
    "DeepSpeedBackend",
    "LossFn",
    "MegatronSettings",
    "NonFiniteLossError",
    "OptimConfig",
    "ProcessSettings",
    "ResponseBatch",
    "TorchBackend",
    "TrainingBackend",
    "deepspeed_config",
    "lr_factor",
    "make_backend",
    "rebase_schedule",
]


def make_backend(
    model: torch.nn.Module,
    cfg: OptimConfig,
    total_steps: int,
    dist_info: DistInfo,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    bf16: bool = False,
    *,
    with_reference: bool = False,
    hf_dir: str | Path | None = None,
    ds_config: dict | None = None,
    seed: int = 0,
    pad_id: int = 0,
) -> TrainingBackend:
    """The backend named by ``cfg.backend``.

    ``with_reference``: also keep the starting model, frozen, for KL (``log_probs(...,
    reference=True)``): a copy of ``model``, or under DeepSpeed ZeRO-3 loaded partitioned from
    ``hf_dir``. ``ds_config``: DeepSpeed's configuration when the caller built ``model`` with
    it (``deepspeed_config``). Megatron builds its own actor (and reference) from
    ``cfg.megatron.checkpoint`` with ``hf_dir``'s config; ``model`` is not trained there.
    """
    if cfg.backend == "megatron":
        if hf_dir is None:
            raise ValueError(
                "backend 'megatron' needs the Hugging Face model directory (hf_dir) for its "
                "config and tokenizer; it runs in the GRPO step only"
            )
        from trainer.megatron.backend import build_megatron_backend

        return build_megatron_backend(
            cfg,
            total_steps,
            dist_info,
            hf_dir,
            with_reference=with_reference,
            seed=seed,
            pad_id=pad_id,
        )
    if cfg.backend == "deepspeed":
        return DeepSpeedBackend(
            model,
            cfg,
            total_steps,
            dist_info,
            micro_batch_size,
            gradient_accumulation_steps,
            bf16,
            with_reference=with_reference,
            ds_config=ds_config,
            reference_dir=hf_dir,
        )
    if dist_info.world_size > 1:
        raise ValueError(
            f"backend 'torch' runs one process, but {dist_info.world_size} were launched; "
            "use backend 'deepspeed' for several processes"
        )
    return TorchBackend(model, cfg, total_steps, with_reference=with_reference)
