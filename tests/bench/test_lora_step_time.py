"""bench/lora_step_time.py on hand-made training logs: the medians leave out the warm-up steps
and the step-0 eval line, a log too short or missing a time names its file, and the pairs'
LoRA ÷ full ratios and their min/median/max are read from the logs of complete pairs only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lora_step_time import collect, pair_ratios, step_medians, table


def _lines(step_times: list[float], rollout: float = 1.0) -> list[dict]:
    lines: list[dict] = [{"step": 0, "eval_both_language_accuracy": 0.5}]  # no step time
    for i, t in enumerate(step_times, start=1):
        lines.append(
            {
                "step": i,
                "step_time_s": t,
                "rollout_time_s": rollout,
                "train_time_s": t - rollout,
                "response_length_mean": 10.0 * i,
                "tokens_per_s": 100.0 / t,  # 100 tokens a step
            }
        )
    return lines


def test_medians_leave_out_warmup_and_eval_lines() -> None:
    # warm-up steps 1-2 are slow; steps 3-5: 4, 6, 5 → median 5
    medians = step_medians(_lines([30.0, 20.0, 4.0, 6.0, 5.0]), warmup=2)
    assert medians == {
        "steps": 3,
        "step_time_s": 5.0,
        "rollout_time_s": 1.0,
        "train_time_s": 4.0,
        "step_time_s_per_ktok": 50.0,
        "rollout_time_s_per_ktok": 10.0,
        "train_time_s_per_ktok": 40.0,
        "response_length_mean": 40.0,
    }
    # lines out of order are ordered by step before the warm-up is cut
    shuffled = _lines([30.0, 20.0, 4.0, 6.0, 5.0])[::-1]
    assert step_medians(shuffled, warmup=2)["step_time_s"] == 5.0


def test_too_short_or_incomplete_log_names_the_file() -> None:
    with pytest.raises(SystemExit, match="log.jsonl: 2 training steps, none after 2"):
        step_medians(_lines([3.0, 4.0]), warmup=2, source="log.jsonl")
    lines = _lines([3.0, 4.0, 5.0])
    del lines[-1]["train_time_s"]
    with pytest.raises(SystemExit, match="log.jsonl: train_time_s missing"):
        step_medians(lines, warmup=0, source="log.jsonl")


def _write(out: Path, name: str, step_times: list[float]) -> None:
    log = out / name / "grpo" / "training_log"
    log.mkdir(parents=True)
    text = "\n".join(json.dumps(line) for line in _lines(step_times))
    (log / "training_metrics.jsonl").write_text(text + "\n")


def test_pairs_ratios_from_complete_pairs(tmp_path: Path) -> None:
    _write(tmp_path, "pair1-full", [9, 9, 4, 4, 4])
    _write(tmp_path, "pair1-lora", [9, 9, 2, 2, 2])
    _write(tmp_path, "pair2-full", [9, 9, 5, 5, 5])
    _write(tmp_path, "pair2-lora", [9, 9, 5, 5, 5])
    _write(tmp_path, "pair3-full", [9, 9, 2, 2, 2])
    _write(tmp_path, "pair3-lora", [9, 9, 3, 3, 3])
    _write(tmp_path, "pair4-full", [9, 9, 2, 2, 2])  # its LoRA run never ran: left out
    pairs = collect(tmp_path, warmup=2)
    assert len(pairs) == 3
    ratios = pair_ratios(pairs)["step_time_s"]
    assert ratios["ratios"] == [0.5, 1.0, 1.5]
    assert (ratios["min"], ratios["median"], ratios["max"]) == (0.5, 1.0, 1.5)
    # 100 tokens every step in both: per 1,000 tokens the same ratios
    assert pair_ratios(pairs)["step_time_s_per_ktok"]["ratios"] == pytest.approx([0.5, 1.0, 1.5])
    text = table(pairs)
    assert "| 1 | 4.00 | 2.00 | 0.50 |" in text
    assert text.splitlines()[2].endswith("| 40 / 40 |")
    assert "| step_time_s | 0.50 | 1.00 | 1.50 |" in text
    with pytest.raises(SystemExit, match="no complete pair"):
        collect(tmp_path / "pair4-full", warmup=2)
