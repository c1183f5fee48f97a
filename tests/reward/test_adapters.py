"""The scorer behind each engine's reward-function convention (reward/adapters.py)."""

from __future__ import annotations

import math

import pytest
import torch

from reward import adapters
from reward.adapters import (
    LanguageComplianceReward,
    compute_score,
    language_compliance_reward,
    openrlhf_reward_func,
    reward_func,
    verl_compute_score,
)

FR = (
    "<|channel|>analysis<|message|>Nous devons calculer le prix total des cahiers.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Le prix total est de douze euros.<|return|>"
)
EN_DECODED = "analysisWe need to compute the total price.assistantfinalThe total is twelve euros."
PROMPT = "<|start|>user<|message|>Combien ?<|end|><|start|>assistant"


def test_grpo_trainer_reward_scores_a_batch_with_its_results() -> None:
    reward = LanguageComplianceReward()
    batch = reward([FR, EN_DECODED, None], ["fr", "fr/en", "de"], [12, 12, None])
    assert batch.rewards == [7.0, 5.0 - 1.5 + 0.5, -7.5]
    assert [r.correct for r in batch.results] == [True, True, None]
    assert [r.metrics()["answer_missing"] for r in batch.results] == [0.0, 0.0, 1.0]
    assert reward.bounds == (-9.5, 7.0)


def test_openrlhf_returns_one_dimensional_tensors_even_for_one_sample() -> None:
    assert reward_func is openrlhf_reward_func
    out = openrlhf_reward_func([PROMPT + FR], [PROMPT], ["fr"])
    assert out["rewards"].shape == (1,) and out["rewards"].dtype == torch.float32
    assert out["scores"].shape == (1,)
    assert out["rewards"].item() == 7.0 and out["scores"].item() == 1.0
    assert out["extra_logs"] and all(v.dim() == 1 for v in out["extra_logs"].values())
    # OpenRLHF concatenates the logs of several batches with torch.cat
    other = openrlhf_reward_func([PROMPT + EN_DECODED, "junk"], [PROMPT, "p"], ["en", "xx"])
    for key, value in out["extra_logs"].items():
        assert torch.cat([value, other["extra_logs"][key]]).shape == (3,)
    assert other["scores"].min() >= 0.0 and other["scores"].max() <= 1.0
    assert other["extra_logs"]["scoring_error"].tolist() == [0.0, 1.0]


def test_openrlhf_reads_expected_answers_from_label_objects() -> None:
    out = openrlhf_reward_func([FR], [""], [{"label": "fr", "expected_answer": 12}])
    assert out["extra_logs"]["correct"].tolist() == [1.0]
    # 'correct' is left out where some samples have no expected answer (NaN would poison the mean)
    mixed = openrlhf_reward_func([FR, FR], ["", ""], [{"label": "fr", "expected_answer": 12}, "fr"])
    assert "correct" not in mixed["extra_logs"]


def test_openrlhf_without_matching_prompt_parses_the_whole_query() -> None:
    out = openrlhf_reward_func([PROMPT + FR], ["something else"], ["fr"])
    assert out["rewards"].tolist() == [7.0]


def test_verl_compute_score() -> None:
    assert compute_score is verl_compute_score
    result = verl_compute_score("lingo", EN_DECODED, "en", {"expected_answer": 12})
    assert result["score"] == 7.0
    assert result["correct"] == 1.0 and result["answer_judged"] == 1.0
    unjudged = verl_compute_score("lingo", EN_DECODED, "fr", None)
    assert unjudged["score"] == -5.0 - 1.5 + 0.5
    assert unjudged["answer_judged"] == 0.0 and unjudged["correct"] == 0.0
    assert set(result) == set(unjudged)  # verl gathers the same keys for every sample
    assert all(isinstance(v, float) and math.isfinite(v) for v in unjudged.values())
    bad = verl_compute_score("lingo", EN_DECODED, "klingon")
    assert bad["score"] == 0.0 and bad["scoring_error"] == 1.0


def test_trl_with_string_completions_and_label_column() -> None:
    rewards = language_compliance_reward(["p", "p"], [FR, EN_DECODED], label=["fr", "en"])
    assert rewards == [7.0, 7.0]


def test_trl_with_conversational_completions() -> None:
    thinking = [
        {
            "role": "assistant",
            "content": "Le prix total est de douze euros.",
            "thinking": "Nous devons calculer le prix total des cahiers.",
        }
    ]
    content_only = [{"role": "assistant", "content": FR}]
    rewards = language_compliance_reward(
        [[{"role": "user", "content": "?"}]] * 2,
        [thinking, content_only],
        reasoning_language=["fr", "fr"],
        answer_language=["fr", "fr"],
        expected_answer=[12, None],
    )
    assert rewards == [7.0, 7.0]


def test_trl_bad_completions_do_not_raise() -> None:
    rewards = language_compliance_reward(
        ["p"] * 4, [None, [], [{"role": "user", "content": "hi"}], 42], label=["fr"] * 4
    )
    assert len(rewards) == 4 and all(-9.5 <= r <= 7.0 for r in rewards)


def test_trl_without_a_label_column_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs a dataset column 'label'"):
        language_compliance_reward(["p"], [FR], answer=["12"])


def test_the_adapters_share_one_scorer() -> None:
    assert adapters.default_scorer() is adapters.default_scorer()


ONE_TOKEN_REASONING = (
    "<|channel|>analysis<|message|>R.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Le prix total est de douze euros.<|return|>"
)


def test_every_adapter_scores_an_unidentifiable_reasoning_as_the_wrong_language() -> None:
    """No refuge through any engine's convention: a one-token reasoning costs -1.5 in each."""
    expected = 5.0 - 1.5 + 0.5
    assert LanguageComplianceReward()([ONE_TOKEN_REASONING], ["fr"]).rewards == [expected]
    assert openrlhf_reward_func([ONE_TOKEN_REASONING], [""], ["fr"])["rewards"].tolist() == [
        expected
    ]
    assert verl_compute_score("lingo", ONE_TOKEN_REASONING, "fr")["score"] == expected
    assert language_compliance_reward(["p"], [ONE_TOKEN_REASONING], label=["fr"]) == [expected]
    logs = openrlhf_reward_func([ONE_TOKEN_REASONING], [""], ["fr"])["extra_logs"]
    assert logs["reasoning_undetermined"].tolist() == [1.0]


LOOPING_ANSWER = (
    "<|channel|>analysis<|message|>Devo calcolare il prezzo totale dei quaderni.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>La con una con una con con una con una con "
    "una con una conci delle con una con con un.<|return|>"
)


def test_every_adapter_scores_a_loop_as_the_wrong_language() -> None:
    """The demo GRPO policy's Italian loop (issue #29): -5.0 for the answer in each engine's
    convention, where the identifier alone gave +5.0, and the degeneracy term's -2.0 (issue
    #43); the loop is logged where logs exist."""
    expected = 1.5 - 5.0 + 0.5 - 2.0
    assert LanguageComplianceReward()([LOOPING_ANSWER], ["it"]).rewards == [expected]
    openrlhf = openrlhf_reward_func([LOOPING_ANSWER], [""], ["it"])
    assert openrlhf["rewards"].tolist() == [expected]
    assert openrlhf["extra_logs"]["answer_loop"].tolist() == [1.0]
    assert openrlhf["extra_logs"]["reasoning_loop"].tolist() == [0.0]
    verl = verl_compute_score("lingo", LOOPING_ANSWER, "it")
    assert verl["score"] == expected and verl["answer_loop"] == 1.0
    assert set(verl) == set(verl_compute_score("lingo", FR, "fr"))  # the same keys every time
    assert language_compliance_reward(["p"], [LOOPING_ANSWER], label=["it"]) == [expected]
    conversational = [
        {
            "role": "assistant",
            "thinking": "Devo calcolare il prezzo totale dei quaderni.",
            "content": "La con una con una con con una con una con una con una conci delle con "
            "una con con un.",
        }
    ]
    assert language_compliance_reward(["p"], [conversational], label=["it"]) == [expected]
