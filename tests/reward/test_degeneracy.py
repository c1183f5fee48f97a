"""Degeneracy measures: real-word share (wordfreq lists, offline) and repeated n-grams."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval.runner import BUNDLED_QUESTIONS
from reward.degeneracy import measure_degeneracy, real_word_share, repeated_ngram_rate, words


def test_real_text_is_mostly_real_words():
    rows = [json.loads(line) for line in BUNDLED_QUESTIONS.read_text().splitlines()]
    shares = [real_word_share(words(r["question"], r["language"])) for r in rows]
    assert sum(shares) / len(shares) > 0.95


@pytest.mark.parametrize(
    "text",
    [
        "les ment tion ques eux quement tionsles",  # language-typical fragments
        "erstun gelichen tionsles quelont rontent",  # pseudo-words
        "dieschulerundderlichkeitenungsch einerder",  # glued letters
    ],
)
def test_letter_patterns_score_low(text):
    assert real_word_share(words(text, "fr")) < 0.6


def test_numbers_are_not_words_and_empty_is_nan():
    assert words("480 × 0,35 = 168", "fr") == []
    result = measure_degeneracy(None, "42")
    assert result.words == 0
    assert math.isnan(result.real_word_share)
    assert math.isnan(result.repeated_ngram_rate)


def test_repeated_ngram_rate_by_hand():
    # 3-grams of "the the the the": (the the the) twice → 1 distinct of 2
    assert repeated_ngram_rate(["the"] * 4) == pytest.approx(0.5)
    assert repeated_ngram_rate(["a", "b", "c", "d"]) == 0.0
    # "a b c a b c": abc, bca, cab, abc → 3 distinct of 4
    assert repeated_ngram_rate(["a", "b", "c", "a", "b", "c"]) == pytest.approx(0.25)
    assert math.isnan(repeated_ngram_rate(["a", "b"]))
    with pytest.raises(ValueError):
        repeated_ngram_rate(["a"], n=0)


def test_reasoning_and_answer_are_measured_together():
    result = measure_degeneracy("Die Schule hat viele Schüler.", "Sie hat 168 Schüler.", "de")
    assert result.words == 8
    assert result.real_word_share == 1.0


@given(st.lists(st.sampled_from(["ab", "cd", "ef"]), max_size=30), st.integers(1, 4))
def test_repeated_ngram_rate_is_a_share(tokens, n):
    rate = repeated_ngram_rate(tokens, n)
    assert math.isnan(rate) or 0.0 <= rate < 1.0
