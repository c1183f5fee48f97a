"""Eval metrics on fixed, hand-checked responses; interval formulas against known values."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval.eval_metrics import (
    MISSING,
    Outcome,
    deltas,
    student_t_quantile,
    summarize,
    t_interval,
    wilson_interval,
)
from eval.runner import Question, score_response
from generation.requests import Generation
from reward.adapters import default_scorer


def harmony(analysis: str, final: str | None = None) -> str:
    """A response in harmony form with special tokens (final omitted: cut off)."""
    text = f"<|channel|>analysis<|message|>{analysis}<|end|>"
    if final is not None:
        text += f"<|start|>assistant<|channel|>final<|message|>{final}<|return|>"
    return text


EN_REASONING = (
    "The school has 480 students and 35 percent of them walk, so I multiply 480 by 0.35 "
    "to get the number of walkers."
)
DE_REASONING = (
    "Die Schule hat 480 Schüler, und 35 Prozent davon gehen zu Fuß, also rechne ich 480 mal 0,35."
)
ES_REASONING = (
    "La escuela tiene 480 alumnos y el 35 por ciento va a pie, así que multiplico 480 por "
    "0,35 para obtener el resultado."
)

# (language, response, reward by hand from the rules in reward/scoring.py)
FIXED = [
    # reasoning en ✓ (+1.5), answer en ✓ (+5), brief (+0.5)
    ("en", harmony(EN_REASONING, "168 students walk to school."), 7.0),
    # reasoning en ≠ fr (-1.5), answer fr ✓ (+5), brief (+0.5)
    ("fr", harmony(EN_REASONING, "168 élèves vont à l'école à pied."), 4.0),
    # reasoning de ✓ (+1.5), answer en ≠ de (-5), brief (+0.5)
    ("de", harmony(DE_REASONING, "168 students walk to school."), -3.0),
    # no final: reasoning cut off (counts as missing, -1.5), answer missing (-5), not brief (-1)
    ("es", harmony(ES_REASONING), -7.5),
    # empty response: reasoning missing (-1.5), answer missing (-5), not brief (-1)
    ("it", "", -7.5),
]


def _question(language: str) -> Question:
    return Question(f"p01-{language}", "p01", language, "percentage", "…", 168, "students")


@pytest.fixture(scope="module")
def fixed_outcomes() -> list[tuple[Outcome, dict]]:
    scorer = default_scorer()
    scored = [score_response(_question(lang), Generation(text), scorer) for lang, text, _ in FIXED]
    failed = Generation(None, error="HTTP 500: boom", attempts=4)
    scored.append(score_response(_question("en"), failed, scorer))
    return scored


def test_rewards_and_detections_match_the_hand_computation(fixed_outcomes):
    outcomes = [o for o, _ in fixed_outcomes]
    assert [o.reward for o in outcomes[:5]] == [r for _, _, r in FIXED]
    assert [o.reasoning_detected for o in outcomes[:5]] == ["en", "en", "de", "es", MISSING]
    assert [o.answer_detected for o in outcomes[:5]] == ["en", "fr", "en", MISSING, MISSING]
    assert [o.correct for o in outcomes[:5]] == [True, True, True, False, False]
    assert outcomes[5].failed


def test_summary_of_fixed_responses(fixed_outcomes):
    summary = summarize([o for o, _ in fixed_outcomes])
    assert (summary.responses, summary.failed) == (6, 1)
    overall = summary.overall
    # the failed response is left out: every rate is over 5 responses
    # the cut-off Spanish reasoning did not finish: it fails the reasoning rule (no refuge)
    assert overall["reasoning_language_accuracy"].value == pytest.approx(2 / 5)
    assert overall["answer_language_accuracy"].value == pytest.approx(2 / 5)
    assert overall["both_language_accuracy"].value == pytest.approx(1 / 5)
    assert overall["brevity"].value == pytest.approx(3 / 5)
    assert overall["answer_correct"].value == pytest.approx(3 / 5)
    assert overall["mean_reward"].value == pytest.approx(-1.4)
    assert overall["reasoning_language_accuracy"].n == 5
    # Wilson 2/5 (textbook value) and t interval of the five rewards, by hand:
    # s² = (8.4² + 5.4² + 1.6² + 6.1² + 6.1²) / 4 = 44.175, t(0.975, 4) = 2.776445
    wilson = overall["reasoning_language_accuracy"]
    assert (wilson.low, wilson.high) == pytest.approx((0.1176, 0.7693), abs=1e-4)
    half = 2.776445 * math.sqrt(44.175 / 5)
    reward = overall["mean_reward"]
    assert (reward.low, reward.high) == pytest.approx((-1.4 - half, -1.4 + half), abs=1e-4)
    assert summary.per_language["fr"]["reasoning_language_accuracy"].value == 0.0
    assert summary.per_language["fr"]["answer_language_accuracy"].value == 1.0
    assert math.isnan(summary.per_language["en"]["mean_reward"].low)  # one response: no interval
    assert summary.confusion["reasoning"]["fr"]["en"] == 1
    assert summary.confusion["answer"]["de"]["en"] == 1
    assert summary.confusion["answer"]["es"][MISSING] == 1
    assert sum(sum(row.values()) for row in summary.confusion["answer"].values()) == 5


def test_record_keeps_the_response_and_the_error(fixed_outcomes):
    _, ok = fixed_outcomes[1]
    assert ok["text"].startswith("<|channel|>analysis")
    assert ok["final"] == "168 élèves vont à l'école à pied."
    assert ok["score"]["reasoning_verdict"] == "mismatch"
    assert ok["degeneracy"]["real_word_share"] > 0.9
    _, failed = fixed_outcomes[5]
    assert failed["error"] == "HTTP 500: boom"
    assert failed["attempts"] == 4
    assert failed["score"] is None


def test_deltas_are_model_minus_baseline():
    good = [Outcome("en", reasoning_ok=True, answer_ok=True, reward=7.0)] * 4
    bad = [Outcome("en", reward=-6.5)] * 4
    result = deltas({"base": summarize(bad), "grpo": summarize(good)}, baseline="base")
    assert set(result) == {"grpo"}
    assert result["grpo"].overall["both_language_accuracy"] == pytest.approx(1.0)
    assert result["grpo"].overall["mean_reward"] == pytest.approx(13.5)
    assert result["grpo"].per_language["en"]["answer_language_accuracy"] == pytest.approx(1.0)
    assert math.isnan(result["grpo"].per_language["fr"]["mean_reward"])


@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.706205), (2, 4.302653), (4, 2.776445), (9, 2.262157), (49, 2.009575), (1000, 1.962339)],
)
def test_student_t_quantile_matches_tables(df, expected):
    assert student_t_quantile(0.975, df) == pytest.approx(expected, abs=1e-5)


def test_wilson_known_values_and_edges():
    assert wilson_interval(8, 10).low == pytest.approx(0.4902, abs=1e-4)
    assert wilson_interval(8, 10).high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 10).low == 0.0
    assert wilson_interval(10, 10).high == pytest.approx(1.0)
    assert math.isnan(wilson_interval(0, 0).value)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


@given(st.integers(1, 500).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_interval_contains_the_rate(pair):
    successes, n = pair
    estimate = wilson_interval(successes, n)
    assert 0.0 <= estimate.low <= estimate.value <= estimate.high <= 1.0


@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=40))
def test_t_interval_contains_the_mean(values):
    estimate = t_interval(values)
    assert estimate.low <= estimate.value + 1e-9
    assert estimate.value <= estimate.high + 1e-9
    assert estimate.n == len(values)
