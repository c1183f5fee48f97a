"""A tiny GPT-OSS checkpoint written the way the hub's openai/gpt-oss-* are: experts in MXFP4.

The layout is the one transformers 5.x reads (``integrations/mxfp4.py``:
``_convert_moe_packed_tensors`` and ``FP4_VALUES``; the hub checkpoints' tensor names):

- a Hugging Face expert matrix ``W`` of shape ``[experts, in, out]`` (``gate_up_proj``:
  ``[E, hidden, 2·intermediate]``, ``down_proj``: ``[E, intermediate, hidden]``) is stored
  transposed, ``[E, out, in]``, cut along ``in`` into groups of 32 values;
- ``<name>_blocks``: uint8 ``[E, out, in/32, 16]``, two FP4 (E2M1) codes a byte, the even
  value in the low nibble; a code indexes ``FP4_VALUES`` (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6);
- ``<name>_scales``: uint8 ``[E, out, in/32]``, each group's power-of-two exponent plus 127;
- every other tensor is bf16, and ``config.json`` has ``quantization_config`` with
  ``quant_method: mxfp4``.

``write_mxfp4_checkpoint`` first rounds the model's expert weights onto the MXFP4 grid (so the
format holds them exactly), saves them as the reference the loaders must give back, then packs
them. The packing is written here from the format's definition, not with transformers' code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)  # codes 8-15: the sign bit set
GROUP = 32
EXPERT_MATRICES = ("gate_up_proj", "down_proj")
HUB_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
"""As in openai/gpt-oss-20b's config.json."""


def _groups(weight: torch.Tensor) -> torch.Tensor:
    """``[E, in, out]`` → ``[E, out, in/32, 32]`` float64 (the stored order)."""
    experts, fan_in, fan_out = weight.shape
    if fan_in % GROUP:
        raise ValueError(f"an expert matrix's input size {fan_in} is not a multiple of {GROUP}")
    return weight.double().transpose(1, 2).reshape(experts, fan_out, fan_in // GROUP, GROUP)


def _exponents(groups: torch.Tensor) -> torch.Tensor:
    """Each group's power-of-two scale: the smallest with max|x| / 2**e <= 6."""
    largest = groups.abs().amax(dim=-1).clamp_min(2.0**-120)
    return torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)


def _codes(groups: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The nearest FP4 code of each value (round to the nearest of the 16)."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float64)
    scaled = groups / torch.pow(2.0, exponents).unsqueeze(-1)
    return (scaled.unsqueeze(-1) - table).abs().argmin(dim=-1)


def round_to_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[E, in, out]``) rounded onto the MXFP4 grid, in its own dtype."""
    groups = _groups(weight)
    exponents = _exponents(groups)
    values = torch.tensor(FP4_VALUES, dtype=torch.float64)[_codes(groups, exponents)]
    values = values * torch.pow(2.0, exponents).unsqueeze(-1)
    experts, fan_in, fan_out = weight.shape
    return values.reshape(experts, fan_out, fan_in).transpose(1, 2).to(weight.dtype).contiguous()


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``weight`` (``[E, in, out]``) in the hub layout."""
    groups = _groups(weight)
    exponents = _exponents(groups)
    codes = _codes(groups, exponents).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponents + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def write_mxfp4_checkpoint(source: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    """Write ``source`` (a HF GPT-OSS directory) to ``out`` as the hub ships gpt-oss: bf16 with
    MXFP4 experts and their ``quantization_config``. Returns the bf16 expert matrices, rounded
    onto the MXFP4 grid, that a loader must give back exactly (by their HF names)."""
    from safetensors.torch import load_file, save_file

    source, out = Path(source), Path(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(file))
    stored, originals = {}, {}
    for name, tensor in tensors.items():
        head, _, last = name.rpartition(".")
        if head.endswith(".mlp.experts") and last in EXPERT_MATRICES:
            exact = round_to_mxfp4(tensor.to(torch.bfloat16))
            originals[name] = exact
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = pack_mxfp4(exact)
        else:
            stored[name] = tensor.to(torch.bfloat16)
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = dict(HUB_QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return originals
