"""Word-frequency evidence that lets language ID decide short text (2-6 words).

fastText's character n-grams are reliable on a sentence but not on "Merci beaucoup." (it
abstains) or "What do mitochondria do?" (it says Italian): a few words carry too few n-grams.
The words themselves settle most of these at once: "beaucoup" is frequent in French and
nowhere else. This module scores a short text with a naive-Bayes sum of the words' log
frequencies per language (``wordfreq``'s "small" lists: the words with a frequency of at
least 1e-6, ~15 ms to load per language), and combines it with fastText's probabilities:

    score(l) = log(p_fastText(l) + PRIOR_FLOOR) + sum over words w of log max(f(w, l), WORD_FLOOR)

for l in en/fr/de/es/it and OTHER, where p_fastText(OTHER) is fastText's mass outside the
five languages and f(w, OTHER) is OTHER_DISCOUNT times w's highest frequency in the
OTHER_WORDLIST_LANGUAGES (languages that share words with ours: Portuguese, Dutch,
Catalan, ...). The discount stands for "a word of ours that other languages also use" (English
loanwords are frequent in Dutch and Swedish web text). The outcome is the best ``l`` when its
share of ``exp(score)`` is at least MIN_POSTERIOR, else UNDETERMINED, with two guards for text
without language evidence:

* fewer than MIN_WORD_LETTERS letters in words of two letters or more: UNDETERMINED (one-letter
  words are variables in "y = mx + b" as often as the Spanish "y");
* *name-like* text (every word of four letters or more has a capital letter and is known in
  at least NAME_LANGUAGES of the five lists: "Paris", "Angela Merkel", "Tesla Model 3") is
  decided only when the words alone favour the outcome over every other by NAME_MARGIN
  ("Vielen Dank" passes; "Berlin", which German uses a little more, does not).

Links and e-mail addresses are left out of the words. The constants were chosen on
``bench/data/short_phrases.jsonl`` and checked on ``bench/data/langid_testset.jsonl``; the
accuracy is flat around them (``docs/reward.md``).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from core.languages import SUPPORTED_LANGUAGES

OTHER_WORDLIST_LANGUAGES: tuple[str, ...] = (
    *("pt", "nl", "ca", "ro", "sv", "da", "nb", "pl"),
    *("cs", "sk", "sl", "sh", "tr", "fi", "hu", "id"),
)
"""Languages whose word lists stand for OTHER (wordfreq codes; ``sh``: Serbo-Croatian)."""

WORDLIST = "small"
"""wordfreq list read for every language: frequencies of at least 1e-6."""

WORD_FLOOR = 3e-7
"""Frequency given to a word missing from a language's list (below the list's 1e-6 cut)."""

OTHER_DISCOUNT = 0.1
"""Factor on a word's best frequency in OTHER_WORDLIST_LANGUAGES when it stands for OTHER."""

PRIOR_FLOOR = 1e-3
"""Added to fastText's probabilities before the log: fastText alone cannot veto a language by
more than ~7 nats, and fastText's C++ and its numpy re-implementation (which differ below
1e-5) give the same scores."""

MIN_POSTERIOR = 0.7
"""Share of the combined probability the outcome needs; else UNDETERMINED."""

MIN_WORD_LETTERS = 4
"""Letters (in words of two letters or more) below which a text is UNDETERMINED."""

NAME_LANGUAGES = 3
"""A capitalised word known in this many of the five lists may be a name."""

NAME_MARGIN = math.log(100.0)
"""How much more likely (log) the words alone must make the outcome of a name-like text."""

_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
_LINK = re.compile(r"\S+://\S*|\S+@\S+\.\S+|www\.\S+")


class WordEvidence:
    """Decides short texts from fastText's probabilities and the frequencies of their words.

    Word frequencies are looked up once per distinct lower-cased word and cached (up to
    65,536 words, ~15 MB; the cache is emptied when a batch would overflow it); ``wordfreq``
    and its lists are loaded on first use (~0.4 s). Thread-safe.
    """

    _CACHE_LIMIT = 1 << 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clear_cache()

    def _clear_cache(self) -> None:
        self._column: dict[str, int] = {}
        # per word (row): log-likelihood under each supported language and OTHER
        self._table = np.zeros((1024, len(SUPPORTED_LANGUAGES) + 1))
        self._known_in = np.zeros(1024, np.intp)  # per word: how many of the five lists know it

    def _columns(self, words: list[str]) -> np.ndarray:
        """Row of ``_table`` of each lower-cased word, adding the words not yet cached."""
        column = self._column
        new = {word for word in words if word not in column}
        if new:
            if len(column) + len(new) > self._CACHE_LIMIT:
                self._clear_cache()
                column = self._column
                new = set(words)
            needed = len(column) + len(new)
            if needed > len(self._table):
                size = max(needed, 2 * len(self._table))
                grown = np.zeros((size, self._table.shape[1]))
                grown[: len(column)] = self._table[: len(column)]
                self._table = grown
                self._known_in = np.resize(self._known_in, size)
            for word in new:
                row = len(column)
                self._table[row], self._known_in[row] = _word_row(word)
                column[word] = row
        return np.fromiter(map(column.__getitem__, words), np.intp, len(words))

    def outcomes(self, distributions: np.ndarray, texts: Sequence[str]) -> np.ndarray:
        """Outcome of each text: an index into ``(*SUPPORTED_LANGUAGES, OTHER)``, or -1 for
        UNDETERMINED.

        Args:
            distributions: ``(len(texts), 6)`` fastText probability of each supported
                language and of all other languages together (OTHER), per text.
            texts: The texts, as written (capital letters matter for names).
        """
        result = np.full(len(texts), -1, np.intp)
        words_of = [_WORD.findall(_without_links(text)) for text in texts]
        gated = [
            i
            for i, words in enumerate(words_of)
            if sum(len(word) for word in words if len(word) > 1) >= MIN_WORD_LETTERS
        ]
        if not gated:
            return result
        counts = [len(words_of[i]) for i in gated]
        flat = [word for i in gated for word in words_of[i]]
        with self._lock:
            columns = self._columns([word.lower() for word in flat])
            likelihoods = self._table[columns]
            known_in = self._known_in[columns]
        starts = [0, *accumulate(counts[:-1])]
        likelihood = np.add.reduceat(likelihoods, starts, axis=0)
        score = np.log(distributions[gated] + PRIOR_FLOOR) + likelihood
        best = score.argmax(axis=1)
        rows = np.arange(len(gated))
        # the best outcome's share of exp(score), computed without overflow
        posterior = 1.0 / np.exp(score - score[rows, best, None]).sum(axis=1)
        decided = posterior >= MIN_POSTERIOR
        # name-like: every word of four letters or more has a capital letter and is known in
        # NAME_LANGUAGES of the five lists (and there is such a word)
        for j in np.flatnonzero(decided).tolist():
            start, end = starts[j], starts[j] + counts[j]
            words = flat[start:end]
            if not any(len(word) >= 4 for word in words) or any(
                len(word) >= 4 and (word.islower() or known < NAME_LANGUAGES)
                for word, known in zip(words, known_in[start:end].tolist(), strict=True)
            ):
                continue
            words_only = likelihood[j].copy()
            words_only[best[j]] = -np.inf
            decided[j] = likelihood[j, best[j]] - words_only.max() >= NAME_MARGIN
        result[np.array(gated)[decided]] = best[decided]
        return result


def _without_links(text: str) -> str:
    """``text`` with links and e-mail addresses blanked out."""
    if "://" in text or "@" in text or "www." in text:
        return _LINK.sub(" ", text)
    return text


def _word_row(word: str) -> tuple[np.ndarray, int]:
    """Log-likelihood of a lower-cased word under each supported language and OTHER, and
    the number of the five lists that know it."""
    from wordfreq import word_frequency

    mine = [word_frequency(word, code, wordlist=WORDLIST) for code in SUPPORTED_LANGUAGES]
    other = max(word_frequency(word, code, wordlist=WORDLIST) for code in OTHER_WORDLIST_LANGUAGES)
    likelihoods = np.maximum([*mine, OTHER_DISCOUNT * other], WORD_FLOOR)
    return np.log(likelihoods), sum(f > 0 for f in mine)
