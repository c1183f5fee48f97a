"""The demo's learning bar (bench/demo_learning.py) on fixed figures: the per-language floors
of issue #29 (raised by #43) catch one language failing behind a good mean, and #43's loop
rate and reasoning length catch a policy that scores by looping or by reasoning less. The
slow test that runs the whole demo against this bar is tests/pipelines/test_demo_learning.py."""

from __future__ import annotations

import pytest

from bench.demo_learning import (
    LORA_BAR,
    DemoOutcome,
    check_thresholds,
    eval_tables,
    format_outcome,
    reasoning_tables,
)

SFT = {"en": 0.72, "fr": 0.46, "de": 0.46, "es": 0.60, "it": 0.48}


LANGUAGES = ("en", "fr", "de", "es", "it")


def outcome(
    grpo_by_language: dict[str, float], loops: dict | None = None, ratios: dict | None = None
) -> DemoOutcome:
    both = sum(grpo_by_language.values()) / len(grpo_by_language)
    sft = {"mean_reward": 2.2, "reasoning_language_accuracy": 0.65}
    sft |= {"answer_language_accuracy": 0.65, "both_language_accuracy": 0.544}
    grpo = {"mean_reward": 5.9, "reasoning_language_accuracy": 0.9}
    grpo |= {"answer_language_accuracy": 0.9, "both_language_accuracy": both}
    return DemoOutcome(
        table={"sft": sft | {"real_word_share": 0.84}, "grpo": grpo | {"real_word_share": 0.9}},
        responses_per_model=250,
        sft_eval_losses=[(450, 2.0), (500, 2.0)],
        sft_converged=True,
        sft_last_fifth_drop=0.0,
        grpo_exported_step=40,
        per_language={"sft": SFT, "grpo": grpo_by_language},
        loop_rate=dict.fromkeys(LANGUAGES, 0.02) | (loops or {}),
        length_ratio=dict.fromkeys(LANGUAGES, 1.1) | (ratios or {}),
    )


def test_every_language_over_the_floor_and_sft_passes() -> None:
    assert (
        check_thresholds(outcome({"en": 0.94, "fr": 0.98, "de": 0.92, "es": 0.8, "it": 0.98})) == []
    )


def test_one_language_under_the_floor_fails_behind_a_good_mean() -> None:
    # the run of issue #29: Italian at 0.50, the mean at 0.86 met the old bar
    grpo = {"en": 0.96, "fr": 0.96, "de": 0.90, "es": 0.96, "it": 0.50}
    assert outcome(grpo).table["grpo"]["both_language_accuracy"] == pytest.approx(0.856)
    assert check_thresholds(outcome(grpo)) == ["GRPO both-language accuracy in it 0.500 < 0.75"]


def test_a_language_below_sft_fails_even_over_the_floor() -> None:
    sft_en = SFT["en"]
    problems = check_thresholds(outcome({"en": 0.70, "fr": 0.9, "de": 0.9, "es": 0.9, "it": 0.9}))
    assert problems == [
        "GRPO both-language accuracy in en 0.700 < 0.75",
        f"GRPO both-language accuracy in en 0.700 < SFT's {sft_en:.3f}",
    ]
    # the LoRA demo's bar (issue #42) keeps issue #29's floor, 0.70
    lora = check_thresholds(
        outcome({"en": 0.71, "fr": 0.9, "de": 0.9, "es": 0.9, "it": 0.9}), LORA_BAR
    )
    assert lora == [f"GRPO both-language accuracy in en 0.710 < SFT's {sft_en:.3f}"]


GOOD = {"en": 0.94, "fr": 0.98, "de": 0.92, "es": 0.8, "it": 0.98}


def test_a_policy_that_loops_or_reasons_less_fails_whatever_it_scores() -> None:
    """Issue #43: the default GRPO of 2026-12-07 scored 0.896 with Spanish looping 0.26."""
    assert check_thresholds(outcome(GOOD, loops={"es": 0.26})) == [
        "GRPO loop rate in es 0.26 > 0.05"
    ]
    assert check_thresholds(outcome(GOOD, ratios={"en": 0.62})) == [
        "GRPO reasoning length ratio in en 0.62 < 0.8"
    ]
    assert check_thresholds(outcome(GOOD, loops={"es": 0.05}, ratios={"en": 0.8})) == []
    # not measured is not met
    unmeasured = outcome(GOOD)
    unmeasured.loop_rate.pop("fr")
    assert check_thresholds(unmeasured) == ["GRPO loop rate in fr None > 0.05"]
    # the LoRA demo's bar does not check them
    assert check_thresholds(outcome(GOOD, loops={"es": 0.26}, ratios={"en": 0.5}), LORA_BAR) == []


def test_the_overall_bar_is_0_85_for_the_demo_and_0_80_for_lora() -> None:
    grpo = {"en": 0.84, "fr": 0.84, "de": 0.84, "es": 0.84, "it": 0.84}
    assert check_thresholds(outcome(grpo)) == ["GRPO both-language accuracy 0.840 < 0.85"]
    assert check_thresholds(outcome(grpo), LORA_BAR) == []


def test_eval_tables_read_results_json() -> None:
    def summary(value: float) -> dict:
        metric = {"value": value}
        return {
            "overall": dict.fromkeys(
                ("mean_reward", "reasoning_language_accuracy", "answer_language_accuracy",
                 "both_language_accuracy", "real_word_share"),
                metric,
            ),
            "per_language": {
                code: {"both_language_accuracy": {"value": value + i / 100},
                       "loop_rate": {"value": i / 50}}
                for i, code in enumerate(("en", "fr", "de", "es", "it"))
            },
        }  # fmt: skip

    results = {"models": [{"label": "sft", "summary": summary(0.5)}]}
    ratios = {"per_language": dict(zip(LANGUAGES, (1.0, 0.9, 0.8, 0.7, 0.6), strict=True))}
    results["reasoning_length_ratio"] = {"sft": {"overall": 0.8} | ratios}
    loops, length = reasoning_tables(results, "sft")
    assert loops == {"en": 0.0, "fr": 0.02, "de": 0.04, "es": 0.06, "it": 0.08}
    assert length == ratios["per_language"]
    table, per_language = eval_tables(results)
    assert table["sft"]["both_language_accuracy"] == 0.5
    assert per_language == {"sft": {"en": 0.5, "fr": 0.51, "de": 0.52, "es": 0.53, "it": 0.54}}
    text = format_outcome(outcome({"en": 0.94, "fr": 0.98, "de": 0.92, "es": 0.8, "it": 0.98}))
    assert "grpo     0.940  0.980  0.920  0.800  0.980" in text
