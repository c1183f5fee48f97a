"""Merge a LoRA adapter into its base weights, check it, save a plain HF directory.

The check: logits of the merged model equal those of base + adapter on a few prompts, within a
tolerance by dtype, both in memory and after reloading the saved directory with plain
``AutoModelForCausalLM.from_pretrained`` (no peft). The directory is written under a temp name
and put in place only when the check passed (``core.atomic.publish_dir``: a folder holding
files this project did not write is refused, never wiped).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from core.atomic import discard_staging, publish_dir, staging_dir
from core.errors import names_write_failures

log = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Max |Δ logit| accepted between merged and base + adapter, by dtype."""
MERGE_REPORT = "merge_report.json"


class MergeCheckError(RuntimeError):
    """The merged model's logits differ from base + adapter beyond the tolerance."""


class AdapterMismatchError(ValueError):
    """An adapter that does not fit the base model it is merged into."""


def _logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    model.eval()
    with torch.no_grad():
        return [
            model(input_ids=torch.tensor([p], device=model.device)).logits[0].float().cpu()
            for p in prompts
        ]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@names_write_failures("output_dir")
def merge_and_save(
    model, tokenizer, prompts: list[list[int]], output_dir: str | Path, max_shard_size: str = "5GB"
) -> dict:
    """Merge (if ``model`` is a peft model), check, and save to ``output_dir``.

    Returns the check report (also written as ``merge_report.json`` in the model directory).

    Raises:
        MergeCheckError: logits differ beyond ``TOLERANCE`` (nothing is left at output_dir).
        OutputNotOursError: ``output_dir`` holds files this project did not write.
    """
    from transformers import AutoModelForCausalLM

    output_dir = Path(output_dir)
    dtype = next(model.parameters()).dtype
    tolerance = TOLERANCE.get(dtype, 1e-2)
    reference = _logits(model, prompts)
    is_peft = hasattr(model, "merge_and_unload")
    merged = model.merge_and_unload() if is_peft else model
    in_memory = _logits(merged, prompts)
    tmp = staging_dir(output_dir)
    try:
        merged.save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=dtype, attn_implementation="eager"
        )
        after_reload = _logits(reloaded, prompts)
        report = {
            "merged_adapter": is_peft,
            "dtype": str(dtype).removeprefix("torch."),
            "prompts": len(prompts),
            "tolerance": tolerance,
            "max_abs_diff_in_memory": _max_diff(reference, in_memory),
            "max_abs_diff_after_reload": _max_diff(reference, after_reload),
        }
        worst = max(report["max_abs_diff_in_memory"], report["max_abs_diff_after_reload"])
        if worst > tolerance:
            raise MergeCheckError(
                f"merged model differs from base + adapter by {worst:.3g} "
                f"(> {tolerance:g} for {dtype}); nothing written to {output_dir}"
            )
        (tmp / MERGE_REPORT).write_text(json.dumps(report, indent=2))
    except BaseException:
        discard_staging(tmp)
        raise
    publish_dir(tmp, output_dir, "--model-output")
    log.info("merged model saved to %s (max |Δ logit| %.2g)", output_dir, worst)
    return report


def load_adapter(base_dir: str | Path, adapter_dir: str | Path, dtype: torch.dtype = torch.float32):
    """Base model with a saved peft adapter applied; a mismatched adapter is a clear error."""
    from peft import PeftModel

    from core.modeling import load_causal_lm

    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.exists():
        raise AdapterMismatchError(f"{adapter_dir}: no adapter_config.json; not a peft adapter")
    base = load_causal_lm(base_dir, dtype)
    try:
        return PeftModel.from_pretrained(base, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as exc:
        declared = json.loads(config_file.read_text()).get("base_model_name_or_path")
        raise AdapterMismatchError(
            f"adapter {adapter_dir} (trained on {declared!r}) does not fit base model "
            f"{base_dir}: {exc}"
        ) from exc
