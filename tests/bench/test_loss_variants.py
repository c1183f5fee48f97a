"""bench/loss_variants.py on hand-made files: its ``--set`` overrides name the field they miss,
and a row reads the eval's and the training log's figures (a variant evaluated without SFT
gets its reasoning length ratio from SFT's medians in another run's eval, as the eval would)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.loss_variants import LANGUAGES, apply_sets, summarize, table

GRPO = {"algorithm": {"policy_loss": "ppo_clip", "dynamic_sampling": {"enabled": False}}}


def test_sets_apply_parsed_values_and_name_a_missing_field() -> None:
    config = apply_sets(GRPO, ["grpo.algorithm.dynamic_sampling.enabled=true"])
    assert config["algorithm"]["dynamic_sampling"]["enabled"] is True
    assert GRPO["algorithm"]["dynamic_sampling"]["enabled"] is False  # not mutated
    with pytest.raises(SystemExit, match="grpo.algorithm.policy_los is not a GRPO config"):
        apply_sets(GRPO, ["grpo.algorithm.policy_los=gspo"])
    with pytest.raises(SystemExit, match="grpo.algorithm.policy_loss is not a section"):
        apply_sets(GRPO, ["grpo.algorithm.policy_loss.x=1"])
    with pytest.raises(SystemExit, match="expected grpo.FIELD"):
        apply_sets(GRPO, ["sft.seed=1"])


def _summary(both: float, words: float) -> dict:
    def figures(value: float) -> dict:
        return {
            "both_language_accuracy": {"value": value},
            "loop_rate": {"value": 1 - value},
            "mean_reward": {"value": 7 * value},
            "median_reasoning_words": {"value": words},
        }

    return {"overall": figures(both), "per_language": {lang: figures(both) for lang in LANGUAGES}}


def _run(root: Path, models: dict, sampling: dict | None = None) -> Path:
    (root / "evaluate").mkdir(parents=True)
    results = {
        "sampling": sampling or {"seed": 0, "n": 5},
        "models": [{"label": label, "summary": s} for label, s in models.items()],
    }
    if "sft" in models:
        results["reasoning_length_ratio"] = {
            "grpo": {"overall": 2.0, "per_language": dict.fromkeys(LANGUAGES, 2.0)}
        }
    (root / "evaluate" / "results").write_text(json.dumps(results))
    log = root / "grpo" / "training_log"
    log.mkdir(parents=True)
    lines = [
        {"step": 0, "eval_both_language_accuracy": 0.1},
        {"step": 1, "step_time_s": 2.0},
        {"step": 2, "step_time_s": 4.0, "eval_both_language_accuracy": 0.5},
        {"step": 3, "step_time_s": 3.0, "eval_both_language_accuracy": 0.2},
        {"step": 3, "eval_reasoning_collapsed": 1.0},
    ]
    (log / "training_metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (log / "grpo_summary.json").write_text(json.dumps({"exported_step": 2}))
    return root


def test_a_row_reads_the_files_and_a_policy_alone_borrows_sfts_medians(tmp_path) -> None:
    pipeline = _run(tmp_path / "run", {"sft": _summary(0.4, 10.0), "grpo": _summary(0.9, 20.0)})
    variant = _run(tmp_path / "variant", {"grpo": _summary(0.8, 5.0)})
    row = summarize(pipeline)
    assert (row["sft_both"], row["both"], row["ratio"]) == (0.4, 0.9, 2.0)
    assert row["held_out"] == {0: 0.1, 2: 0.5, 3: 0.2}
    assert row["collapsed_steps"] == [3]
    assert (row["steps"], row["step_time_s"], row["exported_step"]) == (3, 3.0, 2)
    with pytest.raises(SystemExit, match="give --sft-results"):
        summarize(variant)
    borrowed = summarize(variant, pipeline / "evaluate" / "results")
    assert (borrowed["sft_both"], borrowed["both"], borrowed["ratio"]) == (0.4, 0.8, 0.5)
    assert borrowed["ratio_per_language"] == dict.fromkeys(LANGUAGES, 0.5)
    other = _run(tmp_path / "other", {"grpo": _summary(0.8, 5.0)}, {"seed": 1, "n": 5})
    with pytest.raises(SystemExit, match="sampled unlike"):
        summarize(other, pipeline / "evaluate" / "results")
    (variant / "policy.json").write_text(json.dumps({"policy": "last (3), not exported"}))
    assert summarize(variant, pipeline / "evaluate" / "results")["exported_step"] == (
        "last (3), not exported"
    )
    text = table({"default": row, "gspo": borrowed})
    assert "| gspo | 0.400 → **0.800** |" in text and "| 0.50 |" in text
    assert "| default | 0.100 | 0.500 | 0.200* | 2 | 3.00 (3 steps) |" in text
