"""Turn a validated, labelled row into the JSON record that SFT, GRPO and eval read."""

from __future__ import annotations

from hashlib import blake2b

from core.harmony import render_completion, task_prompt
from core.languages import LANGUAGE_NAMES
from data_prep.labels import RowLabels
from data_prep.validate import ValidRow


def content_key(row: ValidRow) -> bytes:
    """16-byte digest of the fields that make two rows the same example."""
    parts = (row.reasoning_language, row.developer, row.user, row.analysis, row.final, "")
    return blake2b("\x1f".join(parts).encode("utf-8"), digest_size=16).digest()


def build_record(
    row: ValidRow, labels: RowLabels, origin: str, key: bytes, reasoning_effort: str
) -> dict:
    """The output record of one row.

    Keys: ``id``, ``origin``, the labels (``reasoning_language``, ``answer_language``,
    ``label`` as one string, ``user_language``, ``answer_language_source``), the source text
    fields, ``prompt`` (harmony text up to ``<|start|>assistant``), ``completion`` (the
    assistant's analysis and final channels) and ``messages`` (chat form with ``thinking``,
    as Hugging Face chat templates and TRL take it).
    """
    lang = labels.labels
    instructions, prompt = task_prompt(
        LANGUAGE_NAMES[lang.reasoning],
        LANGUAGE_NAMES[lang.answer],
        row.developer,
        row.user,
        reasoning_effort,
    )
    return {
        "id": "mt-" + key[:8].hex(),
        "origin": origin,
        "reasoning_language": lang.reasoning,
        "answer_language": lang.answer,
        "label": lang.to_label(),
        "user_language": labels.user_language,
        "answer_language_source": labels.answer_source,
        "developer": row.developer,
        "user": row.user,
        "analysis": row.analysis,
        "final": row.final,
        "prompt": prompt,
        "completion": render_completion(row.analysis, row.final),
        "messages": [
            {"role": "system", "content": instructions},
            {"role": "user", "content": row.user},
            {"role": "assistant", "content": row.final, "thinking": row.analysis},
        ],
    }
