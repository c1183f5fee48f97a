"""The gate's paired test on synthetic per-question scores: how often it promotes an equally
good candidate (its false-promotion rate) and a clearly better one (its power), over seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.gate import GateConfig
from eval.paired import compare, paired_bootstrap, per_question_scores

QUESTIONS, SAMPLES = 50, 5  # 50 questions, 5 samples each (tiny-cpu's eval takes 10)
SEEDS = 200
METRIC = "both_language_accuracy"


def synthetic_results(rng: np.random.Generator, gain: float, samples: int = SAMPLES) -> dict:
    """results.json's responses: each question has its own difficulty (the champion answers
    it right with probability p_q, uniform in [0.2, 0.95]); the candidate with p_q + gain."""
    p = rng.uniform(0.2, 0.95, QUESTIONS)
    responses = []
    for label, chance in (("champion", p), ("grpo", np.clip(p + gain, 0.0, 1.0))):
        hits = rng.random((samples, QUESTIONS)) < chance
        responses += [
            {"model": label, "id": f"q{q}", "sample": k, "values": {METRIC: float(hits[k, q])}}
            for k in range(samples)
            for q in range(QUESTIONS)
        ]
    return {"responses": responses}


def promotion_rate(gain: float, samples: int = SAMPLES) -> float:
    config = GateConfig(resamples=2000)
    promoted = 0
    for seed in range(SEEDS):
        results = synthetic_results(np.random.default_rng(seed), gain, samples)
        test = compare(results, "grpo", "champion", METRIC, config.confidence, config.margin,
                       config.resamples, seed=seed)  # fmt: skip
        promoted += test.better
    return promoted / SEEDS


def test_equal_models_are_promoted_less_than_10_percent_of_the_time():
    rate = promotion_rate(0.0)
    assert rate < 0.10, rate


def test_a_clearly_better_model_is_promoted_more_than_90_percent_of_the_time():
    rate = promotion_rate(0.15)
    assert rate > 0.90, rate


def test_per_question_scores_average_the_samples_and_skip_unscored_ones():
    results = {
        "responses": [
            {"model": "a", "id": "q1", "values": {METRIC: 1.0}},
            {"model": "a", "id": "q1", "values": {METRIC: 0.0}},
            {"model": "a", "id": "q2", "values": None},  # failed: not scored
            {"model": "b", "id": "q1", "values": {METRIC: 1.0}},
        ]
    }
    assert per_question_scores(results, "a", METRIC) == {"q1": 0.5}
    assert per_question_scores(results, "b", METRIC) == {"q1": 1.0}
    assert compare(results, "a", "b", METRIC, 0.95).questions == 1  # paired on q1 only


def test_sign_test_and_power_against_hand_computed_values():
    three_wins = paired_bootstrap([1.0, 1.0, 1.0] + [0.0] * 37, 0.95)
    assert (three_wins.wins, three_wins.losses, three_wins.sign_p) == (3, 0, 1 / 8)
    assert three_wins.lower == 1 / 40  # the bootstrap alone would promote
    assert not three_wins.better  # the sign test does not (p 0.125)
    mixed = paired_bootstrap([1.0, 1.0, -1.0, 0.0], 0.95)
    assert mixed.sign_p == pytest.approx(4 / 8)  # P(Binomial(3, 1/2) >= 2)
    d = [0.5, -0.5] * 25  # mean 0, sd 0.5025
    test = paired_bootstrap(d, 0.95)
    z = 1.6448536269514722 + 0.8416212335729143  # z_0.95 + z_0.8
    assert test.questions_needed(0.1, 0.8) == math.ceil((z * test.sd / 0.1) ** 2) == 158
    assert test.detectable(0.8) == pytest.approx(z * test.sd / math.sqrt(50))
    assert test.questions_needed(0.0, 0.8) is None  # no effect beyond the margin
    with pytest.raises(ValueError, match="no question was scored for both"):
        paired_bootstrap([], 0.95)
