"""Issue #43: ``loop_rate`` and ``reasoning_length_ratio`` per language in GRPO's held-out
eval and the eval's results, and the guard that flags or stops a run whose reasoning
collapses."""

from __future__ import annotations

import math

import pytest

from eval.eval_metrics import reasoning_length_ratios, summarize
from reward.outcome import LOOP, HeldOutResult, Outcome
from trainer.grpo.config import GRPOConfig
from trainer.grpo.held_out import (
    ReasoningCollapsedError,
    better,
    judge,
    looping,
    on_collapse,
    reasoning_collapsed,
)


def _outcomes(words_fr: list[int], words_de: list[int], loops_fr: int = 0) -> list[Outcome]:
    fr = [
        Outcome(
            "fr", reward=1.0, reasoning_words=w, reasoning_detected=LOOP if i < loops_fr else "fr"
        )
        for i, w in enumerate(words_fr)
    ]
    return fr + [Outcome("de", reward=1.0, reasoning_words=w) for w in words_de]


SFT = HeldOutResult.from_outcomes(_outcomes([10, 12, 14], [8, 10]), [True] * 5)


def test_held_out_metrics_by_hand() -> None:
    grpo = HeldOutResult.from_outcomes(_outcomes([4, 6, 8], [8, 12], loops_fr=1), [True] * 5)
    metrics = grpo.metrics()
    assert metrics["median_reasoning_words"] == 8.0  # of 4 6 8 8 12
    assert metrics["median_reasoning_words_fr"] == 6.0
    assert metrics["loop_rate_fr"] == pytest.approx(1 / 3)
    assert metrics["loop_rate_de"] == 0.0
    assert metrics["loop_rate"] == pytest.approx(1 / 5)
    ratios = grpo.reasoning_length_ratios(SFT)
    assert ratios["reasoning_length_ratio"] == pytest.approx(8 / 10)  # SFT: 8 10 10 12 14
    assert ratios["reasoning_length_ratio_fr"] == pytest.approx(6 / 12)
    assert ratios["reasoning_length_ratio_de"] == pytest.approx(10 / 9)
    assert HeldOutResult.from_json(grpo.to_json()) == grpo  # the run state keeps them


def test_the_guard_flags_a_collapse_in_one_language() -> None:
    cfg = GRPOConfig()
    collapsed = HeldOutResult.from_outcomes(_outcomes([4, 5, 6], [8, 10]), [True] * 5)
    ratios = collapsed.reasoning_length_ratios(SFT)
    assert reasoning_collapsed(cfg, ratios)  # fr: 5 / 12 < 0.5, the others hold
    assert not reasoning_collapsed(cfg, SFT.reasoning_length_ratios(SFT))
    better_reward = HeldOutResult(**{**collapsed.__dict__, "mean_reward": 5.0})
    assert not better(
        better_reward, SFT, judge(cfg, better_reward, SFT)
    )  # a collapsed policy is never kept
    off = GRPOConfig.model_validate({"guard": {"min_reasoning_length_ratio": 0.0}})
    assert better(better_reward, SFT, judge(off, better_reward, SFT))
    on_collapse(cfg, ratios, 10)  # flag: a warning only
    stop = GRPOConfig.model_validate({"guard": {"reasoning_collapse": "stop"}})
    with pytest.raises(ReasoningCollapsedError, match="step 10: .*reasoning_length_ratio_fr"):
        on_collapse(stop, ratios, 10)


def test_a_policy_that_loops_in_one_language_is_not_kept() -> None:
    # fr: 1 loop in 3 responses (0.333); overall 1 in 5 (0.2); de none
    grpo = HeldOutResult.from_outcomes(_outcomes([10, 12, 14], [8, 10], loops_fr=1), [True] * 5)
    better_reward = HeldOutResult(**{**grpo.__dict__, "mean_reward": 5.0})
    assert looping(GRPOConfig(), better_reward) == {}  # the default (1.0): never
    assert better(better_reward, SFT, judge(GRPOConfig(), better_reward, SFT))
    cfg = GRPOConfig.model_validate({"guard": {"max_loop_rate": 0.25}})
    assert looping(cfg, better_reward) == {"loop_rate_fr": 0.333}  # overall 0.2 holds
    assert not better(better_reward, SFT, judge(cfg, better_reward, SFT))
    at_the_bar = GRPOConfig.model_validate({"guard": {"max_loop_rate": 1 / 3}})
    assert better(
        better_reward, SFT, judge(at_the_bar, better_reward, SFT)
    )  # at the bar is within it
    strict = GRPOConfig.model_validate({"guard": {"max_loop_rate": 0.1}})
    assert looping(strict, better_reward) == {"loop_rate": 0.2, "loop_rate_fr": 0.333}


def test_the_eval_reports_the_ratio_against_the_sft_model() -> None:
    summaries = {
        "base": summarize(_outcomes([0, 0, 0], [0, 0])),
        "sft": summarize(_outcomes([10, 12, 14], [8, 10])),
        "grpo": summarize(_outcomes([6, 6, 6], [9, 9], loops_fr=3)),
    }
    ratios = reasoning_length_ratios(summaries, "sft")
    assert ratios["grpo"]["per_language"]["fr"] == pytest.approx(0.5)
    assert ratios["grpo"]["per_language"]["de"] == pytest.approx(1.0)
    assert ratios["sft"]["overall"] == 1.0
    assert math.isnan(ratios["grpo"]["per_language"]["en"])  # no English questions here
    assert summaries["grpo"].value("loop_rate", "fr") == 1.0
