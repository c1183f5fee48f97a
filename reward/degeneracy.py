"""Degeneracy of generated text: signals the language-compliance reward does not see.

A policy that hacks the reward emits strings of language-typical letter patterns that the
language detector scores as perfect (seen in early GRPO runs on the tiny model). Two offline
measures catch it:

* **real-word share**: the share of word tokens (those with at least one letter) found in the
  word list of any supported language. Word lists: ``wordfreq``'s ``small`` lists (the ~30k
  most frequent words of each language, bundled in the wheel, no network). The eval's own
  questions score 0.98; strings such as ``"les ment tion ques eux quement tionsles"`` score
  0.4-0.6, glued pseudo-words 0.0. A rare but real word (a long German compound) counts as
  not real, so the share of fluent text sits a little below 1.
* **repeated n-gram rate**: the share of word n-grams (default 3) that repeat an earlier
  n-gram of the same text, ``1 - distinct / total``; loops such as "the the the" push it
  towards 1.

Both ignore which language a word belongs to: language compliance is the reward's job.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from core.languages import SUPPORTED_LANGUAGES

WORD_LIST = "small"
"""The wordfreq list used as the vocabulary of real words."""

NGRAM = 3


class WordListUnavailableError(RuntimeError):
    """The ``wordfreq`` package (a base dependency) is not installed."""


@functools.cache
def _vocabularies() -> tuple[frozenset[str], ...]:
    try:
        import wordfreq
    except ImportError as err:  # pragma: no cover - wordfreq is a base dependency
        raise WordListUnavailableError(
            "the degeneracy metric needs the 'wordfreq' package: pip install wordfreq"
        ) from err
    return tuple(
        frozenset(wordfreq.get_frequency_dict(code, wordlist=WORD_LIST))
        for code in SUPPORTED_LANGUAGES
    )


def words(text: str | None, language: str = "en") -> list[str]:
    """Lower-cased word tokens of ``text`` that hold at least one letter (numbers dropped).

    Args:
        text: Any text; ``None`` gives no words.
        language: ISO code used by the tokenizer (it affects apostrophes and compounds only).
    """
    if not text:
        return []
    import wordfreq

    return [t for t in wordfreq.tokenize(text, language) if any(c.isalpha() for c in t)]


def real_word_share(tokens: Iterable[str]) -> float:
    """Share of ``tokens`` found in a supported language's word list; NaN when empty."""
    vocabularies = _vocabularies()
    total = found = 0
    for token in tokens:
        total += 1
        found += any(token in vocabulary for vocabulary in vocabularies)
    return found / total if total else math.nan


def repeated_ngram_rate(tokens: list[str], n: int = NGRAM) -> float:
    """``1 - distinct n-grams / n-grams``; 0.0 for a text with no repeat, NaN under n tokens.

    Raises:
        ValueError: ``n`` is below 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return math.nan
    return 1.0 - len(set(grams)) / len(grams)


@dataclass(frozen=True)
class Degeneracy:
    """Degeneracy measures of one response (reasoning and final answer together).

    Attributes:
        words: Word tokens found.
        real_word_share: Share of them that are real words (NaN when there are none).
        repeated_ngram_rate: Share of repeated word n-grams (NaN when too short).
    """

    words: int
    real_word_share: float
    repeated_ngram_rate: float


def measure_degeneracy(
    reasoning: str | None, final: str | None, language: str = "en", n: int = NGRAM
) -> Degeneracy:
    """Measure one response's reasoning and final answer as one text.

    Args:
        reasoning: The analysis channel text, if any.
        final: The final answer text, if any.
        language: The requested language (used only to tokenize).
        n: The n-gram size of the repetition measure.
    """
    text = "\n".join(part for part in (reasoning, final) if part)
    tokens = words(text, language)
    return Degeneracy(
        words=len(tokens),
        real_word_share=real_word_share(tokens),
        repeated_ngram_rate=repeated_ngram_rate(tokens, n),
    )
