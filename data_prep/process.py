"""Per-row work of data prep (parse, validate, label, render), serially or in worker processes.

Each row becomes a :class:`Good` (the serialized record plus the numbers the split needs) or a
:class:`Bad` (the serialized quarantine entry). Both are small and cheap to send between
processes, so the main process only reads, keeps bookkeeping and writes.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from functools import partial
from hashlib import blake2b
from typing import NamedTuple

import orjson

from data_prep.config import DataPrepConfig
from data_prep.labels import assign_labels
from data_prep.records import build_record, content_key
from data_prep.sources import RawRow, parse_row
from data_prep.validate import INVALID_JSON, Rejection, validate_row
from eval.languages import SUPPORTED_LANGUAGES

ANSWER_SOURCES = ("user", "final", "default", "reasoning")
CHUNK_ROWS = 1024
"""Rows per task sent to a worker; also the rows processed before any worker starts."""

_LANG_INDEX = {lang: i for i, lang in enumerate(SUPPORTED_LANGUAGES)}


class Good(NamedTuple):
    """A row that passed: its serialized record and the numbers kept for the split."""

    index: int
    record: bytes
    language: int
    answer_language: int
    answer_source: int
    content_hash: int
    split_hash: int
    lengths: tuple[int, int, int]
    """Characters of user, analysis, final."""


class Bad(NamedTuple):
    """A rejected row: its quarantine line and what the report needs."""

    index: int
    origin: str
    reason: str
    detail: str
    entry: bytes


def split_hash(key: bytes, seed: int) -> int:
    """Seeded 64-bit hash of a row's content key; small values go to the eval split."""
    return int.from_bytes(blake2b(key, digest_size=8, key=str(seed).encode()).digest(), "big")


def quarantine_entry(row: int, origin: str, rejection: Rejection, raw_value) -> bytes:
    """A quarantine line; text that is not valid Unicode is kept, \\u-escaped."""
    entry = {
        "row": row,
        "origin": origin,
        "reason": rejection.reason,
        "detail": rejection.detail,
        "raw": raw_value,
    }
    try:
        return orjson.dumps(entry, default=repr, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # lone surrogates, ints beyond 64 bits
        return (json.dumps(entry, ensure_ascii=True, default=repr) + "\n").encode()


def process_row(raw: RawRow, config: DataPrepConfig) -> Good | Bad:
    """Parse, validate, label and render one row."""
    raw = parse_row(raw)
    if raw.error is not None:
        rejection = Rejection(INVALID_JSON, raw.error)
        return _bad(raw, rejection, raw.raw_text)
    checked = validate_row(raw.data, config.max_field_chars)
    if isinstance(checked, Rejection):
        return _bad(raw, checked, raw.data)
    key = content_key(checked)
    labels = assign_labels(
        checked.reasoning_language, checked.user, checked.final, config.answer_language_policy
    )
    record = build_record(checked, labels, raw.origin, key, config.reasoning_effort)
    return Good(
        index=raw.index,
        record=orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE),
        language=_LANG_INDEX[checked.reasoning_language],
        answer_language=_LANG_INDEX[labels.labels.answer],
        answer_source=ANSWER_SOURCES.index(labels.answer_source),
        content_hash=int.from_bytes(key[:8], "big"),
        split_hash=split_hash(key, config.seed),
        lengths=(len(checked.user), len(checked.analysis), len(checked.final)),
    )


def _bad(raw: RawRow, rejection: Rejection, raw_value) -> Bad:
    entry = quarantine_entry(raw.index, raw.origin, rejection, raw_value)
    return Bad(raw.index, raw.origin, rejection.reason, rejection.detail, entry)


def _process_chunk(chunk: list[RawRow], config: DataPrepConfig) -> list[Good | Bad]:
    return [process_row(raw, config) for raw in chunk]


def _chunks(rows: Iterator[RawRow]) -> Iterator[list[RawRow]]:
    while chunk := list(itertools.islice(rows, CHUNK_ROWS)):
        yield chunk


def resolve_workers(workers: int) -> int:
    """``workers`` as configured, 0 meaning one per CPU core (at most 8)."""
    return workers if workers > 0 else min(8, os.cpu_count() or 1)


def process_rows(rows: Iterable[RawRow], config: DataPrepConfig) -> Iterator[Good | Bad]:
    """Outcomes of ``rows`` in input order.

    The first CHUNK_ROWS rows are processed here; only a source with more rows starts worker
    processes (``config.workers``), fed CHUNK_ROWS rows at a time.
    """
    chunks = _chunks(iter(rows))
    first = next(chunks, [])
    yield from _process_chunk(first, config)
    workers = resolve_workers(config.workers)
    if len(first) < CHUNK_ROWS or workers == 1:
        for chunk in chunks:
            yield from _process_chunk(chunk, config)
        return
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with context.Pool(workers) as pool:
        for outcomes in pool.imap(partial(_process_chunk, config=config), chunks):
            yield from outcomes
