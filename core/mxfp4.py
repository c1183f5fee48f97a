"""GPT-OSS checkpoints with MXFP4 experts (the hub's openai/gpt-oss-*), dequantized on purpose.

The hub checkpoints store each layer's expert matrices packed: ``<name>_blocks`` (uint8, two
FP4 E2M1 codes a byte) and ``<name>_scales`` (uint8, one power-of-two exponent per 32 values),
and ``config.json`` carries ``quantization_config: {"quant_method": "mxfp4", ...}``.
transformers (5.17 to 5.25, ``quantizers/quantizer_mxfp4.py``) dequantizes them to bf16 on
``from_pretrained`` only when it cannot run its MXFP4 kernels (no ``kernels`` package, no
triton, a GPU below compute capability 7.5); where it can (a GPU image with triton, and
transformers 5.25 requires ``kernels``) it keeps them packed, a model that cannot be trained
(``Mxfp4HfQuantizer.is_trainable`` is False) and whose saved directory stays MXFP4. Every
loader here therefore asks for bf16 explicitly and says so in the log:

- ``from_pretrained_kwargs``: ``Mxfp4Config(dequantize=True)`` for ``from_pretrained`` (SFT,
  GRPO without ZeRO-3, the HF rollout and eval engines); transformers then drops the
  quantization config from the loaded model, so what it saves carries none;
- ``dequantize``: the packed pair as the bf16 ``[experts, in, out]`` tensor the model takes,
  with transformers' own decoder (``integrations.mxfp4.convert_moe_packed_tensors``), for
  the partitioned loader (``trainer.zero3.model_entries``), which reads tensors itself;
- ``drop_quantization_config``: for a config copied from the source directory onto weights
  that are not quantized (GRPO's streamed save).

The Megatron conversion reads the pairs through megatron-bridge, which dequantizes them
itself (``GPTOSSBridge.maybe_modify_loaded_hf_weight``); ``trainer.megatron.bridge`` logs it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MXFP4 = "mxfp4"
PACKED_SUFFIXES = ("_blocks", "_scales")
"""A packed matrix ``<name>`` is stored as ``<name>_blocks`` and ``<name>_scales``."""


class UnsupportedQuantizationError(ValueError):
    """A model directory quantized in a way no loader here can dequantize."""


def quantization_method(model_dir: str | Path) -> str | None:
    """``quantization_config.quant_method`` of ``model_dir``'s ``config.json`` (None: not
    quantized, or no config.json)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    quantization = json.loads(config_file.read_text()).get("quantization_config") or {}
    method = quantization.get("quant_method")
    return str(method) if method else None


def is_mxfp4(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds MXFP4 experts (and nothing else quantized).

    Raises:
        UnsupportedQuantizationError: quantized another way (only MXFP4 is dequantized here).
    """
    method = quantization_method(model_dir)
    if method is None:
        return False
    if method != MXFP4:
        raise UnsupportedQuantizationError(
            f"{model_dir}/config.json: quantization_config.quant_method {method!r}: only "
            f"{MXFP4!r} checkpoints (the hub's gpt-oss) are dequantized on load; give a bf16 "
            "directory (load it with its quantizer's dequantize option and save_pretrained it)"
        )
    return True


def log_dequantization(model_dir: str | Path, dtype: torch.dtype, loader: str) -> None:
    """The one log line every loader writes when it dequantizes an MXFP4 checkpoint."""
    log.info(
        "%s: MXFP4 experts (quantization_config.quant_method %r) dequantized to %s by %s; "
        "models saved from it carry no quantization config",
        model_dir,
        MXFP4,
        str(dtype).removeprefix("torch."),
        loader,
    )


def from_pretrained_kwargs(model_dir: str | Path, dtype: torch.dtype) -> dict:
    """Extra ``from_pretrained`` keyword arguments: for an MXFP4 directory, dequantize (to
    ``dtype``, the model's), whatever kernels the machine has; else none."""
    if not is_mxfp4(model_dir):
        return {}
    from transformers import Mxfp4Config

    log_dequantization(model_dir, dtype, "from_pretrained (Mxfp4Config(dequantize=True))")
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An expert matrix as the Hugging Face GPT-OSS model holds it, ``[experts, in, out]`` in
    ``dtype``, from its ``_blocks`` (``[experts, out, in/32, 16]``) and ``_scales``
    (``[experts, out, in/32]``): transformers' own MXFP4 decoder, on the CPU."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
            "(the blocks' leading dimensions must be the scales' shape)"
        )
    return convert_moe_packed_tensors(blocks.cpu(), scales.cpu(), dtype=dtype).contiguous()


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The ``[experts, in, out]`` shape ``dequantize`` gives for blocks of ``blocks_shape``."""
    experts, fan_out, groups, group_bytes = blocks_shape
    return (experts, groups * group_bytes * 2, fan_out)


def drop_quantization_config(config) -> None:
    """Remove ``quantization_config`` from a transformers config (for weights saved unpacked)."""
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
