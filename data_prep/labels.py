"""The two language labels of a row: the language to reason in and the language to answer in.

* reasoning language: the row's ``reasoning_language`` (in Multilingual-Thinking only the
  ``analysis`` is written in it).
* answer language, by policy:
  - ``user`` (default): the language the user wrote in, detected. When the user message is
    too short or not in a supported language, the language of the reference answer
    (``final``) is used, and English when that cannot be told either; ``answer_source`` says
    which one applied.
  - ``same-as-reasoning``: the reasoning language, for prompts that ask for one language
    throughout (as the 50-question eval does).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, NamedTuple

from core.language_id import identify_language
from core.languages import SUPPORTED_LANGUAGES, LanguageLabels

AnswerSource = Literal["user", "final", "default", "reasoning"]
DEFAULT_ANSWER_LANGUAGE = "en"


class RowLabels(NamedTuple):
    """Labels of one row, plus what they were derived from."""

    labels: LanguageLabels
    user_language: str
    """Detected language of the user message (a code, ``other`` or ``und``)."""
    answer_source: AnswerSource


def assign_labels(reasoning_language: str, user: str, final: str, policy: str) -> RowLabels:
    """Label one row (see the module docstring for the rules)."""
    user_language = identify_language(user)
    if policy == "same-as-reasoning":
        return RowLabels(
            _language_labels(reasoning_language, reasoning_language), user_language, "reasoning"
        )
    if policy != "user":
        raise ValueError(f"answer_language_policy {policy!r}: use 'user' or 'same-as-reasoning'")
    if user_language in SUPPORTED_LANGUAGES:
        answer, source = user_language, "user"
    else:
        final_language = identify_language(final)
        if final_language in SUPPORTED_LANGUAGES:
            answer, source = final_language, "final"
        else:
            answer, source = DEFAULT_ANSWER_LANGUAGE, "default"
    return RowLabels(_language_labels(reasoning_language, answer), user_language, source)


@lru_cache(maxsize=64)
def _language_labels(reasoning: str, answer: str) -> LanguageLabels:
    """The (immutable) labels of a language pair, built once per pair rather than per row."""
    return LanguageLabels(reasoning, answer)
