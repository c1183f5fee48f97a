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

**Loops** (:class:`LoopDetector`), which the reward *does* see: a part of a response (its
reasoning or its final answer) that is a repetition loop, or whose words the requested
language's word list does not know, is not text in that language, whatever the language
identifier says. The identifier judges character n-grams, so a loop of words two languages
share (``"La con una con una con con una ..."``: the demo's GRPO policy, asked in Italian) or
a string of language-typical fragments passes it. ``ComplianceScorer`` gives such a part the
LOOP verdict, scored as the wrong language. Words here are words and numbers; the repetition
signals are measured in every stretch of ``window`` (32) consecutive words and the worst
stretch counts (the whole part when shorter), so long text is judged as short text is. Any
one signal suffices:

* **repeated n-grams**: the share of a stretch's word pairs that repeat an earlier pair
  (``"con una ... con una"``);
* **few distinct words**: distinct words / words in a stretch;
* **dominant word**: one word (not a number) makes up a large share of a stretch, four times
  or more (``"con"`` in ``"Si con una con una aare con una si con una con una conbo."``);
* **unknown words**: the share of the part's words that the requested language's word list
  (wordfreq ``small``) knows: a second check, independent of the identifier's character
  n-grams, that the text is made of that language's words.

Parts under ``min_words`` (8) words are never loops. The thresholds were measured on the
bundled training rows and eval questions (none flagged; each threshold is given beside the
worst real value) and on the demo's GRPO loops: ``python bench/loops.py``, ``docs/reward.md``.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

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


# -- loops: what the reward scores as the wrong language --------------------------------------

LOOP_MIN_WORDS = 8
"""Parts with fewer words (numbers count) are never loops: too little text to tell."""

LOOP_WINDOW = 32
"""Words per stretch in which the repetition signals are measured: the worst stretch of a part
counts (the whole part when shorter), so long text is judged as short text is."""

LOOP_MAX_REPEATED_BIGRAMS = 0.35
"""A stretch whose share of word pairs repeating an earlier pair of the stretch reaches this
is a loop (real text: at most 0.27)."""

LOOP_MIN_DISTINCT_RATIO = 0.4
"""A stretch with a lower share of distinct words is a loop (real text: at least 0.50)."""

LOOP_MAX_DOMINANT_SHARE = 0.4
"""A stretch in which one word (not a number) makes up this share of the words, at least
``LOOP_MIN_DOMINANT_COUNT`` times, is a loop (real text: at most 0.26). Not lower: articles
reach 0.36 in plain sentences ("La suma de la serie es la mitad de la anterior.")."""

LOOP_MIN_DOMINANT_COUNT = 4

LOOP_MIN_KNOWN_SHARE = 0.5
"""A part of whose words (numbers aside) the requested language's word list knows a smaller
share is a loop (real text: at least 0.68)."""

_TOKEN = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
"""A word or a number: letters and digits, with apostrophes inside (``l'homme``)."""


class LoopSignal(StrEnum):
    """Why a part is a loop (the first signal found, in this order)."""

    REPEATED_NGRAMS = "repeated_ngrams"
    FEW_DISTINCT_WORDS = "few_distinct_words"
    DOMINANT_WORD = "dominant_word"
    UNKNOWN_WORDS = "unknown_words"


def loop_words(text: str | None) -> list[str]:
    """Lower-cased words and numbers of ``text``, as the loop signals count them.

    Numbers are kept: without them ``"De 23 h 15 à minuit ... De minuit à 6 h 45"`` reads as
    a repetition. A regular expression, ~7x faster than ``wordfreq.tokenize`` (the reward
    scores every rollout).
    """
    return [word.lower() for word in _TOKEN.findall(text)] if text else []


class _WindowCounts:
    """Counts of the items in a sliding window: how many distinct, and the largest count of an
    item that ``counted`` accepts. Adding or removing an item is O(1)."""

    def __init__(self, counted: Callable[[Hashable], bool] = lambda item: True) -> None:
        self.counts: Counter[Hashable] = Counter()
        self.counted = counted
        self._with_count: Counter[int] = Counter()  # count -> items of `counted` holding it
        self.top = 0

    def add(self, item: Hashable) -> None:
        count = self.counts[item] = self.counts[item] + 1
        if self.counted(item):
            self._with_count[count - 1] -= 1
            self._with_count[count] += 1
            self.top = max(self.top, count)

    def remove(self, item: Hashable) -> None:
        count = self.counts[item] = self.counts[item] - 1
        if not count:
            del self.counts[item]
        if self.counted(item):
            self._with_count[count + 1] -= 1
            self._with_count[count] += 1
            if self.top == count + 1 and not self._with_count[count + 1]:
                self.top = count


@dataclass(frozen=True)
class WindowExtremes:
    """The worst stretch of ``window`` words of a text for each repetition signal.

    Attributes:
        repeated_bigrams: Largest share of a stretch's word pairs that repeat an earlier pair.
        distinct_ratio: Smallest share of distinct words in a stretch.
        dominant_share: Largest share of a stretch held by one word (not a number) that occurs
            at least ``min_dominant_count`` times; 0.0 when none does.
    """

    repeated_bigrams: float
    distinct_ratio: float
    dominant_share: float


def window_extremes(
    tokens: Sequence[str],
    window: int = LOOP_WINDOW,
    min_dominant_count: int = LOOP_MIN_DOMINANT_COUNT,
) -> WindowExtremes:
    """Each repetition signal in the worst stretch of ``window`` consecutive tokens (the whole
    list when shorter), in one pass.

    Raises:
        ValueError: fewer than two tokens, or ``window`` below 2.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if len(tokens) < 2:
        raise ValueError(f"need at least 2 tokens, got {len(tokens)}")
    size = min(window, len(tokens))
    words = _WindowCounts(counted=lambda token: not str(token).isdigit())
    pairs = _WindowCounts()
    repeated = dominant = 0.0
    distinct = 1.0
    for end, token in enumerate(tokens):
        words.add(token)
        if end:
            pairs.add((tokens[end - 1], token))
        if end >= size:
            words.remove(tokens[end - size])
            pairs.remove((tokens[end - size], tokens[end - size + 1]))
        if end >= size - 1:
            distinct = min(distinct, len(words.counts) / size)
            repeated = max(repeated, 1.0 - len(pairs.counts) / (size - 1))
            if words.top >= min_dominant_count:
                dominant = max(dominant, words.top / size)
    return WindowExtremes(repeated, distinct, dominant)


@functools.lru_cache(maxsize=1 << 16)
def _known(word: str, language: str) -> bool:
    """Whether ``language``'s word list knows ``word`` (wordfreq splits it as it would)."""
    import wordfreq

    return wordfreq.word_frequency(word, language, wordlist=WORD_LIST) > 0


def known_word_share(tokens: Iterable[str], language: str) -> float:
    """Share of ``tokens`` that ``language``'s word list knows; NaN when empty."""
    flags = [_known(token, language) for token in tokens]
    return sum(flags) / len(flags) if flags else math.nan


@dataclass(frozen=True)
class LoopDetector:
    """Tells whether a part of a response is a loop (see the module docstring).

    Attributes:
        min_words: Parts with fewer words (numbers count) are never loops; the unknown-words
            signal needs this many words with letters.
        window: Words per stretch for the repetition signals.
        max_repeated_bigrams: Repeated word-pair share from which a stretch is a loop.
        min_distinct_ratio: Distinct-word share below which a stretch is a loop.
        max_dominant_share: One word's share from which a stretch is a loop.
        min_dominant_count: ... when that word occurs at least this many times.
        min_known_share: Share of known words below which a part is a loop.

    Raises:
        ValueError: A setting is out of range.
    """

    min_words: int = LOOP_MIN_WORDS
    window: int = LOOP_WINDOW
    max_repeated_bigrams: float = LOOP_MAX_REPEATED_BIGRAMS
    min_distinct_ratio: float = LOOP_MIN_DISTINCT_RATIO
    max_dominant_share: float = LOOP_MAX_DOMINANT_SHARE
    min_dominant_count: int = LOOP_MIN_DOMINANT_COUNT
    min_known_share: float = LOOP_MIN_KNOWN_SHARE

    def __post_init__(self) -> None:
        if self.min_words < 2:
            raise ValueError(f"LoopDetector.min_words must be >= 2, got {self.min_words}")
        if self.window < 2:
            raise ValueError(f"LoopDetector.window must be >= 2, got {self.window}")
        shares = ("max_repeated_bigrams", "min_distinct_ratio", "max_dominant_share")
        for name in (*shares, "min_known_share"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"LoopDetector.{name} must be in (0, 1], got {value}")

    def signal(self, text: str | None, language: str) -> LoopSignal | None:
        """The first loop signal ``text`` shows as text in ``language``, or ``None``.

        Args:
            text: A part of a response (reasoning or final answer).
            language: The language it was asked in (an ISO code of SUPPORTED_LANGUAGES).
        """
        tokens = loop_words(text)
        if len(tokens) < self.min_words:
            return None
        worst = window_extremes(tokens, self.window, self.min_dominant_count)
        if worst.repeated_bigrams >= self.max_repeated_bigrams:
            return LoopSignal.REPEATED_NGRAMS
        if worst.distinct_ratio < self.min_distinct_ratio:
            return LoopSignal.FEW_DISTINCT_WORDS
        if worst.dominant_share >= self.max_dominant_share:
            return LoopSignal.DOMINANT_WORD
        words = [token for token in tokens if not token.isdigit()]
        if (
            len(words) >= self.min_words
            and known_word_share(words, language) < self.min_known_share
        ):
            return LoopSignal.UNKNOWN_WORDS
        return None
