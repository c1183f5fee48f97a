"""Issue #43: the reward cannot be satisfied by saying less or by copying.

Each response below is one the demo's GRPO policy or a hacking endpoint produced (or the
issue's own example of it); each must score below a real answer to the same question.
"""

from __future__ import annotations

import pytest

from reward.degeneracy import (
    LoopDetector,
    LoopSignal,
    function_word_share,
    loop_words,
    prompt_copy_share,
    stutters,
)
from reward.scoring import REWARD_TERMS, ComplianceScorer, RewardWeights, Verdict

QUESTION = "Combien de jours y a-t-il entre le 14 juillet et le 15 août ?"
PROMPT = (
    "<|start|>system<|message|>You are ChatGPT.<|end|><|start|>developer<|message|># "
    "Instructions\n\nreasoning language: French\nanswer language: French<|end|>"
    f"<|start|>user<|message|>{QUESTION}<|end|><|start|>assistant"
)
REAL_REASONING = (
    "Nous devons compter les jours. Du 14 juillet au 31 juillet il y a 17 jours, puis 15 "
    "jours en août."
)
REAL_ANSWER = "Il y a 32 jours entre le 14 juillet et le 15 août."


def respond(reasoning: str, final: str) -> str:
    return (
        f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant"
        f"<|channel|>final<|message|>{final}<|return|>"
    )


@pytest.fixture(scope="module")
def real_reward() -> float:
    result = ComplianceScorer().score(respond(REAL_REASONING, REAL_ANSWER), "fr", 32, PROMPT)
    assert result.reasoning_verdict is Verdict.MATCH
    assert result.answer_verdict is Verdict.MATCH
    return result.reward


@pytest.mark.parametrize(
    ("name", "reasoning", "final"),
    [
        (
            "French stopword salad",
            "le la les de des du et un une au aux ce ces son sa",
            "le la les de des du et",
        ),
        ("the question copied as reasoning and answer", QUESTION, QUESTION),
        ("a loop", "et par par par par par par par par", "et par par par"),
        ("the collapsed reasoning", "et par.", "et par ron à l'."),
        ("a stopword salad as reasoning, a real answer", "le la les de des du et un", REAL_ANSWER),
        ("the question copied as reasoning, a real answer", QUESTION, REAL_ANSWER),
        ("a short stutter in the reasoning, a real answer", "et par par par par", REAL_ANSWER),
    ],
)
def test_hacks_score_below_a_real_answer(name, reasoning, final, real_reward) -> None:
    result = ComplianceScorer().score(respond(reasoning, final), "fr", 32, PROMPT)
    assert result.reward < real_reward, name
    assert result.reasoning_verdict is not Verdict.MATCH, name


def test_the_salad_scored_plus_seven_before() -> None:
    """Without the loop check (the reward before #43 with its LOOP verdict off) the salad
    scores like real text; with it, the salad is a loop of function words."""
    salad = "le la les de des du et un une au aux ce ces son sa leur"
    before = ComplianceScorer(loop_detector=None).score(respond(salad, REAL_ANSWER), "fr")
    after = ComplianceScorer().score(respond(salad, REAL_ANSWER), "fr")
    assert before.reasoning_verdict is Verdict.MATCH
    assert after.reasoning_loop is LoopSignal.FUNCTION_WORDS
    assert after.reward == before.reward - 3.0 - 2.0  # wrong language, and the degeneracy cost


def test_a_loop_anywhere_costs_more_than_the_wrong_language() -> None:
    """A loop in English when French is asked costs the degeneracy weight on top of the
    wrong language's."""
    loop = "the answer is the answer is the answer is the answer is"
    wrong = ComplianceScorer().score(respond(REAL_REASONING, "The answer is 32 days."), "fr")
    looped = ComplianceScorer().score(respond(REAL_REASONING, loop), "fr")
    assert wrong.answer_verdict is Verdict.MISMATCH
    assert looped.answer_verdict is Verdict.LOOP
    assert looped.reward == wrong.reward + RewardWeights().degenerate_text


def test_an_answer_that_restates_the_question_with_its_answer_is_not_a_copy(
    real_reward,
) -> None:
    """The training rows answer so ("Il y a 32 jours entre le 14 juillet et le 15 août.",
    two thirds of its word pairs from the question): not a copy."""
    share = prompt_copy_share(loop_words(REAL_ANSWER), loop_words(QUESTION))
    assert 0.5 < share < LoopDetector().min_copy_share
    assert real_reward == 7.0


def test_reasoning_needs_enough_words() -> None:
    scorer = ComplianceScorer()
    short = scorer.score(respond("Je compte les jours.", REAL_ANSWER), "fr")
    enough = scorer.score(respond("Je compte les jours du mois.", REAL_ANSWER), "fr")
    assert short.reasoning_verdict is Verdict.UNDETERMINED  # 4 words
    assert enough.reasoning_verdict is Verdict.MATCH  # 6 words
    assert short.reward < enough.reward


def test_brevity_is_priced_for_the_answer_only() -> None:
    """A long reasoning costs nothing: only the answer's sentences are counted."""
    long_reasoning = " ".join([REAL_REASONING, "Je vérifie : 17 plus 15 font bien 32."] * 3)
    scorer = ComplianceScorer()
    assert scorer.score(respond(long_reasoning, REAL_ANSWER), "fr").reward == 7.0


def test_stutters_by_hand() -> None:
    assert stutters(loop_words("et par par par par"))
    assert not stutters(loop_words("et par par par"))  # three times: "Sì, sì, sì."
    assert stutters(loop_words("con una con una con una"))
    assert stutters(loop_words("a b c a b c a b c"))
    assert not stutters(loop_words("1 2 1 2 1 2"))  # 1/2 × 1/2 × 1/2
    assert not stutters(loop_words("la la"))


def test_function_word_share_by_hand() -> None:
    assert function_word_share(["le", "chat", "de", "la"], "fr") == 0.75
    assert LoopDetector().signal("Il y en a 12.", "fr") is None  # a number is content
    assert LoopDetector().signal("le la les de", "fr") is LoopSignal.FUNCTION_WORDS


def test_copy_share_by_hand() -> None:
    question = loop_words("what is two plus two")
    assert prompt_copy_share(loop_words("what is two plus two"), question) == 1.0
    assert prompt_copy_share(loop_words("two plus two is four"), question) == 0.5  # 2 of 4 pairs


def test_the_degeneracy_term_is_registered_and_in_the_bounds() -> None:
    assert "degeneracy" in REWARD_TERMS
    assert RewardWeights().bounds() == (-9.5, 7.0)
    assert RewardWeights(degenerate_text=-4.0).bounds() == (-11.5, 7.0)


def test_batch_scoring_reads_the_prompts() -> None:
    scorer = ComplianceScorer()
    responses = [respond(QUESTION, QUESTION), respond(REAL_REASONING, REAL_ANSWER)]
    batch = scorer.score_batch(responses, "fr", prompts=[PROMPT, PROMPT])
    assert [r.answer_loop for r in batch] == [LoopSignal.COPIES_PROMPT, None]
    with pytest.raises(ValueError, match="2 responses but 1 prompts"):
        scorer.score_batch(responses, "fr", prompts=[PROMPT])
