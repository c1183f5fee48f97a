"""One outcome type for the eval and GRPO's held-out eval (``reward.outcome``): the language
accuracies are defined once, GRPO's held-out result is typed, and run states written before
the type existed still load."""

from __future__ import annotations

import json
import math

from eval.eval_metrics import summarize
from reward.outcome import HeldOutResult, LanguageResult, Outcome
from trainer.grpo.producer import StepRollouts
from trainer.grpo.recipe import GRPOResult, RunState

OUTCOMES = [
    Outcome("fr", reasoning_ok=True, answer_ok=True, reward=6.0, real_word_share=1.0),
    Outcome("fr", reasoning_ok=True, answer_ok=False, reward=1.0, real_word_share=0.5),
    Outcome("de", reasoning_ok=False, answer_ok=True, reward=-2.0, repeated_ngram_rate=0.5),
    Outcome(None, reasoning_ok=True, answer_ok=True, reward=3.0),
]

# A held-out result as the run state and summary kept it before the type (commit 308935d
# wrote ``{"step": done, **held_out}`` with these keys, in this order).
OLD_BEST = {
    "step": 3,
    "mean_reward": 2.0,
    "answer_language_accuracy": 0.75,
    "reasoning_language_accuracy": 0.75,
    "both_language_accuracy": 0.5,
    "real_word_share": 0.75,
    "repeated_ngram_rate": 0.5,
    "finished_fraction": 0.25,
    "mean_reward_de": -2.0,
    "both_language_accuracy_de": 0.0,
    "mean_reward_fr": 3.5,
    "both_language_accuracy_fr": 0.5,
}
OLD_BASELINE = {k: v for k, v in OLD_BEST.items() if k != "step"}
OLD_ROLLOUT = {
    "prompt_index": 0,
    "response_ids": [5, 6, 2],
    "finished": True,
    "log_probs": [-0.5, -1.0, -0.1],
    "routed_experts": None,
}
OLD_STATE = {
    "step": 4,
    "baseline": OLD_BASELINE,
    "best": OLD_BEST,
    "last_eval": {**OLD_BEST, "step": 4},
    "in_flight": [
        {
            "step": 5,
            "version": 4,
            "rollouts": [OLD_ROLLOUT],
            "generate_s": 0.25,
            "wait_s": 0.0,
            "engine_idle_s": None,
        }
    ],
    "sync_floor": None,
    "mismatch_floor": 0.001,
}


def test_held_out_means_by_hand():
    result = HeldOutResult.from_outcomes(OUTCOMES, [True, False, False, False])
    assert result == HeldOutResult.from_json(OLD_BASELINE)
    assert result.mean_reward == 2.0 and result.both_language_accuracy == 0.5
    # NaN degeneracy measures are left out; the unlabelled response counts overall only
    assert result.real_word_share == 0.75 and result.repeated_ngram_rate == 0.5
    assert result.per_language == {
        "de": LanguageResult(-2.0, 0.0),
        "fr": LanguageResult(3.5, 0.5),
    }


def test_no_degeneracy_measures_give_zero_as_before():
    result = HeldOutResult.from_outcomes([Outcome("en", reward=1.0)], [True])
    assert (result.real_word_share, result.repeated_ngram_rate) == (0.0, 0.0)


def test_the_eval_and_grpo_count_the_same_language_accuracies():
    labelled = [o for o in OUTCOMES if o.language is not None]
    held_out = HeldOutResult.from_outcomes(labelled, [True] * len(labelled))
    summary = summarize(labelled)
    for metric in (
        "reasoning_language_accuracy",
        "answer_language_accuracy",
        "both_language_accuracy",
    ):
        assert summary.value(metric) == getattr(held_out, metric), metric
    assert summary.value("both_language_accuracy", "fr") == (
        held_out.per_language["fr"].both_language_accuracy
    )
    assert math.isclose(summary.value("mean_reward"), held_out.mean_reward)


def test_a_run_state_written_before_the_type_loads_and_writes_back_the_same():
    state = RunState.from_json(json.loads(json.dumps(OLD_STATE)))
    assert isinstance(state.baseline, HeldOutResult) and state.baseline.step is None
    assert state.best.step == 3 and state.best.mean_reward == 2.0
    assert state.last_eval.step == 4
    assert state.best.per_language["fr"] == LanguageResult(3.5, 0.5)
    assert isinstance(state.in_flight[0], StepRollouts)
    assert state.in_flight[0].rollouts[0].response_ids == [5, 6, 2]
    written = state.to_json()
    # a field added since (the stale steps' mismatch floor, issue #39) is written as None
    expected = OLD_STATE | {"stale_mismatch_floor": None}
    assert _without_43(json.loads(json.dumps(written))) == expected
    assert list(_without_43(written["best"])) == list(OLD_BEST)  # the same keys, same order


def test_an_empty_state_is_a_fresh_run():
    assert RunState.from_json(None) == RunState() == RunState.from_json({})


def test_the_summary_file_keeps_its_form():
    old = {
        "model_dir": "/m",
        "metrics_file": "/w/training_metrics.jsonl",
        "plot": None,
        "steps": 4,
        "baseline": OLD_BASELINE,
        "final": {**OLD_BEST, "step": 4},
        "exported": OLD_BEST,
        "exported_step": 3,
    }
    result = GRPOResult.from_json(old)
    assert result.exported.step == result.exported_step == 3
    assert result.exported.mean_reward - result.baseline.mean_reward == 0.0
    assert _without_43(json.loads(json.dumps(result.to_json()))) == old


def _without_43(data):
    """``data`` without the held-out keys issue #43 added (``loop_rate``,
    ``median_reasoning_words``, overall and per language: 0.0 when read from an old state)."""
    if isinstance(data, dict):
        new = ("loop_rate", "median_reasoning_words")
        return {k: _without_43(v) for k, v in data.items() if not (k.startswith(new) and v == 0.0)}
    return data
