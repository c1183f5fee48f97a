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
import pickle
import signal
import traceback
from collections import deque
from collections.abc import Iterable, Iterator
from functools import lru_cache
from hashlib import blake2b
from typing import NamedTuple

import orjson

from core.languages import SUPPORTED_LANGUAGES
from core.processes import die_with_parent
from data_prep.config import DataPrepConfig
from data_prep.labels import assign_labels
from data_prep.records import build_record, content_key
from data_prep.sources import RawRow, parse_row
from data_prep.validate import INVALID_JSON, Rejection, validate_row

ANSWER_SOURCES = ("user", "final", "default", "reasoning")
CHUNK_ROWS = 256
"""Rows sent to a worker at a time (1,024 was as fast and held more memory)."""
PARALLEL_MIN_ROWS = 1024
"""Sources with fewer rows are processed in the calling process: workers would cost more
(forking, sending rows) than they save."""

_LANG_INDEX = {lang: i for i, lang in enumerate(SUPPORTED_LANGUAGES)}
_SOURCE_INDEX = {source: i for i, source in enumerate(ANSWER_SOURCES)}


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
    return int.from_bytes(blake2b(key, digest_size=8, key=_seed_key(seed)).digest(), "big")


@lru_cache(maxsize=8)
def _seed_key(seed: int) -> bytes:
    return str(seed).encode()


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
        answer_source=_SOURCE_INDEX[labels.answer_source],
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

    A source of fewer than PARALLEL_MIN_ROWS rows, or ``workers=1``, is processed here, row
    by row (each outcome is used while its memory is still in the CPU cache: processing
    1,024 rows before using any cost ~20% more). Otherwise worker processes
    (``config.workers``) process CHUNK_ROWS rows at a time, one chunk each, so memory stays
    bounded when the caller is slower than the workers.
    """
    rows = iter(rows)
    head = list(itertools.islice(rows, PARALLEL_MIN_ROWS))
    workers = resolve_workers(config.workers)
    if len(head) < PARALLEL_MIN_ROWS or workers == 1:
        for raw in itertools.chain(head, rows):
            yield process_row(raw, config)
        return
    yield from _in_workers(_chunks(itertools.chain(head, rows)), config, workers)


def _in_workers(
    chunks: Iterator[list[RawRow]], config: DataPrepConfig, workers: int
) -> Iterator[Good | Bad]:
    """Outcomes of ``chunks`` processed by ``workers`` processes, in order.

    Each worker has one chunk at a time: it is sent the next one as soon as its result is
    taken (so a send never waits on a worker that waits to send, and memory holds at most
    one chunk per worker). Everything is sent and received by this thread: rows unpickled by
    a helper thread and freed by this one (as ``multiprocessing.Pool`` does) made the RSS of
    the process creep up by ~20 bytes per row through allocator fragmentation.
    """
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    connections = []
    processes = []
    try:
        for _ in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_worker, args=(theirs, config, os.getpid()), daemon=True
            )
            process.start()
            theirs.close()
            connections.append(ours)
            processes.append(process)
        busy: deque = deque()  # the workers holding a chunk, in the order of the chunks
        for i, chunk in enumerate(chunks):
            if len(busy) == workers:  # take the oldest result; that worker gets this chunk
                connection = busy.popleft()
                outcomes = _receive(connection)
            else:
                connection, outcomes = connections[i], []
            connection.send_bytes(pickle.dumps(chunk, pickle.HIGHEST_PROTOCOL))
            busy.append(connection)
            yield from outcomes
        while busy:
            yield from _receive(busy.popleft())
        for connection in connections:
            connection.send_bytes(b"")  # done: the worker returns
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():  # stopped early (an error, or the caller stopped reading)
                process.terminate()
                process.join()
        for connection in connections:
            connection.close()


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this worker when the data-prep process dies, even by SIGKILL
    (Linux ``PR_SET_PDEATHSIG``); a daemon process is only stopped by a parent that exits
    normally, and a forked worker holds its own pipe's other end, so it would wait forever."""
    die_with_parent(signal.SIGKILL, parent)


def _worker(connection, config: DataPrepConfig, parent: int) -> None:
    """A worker process: process each chunk received, send back its outcomes; an empty
    message means there are no more chunks."""
    _die_with_parent(parent)
    while message := connection.recv_bytes():
        chunk = pickle.loads(message)
        try:
            result = _process_chunk(chunk, config)
        except Exception:  # a bug: report it to the parent, which raises it
            result = _WorkerError(traceback.format_exc())
        connection.send_bytes(pickle.dumps(result, pickle.HIGHEST_PROTOCOL))


class _WorkerError(NamedTuple):
    traceback: str


def _receive(connection) -> list[Good | Bad]:
    try:
        result = pickle.loads(connection.recv_bytes())
    except EOFError:
        raise RuntimeError("a data-prep worker process died; rerun with workers=1") from None
    if isinstance(result, _WorkerError):
        raise RuntimeError(f"a data-prep worker process failed:\n{result.traceback}")
    return result
