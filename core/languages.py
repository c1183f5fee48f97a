"""The languages lingo-rl trains for, their names, and the label strings that travel with prompts.

A prompt carries two labels: the language the model must *reason* in (the harmony
``analysis`` channel) and the language it must *answer* in (the ``final`` channel).
When one string must carry both (OpenRLHF ``labels``, verl ``ground_truth``), the form is
``"fr"`` (both the same) or ``"fr/en"`` (reasoning ``fr``, answer ``en``).
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_LANGUAGES: tuple[str, ...] = ("en", "fr", "de", "es", "it")
"""ISO 639-1 codes, in the order used by reports."""

OTHER = "other"
"""Outcome of language identification: text in a language outside SUPPORTED_LANGUAGES."""

UNDETERMINED = "und"
"""Outcome of language identification: too little text to judge (ISO 639-2 ``und``)."""

LANGUAGE_NAMES: dict[str, str] = {
    "en": "English",
    "fr": "French",
    "de": "German",
    "es": "Spanish",
    "it": "Italian",
}

_ALIASES: dict[str, str] = {
    **{code: code for code in SUPPORTED_LANGUAGES},
    **{name.lower(): code for code, name in LANGUAGE_NAMES.items()},
    # endonyms, as people write them in configs and prompts
    "français": "fr",
    "francais": "fr",
    "deutsch": "de",
    "español": "es",
    "espanol": "es",
    "castellano": "es",
    "italiano": "it",
    # ISO 639-2 codes
    "eng": "en",
    "fra": "fr",
    "fre": "fr",
    "deu": "de",
    "ger": "de",
    "spa": "es",
    "ita": "it",
}


_CODES = frozenset(SUPPORTED_LANGUAGES)


class UnknownLanguageError(ValueError):
    """A language name or code that lingo-rl does not train for."""


def normalize_language(value: object) -> str:
    """Map a language name, endonym or code to its ISO 639-1 code.

    Accepts ``"French"``, ``"français"``, ``"fr"``, ``"FR"``, ``"fr-FR"``, ``"fr_CA"``, ``"fra"``.

    Raises:
        UnknownLanguageError: ``value`` is not a string naming one of SUPPORTED_LANGUAGES.
    """
    if isinstance(value, str) and value in _CODES:  # already a code: the hot-path case
        return value
    if not isinstance(value, str):
        raise UnknownLanguageError(
            f"language must be a string, got {type(value).__name__}: {value!r}"
        )
    key = value.strip().lower()
    code = _ALIASES.get(key)
    if code is None and len(key) > 2 and key[2:3] in ("-", "_"):
        code = _ALIASES.get(key[:2])  # region subtags: fr-FR, es_MX
    if code is None:
        supported = ", ".join(f"{c} ({n})" for c, n in LANGUAGE_NAMES.items())
        raise UnknownLanguageError(f"unknown language {value!r}; supported: {supported}")
    return code


@dataclass(frozen=True)
class LanguageLabels:
    """The two languages a response is judged against."""

    reasoning: str
    answer: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "reasoning", normalize_language(self.reasoning))
        object.__setattr__(self, "answer", normalize_language(self.answer))

    def to_label(self) -> str:
        """One string: ``"fr"`` when both are the same, else ``"fr/en"`` (reasoning/answer)."""
        if self.reasoning == self.answer:
            return self.reasoning
        return f"{self.reasoning}/{self.answer}"

    @classmethod
    def from_label(cls, label: str) -> LanguageLabels:
        """Parse ``"fr"``, ``"French"`` or ``"fr/en"``.

        Raises:
            UnknownLanguageError: a part is not a supported language, or there are more than two.
        """
        if not isinstance(label, str):
            raise UnknownLanguageError(f"label must be a string, got {type(label).__name__}")
        parts = label.split("/")
        if len(parts) == 1:
            return cls(parts[0], parts[0])
        if len(parts) == 2:
            return cls(parts[0], parts[1])
        raise UnknownLanguageError(
            f"label {label!r} has {len(parts)} parts; use 'fr' or 'fr/en' (reasoning/answer)"
        )
