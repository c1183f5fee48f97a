"""The language-compliance reward (reward/scoring.py): each rule, the bounds, bad input."""

from __future__ import annotations

import math

import pytest
from conftest import respond
from hypothesis import given, settings
from hypothesis import strategies as st

from core.languages import LanguageLabels, UnknownLanguageError
from core.parsing import ParsedResponse, ResponseFormat
from reward import terms
from reward.labels import parse_labels
from reward.scoring import ComplianceScorer, RewardWeights, Verdict, result_to_dict

FR_REASONING = "Nous devons calculer le prix total. Trois cahiers à quatre euros font douze euros."
EN_REASONING = "We need to compute the total price. Three notebooks at four euros make twelve."
DE_REASONING = "Wir müssen den Gesamtpreis berechnen. Drei Hefte zu vier Euro ergeben zwölf Euro."
FR_ANSWER = "Le prix total est de douze euros."
EN_ANSWER = "The total price is twelve euros."
FR_LONG_ANSWER = (
    "Le prix total est de douze euros. Chaque cahier coûte quatre euros. "
    "Il y a trois cahiers en tout."
)


def test_fully_compliant_response_gets_the_maximum(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(FR_REASONING, FR_ANSWER), "fr")
    assert result.reward == 7.0 == scorer.bounds[1]
    assert result.answer_language_ok and result.reasoning_language_ok and result.brief_ok
    assert dict(result.components) == {
        "answer_language": 5.0,
        "reasoning_language": 1.5,
        "brevity": 0.5,
        "degeneracy": 0.0,
        "correctness": 0.0,
    }
    assert (result.answer_language, result.reasoning_language) == ("fr", "fr")
    assert result.answer_fraction == result.reasoning_fraction == 1.0


def test_answer_in_the_wrong_language(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(FR_REASONING, EN_ANSWER), "fr")
    assert result.answer_verdict is Verdict.MISMATCH
    assert result.components["answer_language"] == -5.0
    assert result.reward == -5.0 + 1.5 + 0.5


def test_reasoning_in_the_wrong_language(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(DE_REASONING, FR_ANSWER), "fr")
    assert result.reasoning_verdict is Verdict.MISMATCH
    assert result.reward == 5.0 - 1.5 + 0.5


def test_reasoning_and_answer_labels_may_differ(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(FR_REASONING, EN_ANSWER), "fr/en")
    assert result.reward == 7.0
    assert scorer.score(respond(FR_REASONING, EN_ANSWER), LanguageLabels("fr", "en")).reward == 7.0
    assert scorer.score(respond(FR_REASONING, FR_ANSWER), "fr/en").reward == -5.0 + 1.5 + 0.5


def test_long_answer_is_penalized(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(FR_REASONING, FR_LONG_ANSWER), "fr")
    assert result.answer_sentences == 3 and not result.brief_ok
    assert result.components["brevity"] == -1.0
    assert result.reward == 5.0 + 1.5 - 1.0


def test_missing_final_fails_the_answer_and_brevity_rules(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(FR_REASONING, None), "fr")
    assert result.parsed.truncated
    assert result.answer_verdict is Verdict.MISSING
    assert result.answer_language is None
    # the reasoning was cut off before the answer: it fails its rule too (no refuge)
    assert result.reward == -5.0 - 1.5 - 1.0


def test_empty_final_counts_as_missing(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(FR_REASONING, "  ** "), "fr")
    assert result.answer_verdict is Verdict.MISSING and not result.brief_ok


def test_missing_reasoning_fails_the_reasoning_rule(scorer: ComplianceScorer) -> None:
    result = scorer.score(FR_ANSWER, "fr")  # plain text: no analysis channel
    assert result.parsed.format is ResponseFormat.PLAIN
    assert result.reasoning_verdict is Verdict.MISSING
    assert result.reward == 5.0 - 1.5 + 0.5


def test_a_bare_number_is_neutral_between_right_and_wrong_language(
    scorer: ComplianceScorer,
) -> None:
    result = scorer.score(respond(FR_REASONING, "42"), "fr")
    assert result.answer_verdict is Verdict.NEUTRAL
    assert result.components["answer_language"] == 0.0
    assert result.reward == 0.0 + 1.5 + 0.5
    right = scorer.score(respond(FR_REASONING, FR_ANSWER), "fr").reward
    wrong = scorer.score(respond(FR_REASONING, EN_ANSWER), "fr").reward
    assert wrong < result.reward < right


@pytest.mark.parametrize("answer", ["Oui.", "R.", "ok", "km/h", "42 km"])
def test_an_unidentifiable_answer_scores_as_the_wrong_language(
    scorer: ComplianceScorer, answer: str
) -> None:
    result = scorer.score(respond(FR_REASONING, answer), "fr")
    wrong = scorer.score(respond(FR_REASONING, EN_ANSWER), "fr")
    if result.answer_verdict is Verdict.MATCH:  # the identifier may know a short word
        return
    assert result.answer_verdict in (Verdict.UNDETERMINED, Verdict.MISMATCH)
    assert result.components["answer_language"] == wrong.components["answer_language"] == -5.0


@pytest.mark.parametrize("reasoning", ["R.", "De.", "", "...", "x"])
def test_an_unidentifiable_or_empty_reasoning_scores_as_the_wrong_language(
    scorer: ComplianceScorer, reasoning: str
) -> None:
    result = scorer.score(respond(reasoning, FR_ANSWER), "fr")
    wrong = scorer.score(respond(EN_REASONING, FR_ANSWER), "fr")
    assert result.reasoning_verdict in (Verdict.UNDETERMINED, Verdict.MISSING)
    assert result.reward == wrong.reward == 5.0 - 1.5 + 0.5


def test_reasoning_cut_off_before_the_answer_scores_as_missing(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(FR_REASONING, None), "fr")
    assert result.parsed.truncated
    assert result.reasoning_verdict is Verdict.MISSING
    assert result.reward == -7.5  # the worst a response without a loop gets


def test_an_answer_cut_off_by_the_token_limit_scores_as_the_wrong_language(
    scorer: ComplianceScorer,
) -> None:
    """Reproduces the demo's GRPO run: the policy stopped ending its answers (finished share
    0.77 -> 0.23) because a long answer cut off by the limit still scored its language."""
    finished = scorer.score(respond(FR_REASONING, FR_ANSWER), "fr")
    cut_off = scorer.score(respond(FR_REASONING, FR_ANSWER).removesuffix("<|return|>"), "fr")
    wrong = scorer.score(respond(FR_REASONING, EN_ANSWER), "fr")
    assert finished.answer_verdict is Verdict.MATCH and not finished.parsed.truncated
    assert cut_off.parsed.truncated and cut_off.answer_verdict is Verdict.MISSING
    assert cut_off.reasoning_verdict is Verdict.MATCH  # the reasoning was finished
    assert cut_off.components["answer_language"] == wrong.components["answer_language"] == -5.0
    assert cut_off.components["brevity"] == -1.0
    assert cut_off.reward < wrong.reward < finished.reward


def _prefixes(text: str) -> list[str]:
    """Every prefix of ``text`` at a word boundary, the empty one included."""
    cuts = [0] + [i for i, ch in enumerate(text) if ch == " "] + [len(text)]
    return [text[:i] for i in cuts]


@pytest.mark.parametrize(
    ("reasoning", "answer", "label"),
    [
        (FR_REASONING, FR_ANSWER, "fr"),
        (EN_REASONING, EN_ANSWER, "en"),
        (DE_REASONING, "Der Gesamtpreis beträgt zwölf Euro.", "de"),
        (FR_REASONING, EN_ANSWER, "fr/en"),
    ],
)
def test_no_refuge_shortening_a_compliant_response_never_raises_its_reward(
    scorer: ComplianceScorer, reasoning: str, answer: str, label: str
) -> None:
    """A policy cannot gain by saying less: every shortening of the reasoning, of the answer,
    or of both (down to nothing, or dropping the part) scores at most the full response."""
    full = scorer.score(respond(reasoning, answer), label).reward
    assert full == scorer.bounds[1]
    shorter_reasonings = [*_prefixes(reasoning), None]
    shorter_answers = [*_prefixes(answer), None]
    responses = [respond(r, answer) for r in shorter_reasonings]
    responses += [respond(reasoning, a) for a in shorter_answers]
    responses += [
        respond(r[: len(r) // 3] if r else r, a)
        for r in shorter_reasonings
        for a in shorter_answers[:3]
    ]
    rewards = [result.reward for result in scorer.score_batch(responses, label)]
    assert max(rewards) <= full
    # and the gain of the full answer over any unidentifiable shortening is the whole margin
    dropped = scorer.score(respond(reasoning, None), label).reward
    assert dropped == scorer.bounds[0] - scorer.weights.degenerate_text  # the worst, loops aside


@settings(max_examples=150, deadline=None)
@given(
    reasoning_cut=st.floats(0.0, 1.0),
    answer_cut=st.floats(0.0, 1.0),
    label=st.sampled_from(["fr", "en", "de"]),
)
def test_no_refuge_property(reasoning_cut: float, answer_cut: float, label: str) -> None:
    texts = {
        "fr": (FR_REASONING, FR_ANSWER),
        "en": (EN_REASONING, EN_ANSWER),
        "de": (DE_REASONING, "Der Gesamtpreis beträgt zwölf Euro."),
    }
    reasoning, answer = texts[label]
    scorer = ComplianceScorer()
    short = respond(
        reasoning[: int(len(reasoning) * reasoning_cut)], answer[: int(len(answer) * answer_cut)]
    )
    assert (
        scorer.score(short, label).reward <= scorer.score(respond(reasoning, answer), label).reward
    )


def test_neutral_weight_must_not_beat_the_right_language() -> None:
    with pytest.raises(ValueError, match="answer_language_neutral"):
        RewardWeights(answer_language_neutral=6.0)
    with pytest.raises(TypeError):
        RewardWeights(answer_undetermined=0.0)  # no refuge weight to set


def test_mostly_target_language_passes_and_half_does_not(scorer: ComplianceScorer) -> None:
    quote = (
        "Nous calculons d'abord le prix unitaire. Le client a écrit : \"Please send the "
        'invoice today." Ensuite nous multiplions par la quantité. Le total est donc de '
        "quarante-huit euros."
    )
    half = (
        "Nous devons d'abord calculer le prix total des pommes. "
        "Then we divide the total price by the number of people."
    )
    assert scorer.score(respond(quote, FR_ANSWER), "fr").reasoning_language_ok
    result = scorer.score(respond(half, FR_ANSWER), "fr")
    assert result.reasoning_verdict is Verdict.MISMATCH
    assert 0.35 < result.reasoning_fraction < 0.65


def test_correctness_is_reported_but_not_rewarded_by_default(scorer: ComplianceScorer) -> None:
    right = scorer.score(respond(FR_REASONING, "La réponse est 12,5 euros."), "fr", 12.5)
    wrong = scorer.score(respond(FR_REASONING, "La réponse est 13 euros."), "fr", 12.5)
    words = scorer.score(respond(FR_REASONING, FR_ANSWER), "fr", "12")
    assert (right.correct, right.predicted_answer) == (True, 12.5)
    assert (wrong.correct, wrong.predicted_answer) == (False, 13.0)
    assert words.correct is True  # "douze" read as 12; the expected answer given as a string
    assert right.reward == wrong.reward == 7.0
    assert scorer.score(respond(FR_REASONING, FR_ANSWER), "fr").correct is None
    assert scorer.score(respond(FR_REASONING, None), "fr", 12).correct is False
    assert scorer.score(respond(FR_REASONING, FR_ANSWER), "fr", math.nan).correct is None


def test_correctness_can_be_rewarded() -> None:
    weights = RewardWeights(correct_answer=2.0, wrong_answer=-2.0)
    scorer = ComplianceScorer(weights=weights)
    assert scorer.bounds == (-11.5, 9.0)
    right = scorer.score(respond(FR_REASONING, "C'est 12."), "fr", 12)
    wrong = scorer.score(respond(FR_REASONING, "C'est 13."), "fr", 12)
    assert right.components["correctness"] == 2.0
    assert wrong.components["correctness"] == -2.0


def test_default_bounds() -> None:
    assert RewardWeights().bounds() == (-7.5 - 2.0, 7.0)  # the degeneracy term: -2.0


def test_worst_response_gets_the_minimum(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(EN_REASONING, None), "de")
    assert result.reward == -7.5 == scorer.bounds[0] - scorer.weights.degenerate_text


def test_settings_are_validated_at_construction() -> None:
    with pytest.raises(ValueError, match="answer_language_match"):
        RewardWeights(answer_language_match=math.inf)
    with pytest.raises(ValueError, match="brief_answer"):
        RewardWeights(brief_answer="0.5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_answer_sentences"):
        ComplianceScorer(max_answer_sentences=0)
    with pytest.raises(ValueError, match="min_language_fraction"):
        ComplianceScorer(min_language_fraction=0.5)


def test_label_forms() -> None:
    assert parse_labels("fr") == LanguageLabels("fr", "fr")
    assert parse_labels(" fr/en ") == LanguageLabels("fr", "en")
    assert parse_labels("French") == LanguageLabels("fr", "fr")
    assert parse_labels({"reasoning_language": "de", "answer_language": "it"}) == (
        LanguageLabels("de", "it")
    )
    assert parse_labels({"label": "es/en", "expected_answer": 3}) == LanguageLabels("es", "en")
    for bad in ("xx", "fr/en/de", "", None, 3, {"reasoning": "fr"}):
        with pytest.raises(UnknownLanguageError):
            parse_labels(bad)


def test_unknown_label_in_a_batch_does_not_raise(scorer: ComplianceScorer) -> None:
    results = scorer.score_batch([respond(FR_REASONING, FR_ANSWER)] * 2, ["fr", "xx"])
    assert results[0].reward == 7.0
    assert results[1].reward == 0.0
    assert results[1].error is not None and "xx" in results[1].error
    assert results[1].metrics()["scoring_error"] == 1.0


def test_score_batch_broadcasts_one_label_and_checks_lengths(scorer: ComplianceScorer) -> None:
    results = scorer.score_batch([respond(FR_REASONING, FR_ANSWER), None], "fr", [12, None])
    assert [r.correct for r in results] == [True, None]
    assert results[1].parsed.format is ResponseFormat.EMPTY
    with pytest.raises(ValueError, match="2 responses but 1 labels"):
        scorer.score_batch(["a", "b"], ["fr"])
    with pytest.raises(ValueError, match="2 responses but 3 expected"):
        scorer.score_batch(["a", "b"], "fr", [1, 2, 3])


def test_a_pre_split_response_is_accepted(scorer: ComplianceScorer) -> None:
    parsed = ParsedResponse(ResponseFormat.HARMONY, FR_REASONING, FR_ANSWER, 1)
    assert scorer.score(parsed, "fr").reward == 7.0


def test_result_to_dict_is_json_friendly(scorer: ComplianceScorer) -> None:
    import json

    data = result_to_dict(scorer.score(respond(FR_REASONING, FR_ANSWER), "fr/fr", 12))
    assert data["labels"] == "fr" and data["answer_verdict"] == "match"
    json.dumps(data)


_LABELS = st.one_of(
    st.sampled_from(["en", "fr", "de", "es", "it", "fr/en", "de/it", "es/fr"]),
    st.text(max_size=8),
    st.none(),
    st.integers(),
)
_RESPONSES = st.one_of(
    st.text(max_size=400),
    st.binary(max_size=200),
    st.none(),
    st.builds(
        respond,
        st.one_of(st.none(), st.text(max_size=200)),
        st.one_of(st.none(), st.text(max_size=200)),
    ),
)
_WEIGHT = st.floats(min_value=-100, max_value=100, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    response=_RESPONSES,
    label=_LABELS,
    expected=st.one_of(st.none(), st.floats(), st.text(max_size=10)),
)
def test_never_raises_and_stays_in_bounds(
    response: object, label: object, expected: object
) -> None:
    scorer = ComplianceScorer()
    low, high = scorer.bounds
    (result,) = scorer.score_batch([response], [label], [expected])  # type: ignore[list-item]
    assert math.isfinite(result.reward)
    assert low <= result.reward <= high
    assert all(math.isfinite(v) for v in result.components.values())


@st.composite
def _weights(draw: st.DrawFn) -> RewardWeights:
    match, mismatch = draw(_WEIGHT), draw(_WEIGHT)
    low, high = sorted((match, mismatch))
    neutral = min(max(low + draw(st.floats(0.0, 1.0)) * (high - low), low), high)
    return draw(
        st.builds(
            RewardWeights,
            answer_language_match=st.just(match),
            answer_language_mismatch=st.just(mismatch),
            answer_language_neutral=st.just(neutral),
            reasoning_language_match=_WEIGHT,
            reasoning_language_mismatch=_WEIGHT,
            brief_answer=_WEIGHT,
            long_answer=_WEIGHT,
            correct_answer=_WEIGHT,
            wrong_answer=_WEIGHT,
        )
    )


@settings(max_examples=100, deadline=None)
@given(weights=_weights(), response=_RESPONSES, label=_LABELS)
def test_any_weights_stay_in_their_bounds(
    weights: RewardWeights, response: object, label: object
) -> None:
    scorer = ComplianceScorer(weights=weights)
    low, high = scorer.bounds
    result = scorer.score(response, label, 7)  # type: ignore[arg-type]
    assert low <= result.reward <= high


@pytest.fixture
def reward_terms_restored():
    """Registration adds to the one registry (``reward.terms.REWARD_TERMS``, which the scorer
    reads): it is put back as it was after the test."""
    saved = dict(terms.REWARD_TERMS)
    yield
    terms.REWARD_TERMS.clear()
    terms.REWARD_TERMS.update(saved)


def test_a_new_reward_term_is_one_function_and_one_registration(reward_terms_restored) -> None:
    """Registered with its weights, a term is summed, bounded, reported and settable."""

    @terms.reward_term("finished", finished_answer=0.25, unfinished_answer=-0.75)
    def _finished(judged, w):
        return (
            w.finished_answer
            if judged.answer_verdict is not Verdict.MISSING
            else (w.unfinished_answer)
        )

    default = ComplianceScorer()
    assert default.bounds == (-9.5 - 0.75, 7.0 + 0.25)
    result = default.score(respond(FR_REASONING, FR_ANSWER), "fr")
    assert result.components["finished"] == 0.25 and result.reward == 7.25
    assert default.score(respond(FR_REASONING, None), "fr").components["finished"] == -0.75
    tuned = ComplianceScorer(weights=RewardWeights(finished_answer=1.0))
    assert tuned.score(respond(FR_REASONING, FR_ANSWER), "fr").reward == 8.0
    with pytest.raises(ValueError, match="registered already"):
        terms.reward_term("brevity", brief_answer=1.0)(_finished)
    with pytest.raises(ValueError, match="registered already"):
        terms.reward_term("other", finished_answer=1.0)(_finished)
