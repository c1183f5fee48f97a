"""No loop passes the reward: the loop detector (reward/degeneracy.py) and the LOOP verdict.

The loop below is a final answer of the demo's GRPO policy (issue #29): the identifier scores
it Italian, and before the LOOP verdict it earned the whole reward (+7.0).
"""

from __future__ import annotations

import pytest
from conftest import respond
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.loops import real_texts
from core.languages import SUPPORTED_LANGUAGES
from reward.degeneracy import (
    LOOP_WINDOW,
    LoopDetector,
    LoopSignal,
    loop_words,
    window_extremes,
    window_extremes_many,
)
from reward.scoring import ComplianceScorer, Verdict, result_to_dict

DEMO_LOOP = "La con una con una con con una con una con una con una conci delle con una con con un."
IT_REASONING = "Devo calcolare il prezzo totale: tre quaderni a quattro euro fanno dodici euro."
IT_ANSWER = "Il prezzo totale è di dodici euro."


def test_the_demo_loop_scores_as_the_wrong_language(scorer: ComplianceScorer) -> None:
    result = scorer.score(respond(IT_REASONING, DEMO_LOOP), "it")
    assert result.answer_language == "it"  # the identifier alone places it in Italian ...
    assert result.answer_verdict is Verdict.LOOP  # ... the loop check does not
    assert result.answer_loop is LoopSignal.REPEATED_NGRAMS
    assert not result.answer_language_ok
    assert result.components["answer_language"] == -5.0  # the wrong language's weight
    assert result.components["degeneracy"] == -2.0  # and a loop costs more (issue #43)
    assert result.reward == 1.5 - 5.0 + 0.5 - 2.0
    assert result.metrics()["answer_loop"] == 1.0
    assert result_to_dict(result)["answer_loop"] == "repeated_ngrams"
    # as the reasoning too
    both = scorer.score(respond(DEMO_LOOP, DEMO_LOOP), "it")
    assert (both.reasoning_verdict, both.answer_verdict) == (Verdict.LOOP, Verdict.LOOP)
    assert both.reward == -1.5 - 5.0 + 0.5 - 2.0
    # it scored the whole reward with the identifier alone
    assert ComplianceScorer(loop_detector=None).score(respond(IT_REASONING, DEMO_LOOP), "it").reward
    assert scorer.score(respond(IT_REASONING, IT_ANSWER), "it").reward == 7.0


def test_a_loop_in_the_wrong_language_costs_as_much(scorer: ComplianceScorer) -> None:
    """A loop is degenerate in any language (issue #43): the repetition signals, which need
    no language, judge a part in the wrong language too; it scores the wrong language's weight
    and the degeneracy cost, as in the right language."""
    result = scorer.score(respond(IT_REASONING, DEMO_LOOP), "es")
    assert result.answer_verdict is Verdict.LOOP
    assert result.answer_loop is LoopSignal.REPEATED_NGRAMS
    assert result.reward == -1.5 - 5.0 + 0.5 - 2.0


@pytest.mark.parametrize(
    ("text", "signal"),
    [
        (DEMO_LOOP, LoopSignal.REPEATED_NGRAMS),
        ("the answer is the answer is the answer is the answer is", LoopSignal.REPEATED_NGRAMS),
        # four words in an order where no word pair comes back (a de Bruijn sequence)
        (
            "con con una con la con del una una la una del la la del del con",
            LoopSignal.FEW_DISTINCT_WORDS,
        ),
        # one word holding half the text (from the demo's GRPO policy, asked in English)
        ("The the Us the easil is the a the seree.", LoopSignal.DOMINANT_WORD),
        # language-typical fragments (the early reward hack): not French words
        (
            "les ment tion ques eux quement tionsles quelont rontent erstun",
            LoopSignal.UNKNOWN_WORDS,
        ),
    ],
)
def test_each_signal(text: str, signal: LoopSignal) -> None:
    language = "fr" if "les" in text else "en" if "the" in text.lower() else "it"
    assert LoopDetector().signal(text, language) is signal


def test_short_parts_are_never_loops() -> None:
    assert LoopDetector().signal("Sì, sì, sì.", "it") is None
    assert LoopDetector().signal("42", "it") is None
    assert LoopDetector().signal(None, "it") is None


@pytest.mark.parametrize(
    "text",
    [
        # numbers are words: without them these read as repetitions
        "De 23 h 15 à minuit, il y a 45 minutes. De minuit à 6 h 45, il y a 6 heures et 45 "
        "minutes. Au total, 45 minutes plus 6 heures et 45 minutes font 7 heures et 30 minutes.",
        "La racine carrée de 196 est 14, car 14 × 14 = 196.",
        # articles, as plain sentences use them (the dominant-word threshold lies above)
        "La suma de la serie es la mitad de la anterior.",
        "The total is the price of the book plus the tax.",
        # a list, its words said again for each item
        "Monday: 3 hours. Tuesday: 3 hours. Wednesday: 3 hours. Thursday: 3 hours. "
        "Friday: 3 hours.",
    ],
)
def test_real_text_that_repeats_itself_is_not_a_loop(text: str) -> None:
    language = {"De": "fr", "La racine": "fr", "La suma": "es"}
    code = next((c for start, c in language.items() if text.startswith(start)), "en")
    assert LoopDetector().signal(text, code) is None


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_repeated_bigrams"):
        LoopDetector(max_repeated_bigrams=0.0)
    with pytest.raises(ValueError, match="min_words"):
        LoopDetector(min_words=1)
    with pytest.raises(ValueError, match="window"):
        LoopDetector(window=1)
    with pytest.raises(ValueError, match="window"):
        window_extremes(["a", "b"], window=1)


def test_no_real_text_is_a_loop(tmp_path) -> None:
    """The thresholds' first bound: none of the bundled rows' reasonings and answers, nor the
    eval questions, in any of the five languages (docs/reward.md gives the margins)."""
    texts = real_texts(tmp_path)
    assert len(texts) == 2 * 663 + 50
    assert {language for _, language, _ in texts} == set(SUPPORTED_LANGUAGES)
    detector = LoopDetector()
    flagged = [(p, lang, t) for p, lang, t in texts if detector.signal(t, lang) is not None]
    assert flagged == []


# -- properties -------------------------------------------------------------------------------

WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzàèéìòù", min_size=1, max_size=9)


@settings(max_examples=200, deadline=None)
@given(
    cycle=st.lists(WORDS, min_size=1, max_size=10, unique=True),
    repeats=st.integers(3, 12),
    prefix=st.lists(WORDS, max_size=40),
)
def test_a_cycle_said_three_times_is_a_loop(cycle: list[str], repeats: int, prefix) -> None:
    """Any sequence of up to ten distinct words said three times or more (eight words or more
    in all) is a loop, whatever the words: 1 - k / (k·r - 1) >= 5/8 of its word pairs repeat.
    After any other text too, once the loop fills a stretch (32 words): >= 21 of 31 repeat."""
    tokens = cycle * repeats
    if len(tokens) >= LoopDetector().min_words:
        assert loop_words(" ".join(tokens)) == tokens
        assert LoopDetector().signal(" ".join(tokens), "it") is not None
    filling = cycle * max(repeats, -(-LOOP_WINDOW // len(cycle)))
    assert LoopDetector().signal(" ".join(prefix + filling), "it") is not None


def _brute_extremes(tokens: list[str], window: int, min_count: int) -> tuple[float, ...]:
    size = min(window, len(tokens))
    stretches = [tokens[i : i + size] for i in range(len(tokens) - size + 1)]
    repeated = [1 - len(set(zip(s, s[1:], strict=False))) / (size - 1) for s in stretches]
    distinct = [len(set(s)) / size for s in stretches]
    dominant = [max((s.count(w) for w in s if not w.isdigit()), default=0) for s in stretches]
    dominant = [count / size if count >= min_count else 0.0 for count in dominant]
    return max(repeated), min(distinct), max(dominant)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.sampled_from(["a", "b", "c", "d", "e", "1", "2"]), min_size=2, max_size=70),
    window=st.integers(2, 20),
    min_count=st.integers(1, 5),
)
def test_window_extremes_are_the_worst_stretch(tokens: list[str], window: int, min_count: int):
    """The one-pass sliding counts give what every stretch measured on its own gives."""
    found = window_extremes(tokens, window, min_count)
    brute = _brute_extremes(tokens, window, min_count)
    assert (found.repeated_bigrams, found.distinct_ratio, found.dominant_share) == pytest.approx(
        brute
    )


@settings(max_examples=200, deadline=None)
@given(
    lists=st.lists(
        st.lists(st.sampled_from(["a", "b", "c", "d", "1"]), min_size=2, max_size=40),
        min_size=1,
        max_size=6,
    ),
    window=st.integers(2, 12),
    min_count=st.integers(1, 4),
)
def test_lists_measured_together_are_measured_alone(
    lists: list[list[str]], window: int, min_count: int
) -> None:
    """Concatenated in one pass, no list's stretch sees another list's words (the lists
    share their vocabulary, so a leak would show)."""
    together = window_extremes_many(lists, window, min_count)
    for tokens, found in zip(lists, together, strict=True):
        brute = _brute_extremes(tokens, window, min_count)
        assert (found.repeated_bigrams, found.distinct_ratio, found.dominant_share) == (
            pytest.approx(brute)
        )


def test_a_list_too_short_to_measure_is_named() -> None:
    with pytest.raises(ValueError, match="list 1"):
        window_extremes_many([["a", "b"], ["a"]])


@settings(max_examples=100, deadline=None)
@given(
    reasoning_repeats=st.integers(0, 6),
    answer_repeats=st.integers(0, 6),
    label=st.sampled_from(["it", "fr"]),
)
def test_repeating_never_pays(reasoning_repeats: int, answer_repeats: int, label: str) -> None:
    """Saying a compliant part again and again scores at most saying it once."""
    texts = {
        "it": (IT_REASONING, IT_ANSWER),
        "fr": (
            "Nous devons calculer le prix total. Trois cahiers à quatre euros font douze euros.",
            "Le prix total est de douze euros.",
        ),
    }
    reasoning, answer = texts[label]
    scorer = ComplianceScorer()
    once = scorer.score(respond(reasoning, answer), label)
    looped = scorer.score(
        respond(
            " ".join([reasoning] * (1 + reasoning_repeats)),
            " ".join([answer] * (1 + answer_repeats)),
        ),
        label,
    )
    assert looped.reward <= once.reward
    if reasoning_repeats >= 2:
        assert looped.reasoning_verdict is Verdict.LOOP


def test_the_signals_of_the_demo_loop_by_hand() -> None:
    tokens = loop_words(DEMO_LOOP)
    assert len(tokens) == 21
    worst = window_extremes(tokens)
    # 20 word pairs, 8 distinct: la-con con-una una-con con-con una-conci conci-delle
    # delle-con con-un
    assert worst.repeated_bigrams == pytest.approx(1 - 8 / 20)
    assert worst.distinct_ratio == pytest.approx(6 / 21)  # la con una conci delle un
    assert worst.dominant_share == pytest.approx(10 / 21)  # "con" ten times
