"""Merge a LoRA adapter into its base weights, check it, save a plain HF directory.

The check: logits of the merged model equal those of base + adapter on a few prompts, both in
memory and after reloading the saved directory with plain
``AutoModelForCausalLM.from_pretrained`` (no peft). The directory is written under a temp name
and put in place only when the check passed (``core.atomic.publish_dir``: a folder holding
files this project did not write is refused, never wiped).

In float32 the two agree to ~1e-6 and the largest difference is bounded (``FLOAT32_TOLERANCE``).
In bf16/fp16 they cannot agree that closely: merged weights round once (``W + s·B·A``), peft's
unmerged forward rounds ``x·W`` and ``s·(x·A)·B`` apart, and over many layers and a large
vocabulary some logit differs by a few units in the last place (bf16 logits of 16–32 move in
steps of 0.125). So a half-precision merge is held to the model's own noise: the same merged
model's logits in its dtype against float32 (``_noise_floor``), and the merge passes when the
mean and the 99th percentile of |Δ logit| (over every position and vocabulary entry) stay
within ``NOISE_FACTOR`` times that floor's. A wrong merge (the adapter's scale doubled or
dropped) moves the logits by the adapter's whole effect, far past the floor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from core.atomic import discard_staging, publish_dir, staging_dir
from core.errors import names_write_failures

log = logging.getLogger(__name__)

FLOAT32_TOLERANCE = 1e-4
"""Largest |Δ logit| accepted between a float32 merge and base + adapter."""
NOISE_FACTOR = 3.0
"""Half precision: the mean and the 99th percentile of |Δ logit| may reach this many times the
model's own half-vs-float32 noise (two roundings of one computation differ by ~√2 × one)."""
NOISE_ALLOWANCE = 1e-3
"""Added to each half-precision bound (a floor measured at ~0 does not make the check exact)."""
PERCENTILE = 0.99
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


def _diff_stats(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    """Mean, 99th percentile and max of |a − b| over every position and vocabulary entry."""
    diff = torch.cat([(x - y).abs().flatten() for x, y in zip(a, b, strict=True)])
    # kthvalue: torch.quantile refuses inputs past 2**24 elements (positions × a 201k vocab)
    k = max(1, int(PERCENTILE * diff.numel()))
    return {
        "mean": float(diff.mean()),
        "p99": float(diff.kthvalue(k).values),
        "max": float(diff.max()),
    }


def _noise_floor(merged, prompts: list[list[int]], logits: list[torch.Tensor]) -> dict:
    """The merged model's own half-precision noise: its ``logits`` against the same model's
    in float32 (converted in place and back, which is exact: every bf16/fp16 value is a
    float32; at most the model in float32 is held, as big as the merged + reloaded pair the
    check holds anyway)."""
    dtype = next(merged.parameters()).dtype
    merged.float()
    try:
        exact = _logits(merged, prompts)
    finally:
        merged.to(dtype)
    return _diff_stats(logits, exact)


def _problems(stats: dict, floor: dict | None, what: str) -> list[str]:
    """Why ``stats`` (merged vs base + adapter) fails its bound (``floor`` None: float32)."""
    if floor is None:
        if stats["max"] > FLOAT32_TOLERANCE:
            return [f"{what}: max |Δ logit| {stats['max']:.3g} > {FLOAT32_TOLERANCE:g}"]
        return []
    out = []
    for key in ("mean", "p99"):
        bound = NOISE_FACTOR * floor[key] + NOISE_ALLOWANCE
        if stats[key] > bound:
            out.append(
                f"{what}: {key} |Δ logit| {stats[key]:.3g} > {bound:.3g} ({NOISE_FACTOR:g} × "
                f"the model's own half-precision noise {floor[key]:.3g} + {NOISE_ALLOWANCE:g})"
            )
    return out


@names_write_failures("output_dir")
def merge_and_save(
    model, tokenizer, prompts: list[list[int]], output_dir: str | Path, max_shard_size: str = "5GB"
) -> dict:
    """Merge (if ``model`` is a peft model), check, and save to ``output_dir``.

    Returns the check report (also written as ``merge_report.json`` in the model directory).

    Raises:
        MergeCheckError: logits differ beyond the bound of the dtype: float32's tolerance,
            or the model's own half-precision noise (nothing is left at output_dir).
        OutputNotOursError: ``output_dir`` holds files this project did not write.
    """
    from transformers import AutoModelForCausalLM

    output_dir = Path(output_dir)
    dtype = next(model.parameters()).dtype
    reference = _logits(model, prompts)
    is_peft = hasattr(model, "merge_and_unload")
    merged = model.merge_and_unload() if is_peft else model
    in_memory = _logits(merged, prompts)
    floor = None if dtype == torch.float32 else _noise_floor(merged, prompts, in_memory)
    tmp = staging_dir(output_dir)
    try:
        merged.save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=dtype, attn_implementation="eager"
        )
        after_reload = _logits(reloaded, prompts)
        stats = {
            "in_memory": _diff_stats(reference, in_memory),
            "after_reload": _diff_stats(reference, after_reload),
        }
        report = {
            "merged_adapter": is_peft,
            "dtype": str(dtype).removeprefix("torch."),
            "prompts": len(prompts),
            "tolerance": FLOAT32_TOLERANCE if floor is None else None,
            "noise_floor": floor,
            **{f"{key}_abs_diff_{when}": s[key] for when, s in stats.items() for key in s},
        }
        problems = [p for when, s in stats.items() for p in _problems(s, floor, when)]
        if problems:
            raise MergeCheckError(
                f"merged model differs from base + adapter ({dtype}): {'; '.join(problems)}; "
                f"nothing written to {output_dir}"
            )
        worst = max(report["max_abs_diff_in_memory"], report["max_abs_diff_after_reload"])
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
