"""Offline language identification restricted to lingo-rl's languages (plus "other").

Public API (used by data_prep, the reward and the eval):
    identify_language(text) -> "en" | "fr" | "de" | "es" | "it" | OTHER | UNDETERMINED
"""

from __future__ import annotations

import re
from functools import lru_cache

from eval.languages import OTHER, SUPPORTED_LANGUAGES, UNDETERMINED

MIN_LETTERS = 12
"""Below this many letters a text is UNDETERMINED rather than guessed."""

_LETTER = re.compile(r"[^\W\d_]", re.UNICODE)


@lru_cache(maxsize=1)
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def identify_language(text: str) -> str:
    """Return the ISO 639-1 code of ``text``'s language, OTHER, or UNDETERMINED.

    Texts with fewer than MIN_LETTERS letters are UNDETERMINED: too short to judge.
    """
    if not isinstance(text, str) or len(_LETTER.findall(text[:2000])) < MIN_LETTERS:
        return UNDETERMINED
    code, _prob = _identifier().classify(text)
    return code if code in SUPPORTED_LANGUAGES else OTHER
