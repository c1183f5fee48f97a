"""Reading the language labels a response is judged against.

A prompt carries two labels from data prep: the reasoning language and the answer language.
Engines carry them as one string, ``"fr"`` (both) or ``"fr/en"`` (reasoning/answer), or as a
mapping; :func:`parse_labels` reads every form. GRPO reads every prompt's labels with it
when the prompts load (``trainer.grpo.prompts.load_prompts``), so a bad one fails there,
naming its file and line, not mid-training.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from core.languages import LanguageLabels, UnknownLanguageError

LabelsLike = LanguageLabels | str | Mapping[str, object]
"""``LanguageLabels``, one label string (``"fr"``: both; ``"fr/en"``: reasoning/answer), or a
mapping with ``reasoning``/``answer`` (or ``reasoning_language``/``answer_language``, or
``label``) keys."""


@lru_cache(maxsize=256)
def _labels_from_string(label: str) -> LanguageLabels:
    return LanguageLabels.from_label(label)


def parse_labels(labels: object) -> LanguageLabels:
    """Read labels given as ``LanguageLabels``, ``"fr"``/``"fr/en"``, or a mapping with
    ``reasoning``/``answer`` (or ``reasoning_language``/``answer_language``) keys.

    Raises:
        UnknownLanguageError: (a ValueError) the labels name an unsupported language or have
            an unreadable form.
    """
    if isinstance(labels, LanguageLabels):
        return labels
    if isinstance(labels, str):
        return _labels_from_string(labels.strip())
    if isinstance(labels, Mapping):
        reasoning = labels.get("reasoning", labels.get("reasoning_language"))
        answer = labels.get("answer", labels.get("answer_language"))
        if reasoning is None and answer is None:
            label = labels.get("label", labels.get("language"))
            if label is not None:
                return parse_labels(label)
        if reasoning is None or answer is None:
            raise UnknownLanguageError(
                f"labels mapping {dict(labels)!r} needs 'reasoning' and 'answer' keys "
                "(or 'reasoning_language' and 'answer_language', or 'label')"
            )
        return LanguageLabels(str(reasoning), str(answer))
    raise UnknownLanguageError(
        f"labels must be LanguageLabels, a string like 'fr' or 'fr/en', or a mapping; "
        f"got {type(labels).__name__}: {labels!r}"
    )
