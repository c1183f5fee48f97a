"""Multilingual question sets mixed into GRPO's prompts (``DataPrepConfig.question_sets``).

The deployed task asks a question written in language L and wants reasoning and answer in L.
Multilingual-Thinking's user questions are English, so a policy trained only on them never
sees a question in French. A question set adds prompts that mirror deployment: each row's
question, labelled (L, L) with L the question's language (a column, or detected), rendered
with the one prompt convention (``core.harmony.task_prompt``).

The rows are *prompt-only* records (``"prompt_only": true``, no ``analysis``/``final``/
``completion``): GRPO samples them (with the set's ``weight``, ``"prompt_weight"``), SFT and
augmentation skip them. They go to the train split only; the held-out split stays the main
dataset's. A row without the question column, with an empty question or with a language
outside en/fr/de/es/it is quarantined with its reason, like any bad row; a repeated question
(within or across sets) is quarantined as a duplicate. A set that gives no question, or loses
more than its ``max_bad_fraction`` of rows, fails the step (``QuestionSetError``): a column
that does not exist must not turn into "every row quarantined, exit 0".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from hashlib import blake2b
from typing import Any, BinaryIO

import orjson

from core.harmony import task_prompt
from core.language_id import identify_language
from core.languages import LANGUAGE_NAMES, SUPPORTED_LANGUAGES, UnknownLanguageError
from core.languages import normalize_language as _normalize
from data_prep.config import QuestionSetConfig
from data_prep.process import quarantine_entry
from data_prep.sources import iter_source, parse_row
from data_prep.validate import (
    DUPLICATE,
    EMPTY_FIELD,
    INVALID_JSON,
    MISSING_FIELD,
    NOT_A_STRING,
    NOT_AN_OBJECT,
    OVERSIZE,
    UNKNOWN_LANGUAGE,
    Rejection,
    check_text,
)


class QuestionSetError(ValueError):
    """A question set gave no question, or lost more rows than it allows."""


class QuestionSetCounts:
    """Rows read, kept and quarantined over all question sets, with kept rows by language."""

    def __init__(self) -> None:
        self.read = 0
        self.kept = 0
        self.bad = 0
        self.by_language: dict[str, int] = dict.fromkeys(SUPPORTED_LANGUAGES, 0)


class _SetTally:
    """One set's rows: read, kept, bad (repeats aside), reasons, the first row's columns."""

    def __init__(self) -> None:
        self.read = self.kept = self.bad = 0
        self.reasons: Counter[str] = Counter()
        self.missing: Counter[str] = Counter()
        """Rows without a named column, by column."""
        self.columns: list[str] | None = None

    def count_missing(self, question_set: QuestionSetConfig, data: Any) -> None:
        """Count the set's named columns that the row ``data`` lacks."""
        for column in (question_set.question_column, question_set.language_column):
            if column is not None and not (isinstance(data, dict) and column in data):
                self.missing[column] += 1

    def check(self, number: int, question_set: QuestionSetConfig) -> None:
        """Raise ``QuestionSetError`` when the set gave nothing or lost too much."""
        where = f"data_prep.question_sets[{number}] ({question_set.source})"
        present = ", ".join(self.columns) if self.columns else "none"
        for column, field in (
            (question_set.question_column, "question_column"),
            (question_set.language_column, "language_column"),
        ):
            if column is not None and self.read and self.missing[column] == self.read:
                raise QuestionSetError(
                    f"{where}: no row has the column {column!r} ({field}); the columns are: "
                    f"{present}. Set {field} to the right one."
                )
        if self.kept == 0:
            raise QuestionSetError(
                f"{where}: no usable question in {self.read} rows (reasons: "
                f"{dict(self.reasons) or 'the source is empty'}); the rejected rows are in the "
                "quarantine file"
            )
        share = self.bad / self.read
        if share > question_set.max_bad_fraction:
            raise QuestionSetError(
                f"{where}: {self.bad} of {self.read} rows quarantined ({share:.1%} > "
                f"max_bad_fraction {question_set.max_bad_fraction:.1%}; reasons "
                f"{dict(self.reasons)}); the rejected rows are in the quarantine file. Fix "
                "the set or raise its max_bad_fraction."
            )


def append_question_prompts(
    sets: list[QuestionSetConfig],
    train: BinaryIO,
    quarantine: BinaryIO,
    reasoning_effort: str,
    max_field_chars: int,
) -> QuestionSetCounts:
    """Write each set's questions as prompt-only train records; quarantine the bad rows.

    Raises:
        SourceError: a set's source cannot be read.
        QuestionSetError: a set gave no question (a column that does not exist is named, with
            the columns there are), or lost more than its ``max_bad_fraction`` of rows.
    """
    counts = QuestionSetCounts()
    seen: set[bytes] = set()
    for number, question_set in enumerate(sets):
        tally = _SetTally()
        for index, origin, data, problem in _rows(question_set, number):
            counts.read += 1
            tally.read += 1
            if tally.columns is None and isinstance(data, dict):
                tally.columns = sorted(map(str, data))
            if problem is None:
                question, language, problem = _question(question_set, data, max_field_chars)
            if problem is None:
                key = blake2b(question.strip().casefold().encode(), digest_size=16).digest()
                if key in seen:
                    problem = Rejection(DUPLICATE, "the same question is in a question set")
                seen.add(key)
            if problem is not None:
                counts.bad += 1
                tally.reasons[problem.reason] += 1
                tally.bad += problem.reason != DUPLICATE
                tally.count_missing(question_set, data)
                quarantine.write(quarantine_entry(index, origin, problem, data))
                continue
            record = prompt_record(question_set, question, language, origin, key, reasoning_effort)
            train.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
            counts.kept += 1
            tally.kept += 1
            counts.by_language[language] += 1
        tally.check(number, question_set)
    return counts


def prompt_record(
    question_set: QuestionSetConfig,
    question: str,
    language: str,
    origin: str,
    key: bytes,
    reasoning_effort: str,
) -> dict[str, Any]:
    """The prompt-only record of one question in ``language`` (reason and answer in it)."""
    name = LANGUAGE_NAMES[language]
    instructions, prompt = task_prompt(name, name, question_set.persona, question, reasoning_effort)
    return {
        "id": "qs-" + key[:8].hex(),
        "origin": origin,
        "reasoning_language": language,
        "answer_language": language,
        "label": language,
        "user_language": language,
        "answer_language_source": "question_set",
        "developer": question_set.persona,
        "user": question,
        "prompt": prompt,
        "messages": [
            {"role": "system", "content": instructions},
            {"role": "user", "content": question},
        ],
        "prompt_only": True,
        "prompt_weight": question_set.weight,
    }


def _rows(
    question_set: QuestionSetConfig, number: int
) -> Iterator[tuple[int, str, Any, Rejection | None]]:
    """``(row number, origin, parsed row, parse problem)`` of a set, up to ``max_rows``."""
    for i, raw in enumerate(iter_source(question_set.source, question_set.split)):
        if question_set.max_rows is not None and i >= question_set.max_rows:
            return
        raw = parse_row(raw)
        origin = f"questions[{number}]:{raw.origin}"
        if raw.error is not None:
            yield raw.index, origin, raw.raw_text, Rejection(INVALID_JSON, raw.error)
        else:
            yield raw.index, origin, raw.data, None


def _question(
    question_set: QuestionSetConfig, data: Any, max_field_chars: int
) -> tuple[str, str, Rejection | None]:
    """The question and its language, or why the row cannot be used."""
    column = question_set.question_column
    if not isinstance(data, dict):
        return "", "", Rejection(NOT_AN_OBJECT, f"expected an object, got {type(data).__name__}")
    if column not in data:
        found = ", ".join(sorted(map(str, data))) or "none"
        return "", "", Rejection(MISSING_FIELD, f"no column {column!r} (columns: {found})")
    question = data[column]
    if not isinstance(question, str):
        return "", "", Rejection(NOT_A_STRING, f"{column!r} is {type(question).__name__}")
    if not question.strip():
        return "", "", Rejection(EMPTY_FIELD, f"{column!r} is empty")
    if len(question) > max_field_chars:
        detail = f"{column!r} has {len(question)} characters > max_field_chars {max_field_chars}"
        return "", "", Rejection(OVERSIZE, detail)
    problem = check_text(column, question, max_field_chars, where="column")
    if problem is not None:  # a control character, a lone surrogate, a harmony control token
        return "", "", problem
    if question_set.language_column is None:
        language = identify_language(question)
        if language not in SUPPORTED_LANGUAGES:
            detail = f"{column!r} is detected as {language!r}, not one of {SUPPORTED_LANGUAGES}"
            return "", "", Rejection(UNKNOWN_LANGUAGE, detail)
        return question, language, None
    if question_set.language_column not in data:
        found = ", ".join(sorted(map(str, data))) or "none"
        detail = f"no column {question_set.language_column!r} (columns: {found})"
        return "", "", Rejection(MISSING_FIELD, detail)
    value = data[question_set.language_column]
    try:
        return question, _normalize(value), None
    except UnknownLanguageError as err:
        detail = f"{question_set.language_column!r}: {err}"
        return "", "", Rejection(UNKNOWN_LANGUAGE, detail)
