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
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import filterfalse

import numpy as np

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

LOOP_STUTTER_WORD = 4
"""A word (not a number) said this many times in a row is a loop at any length (``"par par
par par"``): the near-loops under ``min_words`` words the windowed signals cannot judge."""

LOOP_STUTTER_PHRASE = 3
"""A phrase of 2 or 3 words said this many times in a row is a loop at any length."""

FUNCTION_WORDS_TOP = 100
"""A language's function words: the most frequent words of its wordfreq list (articles,
prepositions, pronouns, auxiliaries: ``le la les de des du et …``)."""

SALAD_MIN_WORDS = 4
"""A part of at least this many words with no content word (a number, or a word that is not
a function word) is a stopword salad."""

SALAD_MAX_FUNCTION_SHARE = 0.85
"""A part of at least ``min_words`` words of which function words make up this share or more is
a stopword salad (the bundled training rows' 8,985 distinct reasonings and answers: at most
0.78, "Take a breath; you know more than you think.")."""

COPY_MIN_SHARE = 0.85
"""A part of which this share of the word pairs occurs in the prompt's question copies it (the
bundled training rows: at most 0.78, answers that restate the question with its answer, "Il
massimo comune divisore tra 36 e 60 è 12."; reasonings at most 0.50)."""

_TOKEN = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
"""A word or a number: letters and digits, with apostrophes inside (``l'homme``)."""


class LoopSignal(StrEnum):
    """Why a part is degenerate (a loop in the wide sense: the first signal found)."""

    REPEATED_NGRAMS = "repeated_ngrams"
    FEW_DISTINCT_WORDS = "few_distinct_words"
    DOMINANT_WORD = "dominant_word"
    UNKNOWN_WORDS = "unknown_words"
    STUTTER = "stutter"
    FUNCTION_WORDS = "function_words"
    COPIES_PROMPT = "copies_prompt"


def loop_words(text: str | None) -> list[str]:
    """Lower-cased words and numbers of ``text``, as the loop signals count them.

    Numbers are kept: without them ``"De 23 h 15 à minuit ... De minuit à 6 h 45"`` reads as
    a repetition. A regular expression, ~7x faster than ``wordfreq.tokenize`` (the reward
    scores every rollout).
    """
    return _TOKEN.findall(text.lower()) if text else []


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
    list when shorter): ``window_extremes_many`` for one list.

    Raises:
        ValueError: fewer than two tokens, or ``window`` below 2.
    """
    return window_extremes_many([tokens], window, min_dominant_count)[0]


def window_extremes_many(
    token_lists: Sequence[Sequence[str]],
    window: int = LOOP_WINDOW,
    min_dominant_count: int = LOOP_MIN_DOMINANT_COUNT,
) -> list[WindowExtremes]:
    """``window_extremes`` of each list, all measured in one vectorised pass: the reward
    scores a whole rollout batch, and one numpy pass per part cost more in call overhead than
    in counting (issue #43: the reward's throughput).

    The lists are concatenated; a token's id carries its list (``local``), so a word is never
    matched with its twin in another list, and each list has its stretch size (``window``, or
    its length when shorter). From each position's previous occurrence ``prev`` (of its word,
    and of its word pair): position ``i`` repeats an earlier token of the stretch starting at
    ``s`` when ``prev[i] >= s`` and ``i < s + size``, that is for the starts ``s`` in
    ``[i - size + 1, prev[i]]``; a difference array summed once gives every stretch's repeats
    in O(tokens), with no [stretch, position] matrix. The dominant word's count is
    ``_most_in_a_stretch``'s.

    Raises:
        ValueError: a list of fewer than two tokens, or ``window`` below 2.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    for k, tokens in enumerate(token_lists):
        if len(tokens) < 2:
            raise ValueError(f"need at least 2 tokens, got {len(tokens)} (list {k})")
    if not token_lists:
        return []
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    flat = [token for tokens in token_lists for token in tokens]
    index = {token: i for i, token in enumerate(dict.fromkeys(flat))}
    ids = np.fromiter(map(index.__getitem__, flat), dtype=np.int64, count=len(flat))
    owner = np.repeat(np.arange(len(token_lists)), lengths)
    first = np.cumsum(lengths) - lengths  # each list's first position
    sizes = np.minimum(lengths, window)
    local = owner * len(index) + ids
    # the starts of the stretches of each list, in one array, and where each list's begin
    per_list = lengths - sizes + 1
    begins = np.cumsum(per_list) - per_list
    starts = np.arange(per_list.sum()) - np.repeat(begins - first, per_list)
    from_start = first[owner]
    repeats = _repeats_per_start(_previous_occurrence(local), sizes[owner], from_start)
    prev_pair = _previous_occurrence(local[:-1] * len(index) + ids[1:])
    prev_pair[(first + lengths - 1)[:-1]] = -1  # a list's last word and the next list's first
    pair_repeats = _repeats_per_start(prev_pair, sizes[owner[:-1]] - 1, from_start[:-1])
    distinct = sizes - np.maximum.reduceat(repeats[starts], begins)
    distinct_pairs = sizes - 1 - np.maximum.reduceat(pair_repeats[starts], begins)
    is_number = np.array([token.isdigit() for token in index], dtype=bool)
    top = np.maximum.reduceat(_most_in_a_stretch(local, is_number[ids], sizes[owner]), first)
    return [
        WindowExtremes(
            repeated_bigrams=1.0 - pairs / (size - 1),
            distinct_ratio=words / size,
            dominant_share=most / size if most >= min_dominant_count else 0.0,
        )
        for pairs, words, most, size in zip(
            distinct_pairs.tolist(), distinct.tolist(), top.tolist(), sizes.tolist(), strict=True
        )
    ]


def _repeats_per_start(prev: np.ndarray, size: np.ndarray, first: np.ndarray) -> np.ndarray:
    """For each start ``s``, ``#{i in [s, s + size): prev[i] >= s}``: position ``i`` counts
    for the starts in ``[i - size + 1, prev[i]]``, no earlier than its list's ``first``
    position (``size`` and ``first`` per position; ``size`` counts the items of a stretch:
    words, or word pairs)."""
    position = np.arange(len(prev))
    low = np.maximum(position - size + 1, first)
    counted = prev >= low
    step = np.bincount(low[counted], minlength=len(prev) + 1)
    step -= np.bincount(prev[counted] + 1, minlength=len(prev) + 1)
    return np.cumsum(step)


def _most_in_a_stretch(ids: np.ndarray, is_number: np.ndarray, size: np.ndarray) -> np.ndarray:
    """For each position ``p``, the occurrences of its id in ``[p, p + size[p])`` (0 where
    ``is_number[p]``); their largest is the most occurrences of one word in a stretch.
    Occurrences ``p_i < … < p_j`` of one id fit in one stretch when ``p_j - p_i < size``. One
    sort and one ``searchsorted`` over ``id * 2n + position``, no loop over counts."""
    n = len(ids)
    order = np.argsort(ids, kind="stable")  # positions grouped by id, ascending in each
    key = ids[order] * (2 * n) + order
    counts = np.empty(n, dtype=np.int64)
    counts[order] = np.searchsorted(key, key + size[order], side="left") - np.arange(n)
    counts[is_number] = 0
    return counts


def _previous_occurrence(ids: np.ndarray) -> np.ndarray:
    """For each position, the last earlier position holding the same id (-1 when none)."""
    order = np.argsort(ids, kind="stable")
    prev = np.full(len(ids), -1, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    return prev


@functools.lru_cache(maxsize=1 << 16)
def _known(word: str, language: str) -> bool:
    """Whether ``language``'s word list knows ``word`` (wordfreq splits it as it would)."""
    import wordfreq

    return wordfreq.word_frequency(word, language, wordlist=WORD_LIST) > 0


def known_word_share(tokens: Iterable[str], language: str) -> float:
    """Share of ``tokens`` that ``language``'s word list knows; NaN when empty.

    A token found in the list as it is is known (a set look-up); only the others are asked
    of wordfreq, which may split them as it would (``_known``)."""
    tokens = tokens if isinstance(tokens, Sequence) else list(tokens)
    if not tokens:
        return math.nan
    vocabulary = _vocabularies()[SUPPORTED_LANGUAGES.index(language)]
    missing = set(tokens).difference(vocabulary)  # most text: none or a few
    unknown = {token for token in missing if not _known(token, language)}
    if not unknown:
        return 1.0
    return (len(tokens) - sum(map(unknown.__contains__, tokens))) / len(tokens)


def stutters(tokens: Sequence[str]) -> bool:
    """A word ``LOOP_STUTTER_WORD`` times in a row, or a phrase of 2 or 3 words
    ``LOOP_STUTTER_PHRASE`` times in a row; numbers are never the repeated part (``1/2 × 1/2 ×
    1/2`` is arithmetic, not a loop).

    A phrase of ``n`` words said ``k`` times in a row is a run of ``(k - 1)·n`` positions ``i``
    with ``tokens[i] == tokens[i + n]``.
    """
    for n, times in ((1, LOOP_STUTTER_WORD), (2, LOOP_STUTTER_PHRASE), (3, LOOP_STUTTER_PHRASE)):
        needed, run = (times - 1) * n, 0
        if sum(map(operator.eq, tokens, tokens[n:])) < needed:  # most text: too few repeats
            continue
        for i, same in enumerate(map(operator.eq, tokens, tokens[n:])):
            run = run + 1 if same and not tokens[i].isdigit() else 0
            if run >= needed:
                return True
    return False


@functools.cache
def function_words(language: str) -> frozenset[str]:
    """The ``FUNCTION_WORDS_TOP`` most frequent words of ``language`` (numbers left out)."""
    import wordfreq

    top = wordfreq.top_n_list(language, FUNCTION_WORDS_TOP, wordlist=WORD_LIST)
    return frozenset(word for word in top if not word.isdigit())


def function_word_share(tokens: Sequence[str], language: str) -> float:
    """Share of ``tokens`` that are ``language``'s function words; NaN when empty."""
    common = function_words(language)
    return sum(token in common for token in tokens) / len(tokens) if tokens else math.nan


def prompt_copy_share(tokens: Sequence[str], prompt_tokens: Sequence[str]) -> float:
    """Share of the word pairs of ``tokens`` that occur in ``prompt_tokens``; NaN under two
    words."""
    pairs = list(zip(tokens, tokens[1:], strict=False))
    if not pairs:
        return math.nan
    asked = set(zip(prompt_tokens, prompt_tokens[1:], strict=False))
    return sum(pair in asked for pair in pairs) / len(pairs)


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
        max_function_share: Share of function words from which a part of ``min_words`` words
            or more is a stopword salad (a part of 4 or more with no content word always is).
        min_copy_share: Share of a part's word pairs found in the question from which the
            part copies it.

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
    max_function_share: float = SALAD_MAX_FUNCTION_SHARE
    min_copy_share: float = COPY_MIN_SHARE

    def __post_init__(self) -> None:
        if self.min_words < 2:
            raise ValueError(f"LoopDetector.min_words must be >= 2, got {self.min_words}")
        if self.window < 2:
            raise ValueError(f"LoopDetector.window must be >= 2, got {self.window}")
        shares = ("max_repeated_bigrams", "min_distinct_ratio", "max_dominant_share")
        for name in (*shares, "min_known_share", "max_function_share", "min_copy_share"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"LoopDetector.{name} must be in (0, 1], got {value}")

    def stretches(self, token_lists: Sequence[Sequence[str]]) -> list[WindowExtremes | None]:
        """The worst stretch of each list of tokens, measured together (``None`` for a list
        under ``min_words``, which ``signal`` does not measure): a batch's ``worst``."""
        measured = [tokens for tokens in token_lists if len(tokens) >= self.min_words]
        found = iter(window_extremes_many(measured, self.window, self.min_dominant_count))
        return [next(found) if len(t) >= self.min_words else None for t in token_lists]

    def signal(
        self,
        text: str | None,
        language: str | None,
        prompt_tokens: Sequence[str] = (),
        tokens: Sequence[str] | None = None,
        worst: WindowExtremes | None = None,
    ) -> LoopSignal | None:
        """The first loop signal ``text`` shows as text in ``language``, or ``None``.

        Args:
            text: A part of a response (reasoning or final answer).
            language: The language it was asked in (an ISO code of SUPPORTED_LANGUAGES);
                None: only the signals that need no language (repetition, copying), for a
                part in another language.
            prompt_tokens: The question's ``loop_words``; a part that copies them is
                degenerate (empty: not checked).
            tokens: ``loop_words(text)`` when the caller has them already.
            worst: ``stretches([tokens])[0]`` when the caller has it already.
        """
        tokens = loop_words(text) if tokens is None else tokens
        if len(tokens) >= self.min_words:
            if worst is None:
                worst = window_extremes(tokens, self.window, self.min_dominant_count)
            if worst.repeated_bigrams >= self.max_repeated_bigrams:
                return LoopSignal.REPEATED_NGRAMS
            if worst.distinct_ratio < self.min_distinct_ratio:
                return LoopSignal.FEW_DISTINCT_WORDS
            if worst.dominant_share >= self.max_dominant_share:
                return LoopSignal.DOMINANT_WORD
        if stutters(tokens):
            return LoopSignal.STUTTER
        if (
            len(tokens) >= 3
            and prompt_tokens
            and prompt_copy_share(tokens, prompt_tokens) >= self.min_copy_share
        ):
            return LoopSignal.COPIES_PROMPT
        if language is None:
            return None
        if len(tokens) >= SALAD_MIN_WORDS:
            common = function_words(language)
            content = len(tokens) - sum(map(common.__contains__, tokens))  # numbers: content
            if not content or (
                len(tokens) >= self.min_words
                and 1 - content / len(tokens) >= self.max_function_share
            ):
                return LoopSignal.FUNCTION_WORDS
        words = list(filterfalse(str.isdigit, tokens))
        if (
            len(words) >= self.min_words
            and known_word_share(words, language) < self.min_known_share
        ):
            return LoopSignal.UNKNOWN_WORDS
        return None
