"""The data-prep step: load → validate (quarantine bad rows) → label → render → split → write.

Streaming, in two passes, so memory never holds row contents (about 40 bytes of bookkeeping
per valid row, in compact arrays: languages, hashes, row number, lengths):
1. each row is validated; a bad row goes to the quarantine file with its row number, origin
   and reason; a good row is labelled, rendered in harmony format and appended to a spool file;
2. exact duplicates are found by sorting the content hashes (the first occurrence is kept);
   per reasoning language, the ``round(n × eval_fraction)`` rows with the smallest split hash
   form the eval split (at least one when the language has two or more rows); the spool is
   copied line by line into ``train.jsonl``, ``eval.jsonl`` or, for duplicates, quarantine.
The split hash is seeded and depends only on a row's content, so the split is deterministic,
independent of row order, and exactly stratified by reasoning language. Hashes are 64-bit:
two different rows are taken for duplicates with probability about n² / 2⁶⁵ (3·10⁻⁸ for a
million rows).
All outputs are written to temp files and appear together, fsynced, only when the whole step
succeeded; ``quarantine.jsonl`` alone is put in place when the step fails (too many bad rows),
so the rejected rows can be inspected.
"""

from __future__ import annotations

import logging
import os
import tempfile
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from data_prep.atomic import PendingFiles
from data_prep.augment import append_synthetic
from data_prep.card import render_card
from data_prep.config import DataPrepConfig
from data_prep.process import ANSWER_SOURCES, Bad, process_rows, quarantine_entry
from data_prep.sources import iter_source
from data_prep.validate import DUPLICATE, Rejection
from eval.languages import SUPPORTED_LANGUAGES

log = logging.getLogger(__name__)

FIRST_BAD_ROWS_SHOWN = 5
LENGTH_FIELDS = ("user", "analysis", "final")


class TooManyBadRowsError(ValueError):
    """More rows were quarantined than ``max_bad_fraction`` allows."""


class EmptyDatasetError(ValueError):
    """The source held no row that passed validation."""


@dataclass
class DataPrepReport:
    """What the step did: counts by outcome, language and reason, plus length statistics."""

    source: str
    rows_read: int = 0
    rows_valid: int = 0
    rows_bad: int = 0
    rows_duplicate: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    synthetic_rows: int = 0
    reasons: Counter = field(default_factory=Counter)
    first_bad: list[str] = field(default_factory=list)
    train_by_language: Counter = field(default_factory=Counter)
    eval_by_language: Counter = field(default_factory=Counter)
    answer_languages: Counter = field(default_factory=Counter)
    answer_sources: Counter = field(default_factory=Counter)
    lengths: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @property
    def bad_fraction(self) -> float:
        return self.rows_bad / self.rows_read if self.rows_read else 0.0

    def metrics(self) -> dict[str, float]:
        """Flat scalar metrics (for KFP ``Metrics`` and MLflow)."""
        out: dict[str, float] = {
            "rows_read": self.rows_read,
            "rows_valid": self.rows_valid,
            "rows_quarantined": self.rows_bad + self.rows_duplicate,
            "rows_bad": self.rows_bad,
            "rows_duplicate": self.rows_duplicate,
            "bad_fraction": round(self.bad_fraction, 6),
            "train_rows": self.train_rows,
            "eval_rows": self.eval_rows,
            "synthetic_train_rows": self.synthetic_rows,
        }
        for lang in SUPPORTED_LANGUAGES:
            out[f"train_rows_{lang}"] = self.train_by_language[lang]
            out[f"eval_rows_{lang}"] = self.eval_by_language[lang]
        return out


def eval_count(n: int, eval_fraction: float) -> int:
    """How many of a language's ``n`` rows go to eval: round(n × f), ≥ 1 if f > 0 and n ≥ 2."""
    if n < 2 or eval_fraction <= 0:
        return 0
    return min(n - 1, max(1, round(n * eval_fraction)))


def prepare_dataset(
    config: DataPrepConfig,
    train_path: str | os.PathLike,
    eval_path: str | os.PathLike,
    quarantine_path: str | os.PathLike,
    card_path: str | os.PathLike | None = None,
) -> DataPrepReport:
    """Run the data-prep step and write its outputs (see the module docstring).

    Raises:
        TooManyBadRowsError: the quarantined share is above ``config.max_bad_fraction``.
        EmptyDatasetError: no row passed validation.
        SourceError: the source cannot be read.
    """
    report = DataPrepReport(source=config.source)
    spool_dir = Path(train_path).parent
    spool_dir.mkdir(parents=True, exist_ok=True)
    spool_fd, spool_name = tempfile.mkstemp(prefix=".spool-", suffix=".jsonl", dir=spool_dir)
    try:
        with PendingFiles() as outputs:
            quarantine = outputs.open(quarantine_path)
            with os.fdopen(spool_fd, "wb") as spool:
                rows = _first_pass(config, report, spool, quarantine)
            failure = _bad_fraction_error(config, report)
            if failure is None and report.rows_valid == 0:
                failure = EmptyDatasetError(
                    f"{config.source}: no valid rows ({report.rows_read} read)"
                )
            if failure is not None:
                outputs.commit(only=[quarantine_path])  # rejected rows stay inspectable
                raise failure  # train/eval are not written
            train, evaluation = outputs.open(train_path), outputs.open(eval_path)
            _second_pass(config, report, Path(spool_name), rows, train, evaluation, quarantine)
            if config.augment_factor:
                train.flush()
                report.synthetic_rows = append_synthetic(
                    outputs.temp_path(train_path), train, config.augment_factor, config.seed,
                    config.reasoning_effort,
                )  # fmt: skip
            if card_path is not None:
                outputs.open(card_path).write(render_card(config, report).encode())
            outputs.commit()  # every output appears at once
    finally:
        Path(spool_name).unlink(missing_ok=True)
    log.info(
        "data prep: %d rows read, %d train, %d eval, %d quarantined (%d duplicates)",
        report.rows_read,
        report.train_rows,
        report.eval_rows,
        report.rows_bad + report.rows_duplicate,
        report.rows_duplicate,
    )
    return report


@dataclass
class _SpooledRows:
    """Bookkeeping of the valid rows in spool order (numbers only, no row contents)."""

    languages: array = field(default_factory=lambda: array("B"))
    answer_languages: array = field(default_factory=lambda: array("B"))
    answer_sources: array = field(default_factory=lambda: array("B"))
    content_hashes: array = field(default_factory=lambda: array("Q"))
    split_hashes: array = field(default_factory=lambda: array("Q"))
    row_numbers: array = field(default_factory=lambda: array("Q"))
    lengths: dict[str, array] = field(
        default_factory=lambda: {name: array("I") for name in LENGTH_FIELDS}
    )


def _first_pass(config, report, spool, quarantine) -> _SpooledRows:
    """Validate, label and render every row; spool the valid ones, quarantine the bad ones."""
    rows = _SpooledRows()
    for outcome in process_rows(iter_source(config.source, config.hub_split), config):
        report.rows_read += 1
        if isinstance(outcome, Bad):
            report.rows_bad += 1
            report.reasons[outcome.reason] += 1
            if len(report.first_bad) < FIRST_BAD_ROWS_SHOWN:
                report.first_bad.append(f"row {outcome.index} ({outcome.origin}): {outcome.detail}")
            quarantine.write(outcome.entry)
            continue
        spool.write(outcome.record)
        rows.languages.append(outcome.language)
        rows.answer_languages.append(outcome.answer_language)
        rows.answer_sources.append(outcome.answer_source)
        rows.content_hashes.append(outcome.content_hash)
        rows.split_hashes.append(outcome.split_hash)
        rows.row_numbers.append(outcome.index)
        for name, length in zip(LENGTH_FIELDS, outcome.lengths, strict=True):
            rows.lengths[name].append(length)
        report.rows_valid += 1
    return rows


def _bad_fraction_error(config: DataPrepConfig, report: DataPrepReport) -> Exception | None:
    if report.bad_fraction <= config.max_bad_fraction:
        return None
    shown = "\n  ".join(report.first_bad)
    return TooManyBadRowsError(
        f"{config.source}: {report.rows_bad} of {report.rows_read} rows are bad "
        f"({report.bad_fraction:.1%} > max_bad_fraction {config.max_bad_fraction:.1%}); "
        f"reasons {dict(report.reasons)}; first bad rows:\n  {shown}\n"
        "All rejected rows are in the quarantine file with their reason."
    )


def _first_occurrences(content_hashes: np.ndarray) -> np.ndarray:
    """For each row, the spool position of the first row with the same content hash."""
    order = np.argsort(content_hashes, kind="stable")
    ordered = content_hashes[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))
    first = np.empty(len(order), dtype=np.int64)
    first[order] = order[group_start]
    return first


def _second_pass(config, report, spool: Path, rows: _SpooledRows, train, evaluation, quarantine):
    languages = np.frombuffer(rows.languages, dtype=np.uint8)
    split_hashes = np.frombuffer(rows.split_hashes, dtype=np.uint64)
    row_numbers = np.frombuffer(rows.row_numbers, dtype=np.uint64)
    first = _first_occurrences(np.frombuffer(rows.content_hashes, dtype=np.uint64))
    duplicate = first != np.arange(len(first))
    thresholds: list[int | None] = []
    for i, _lang in enumerate(SUPPORTED_LANGUAGES):
        lang_hashes = split_hashes[(languages == i) & ~duplicate]
        k = eval_count(len(lang_hashes), config.eval_fraction)
        thresholds.append(int(np.partition(lang_hashes, k - 1)[k - 1]) if k else None)
    is_eval = np.zeros(len(first), dtype=bool)
    for i, threshold in enumerate(thresholds):
        if threshold is not None:
            is_eval |= (languages == i) & (split_hashes <= threshold) & ~duplicate
    with spool.open("rb") as src:
        for i, line in enumerate(src):
            if duplicate[i]:
                _quarantine_duplicate(
                    report, quarantine, line, int(row_numbers[i]), int(row_numbers[first[i]])
                )
                continue
            (evaluation if is_eval[i] else train).write(line)
    _count_statistics(report, rows, languages, is_eval, ~duplicate)


def _quarantine_duplicate(
    report: DataPrepReport, out, line: bytes, row: int, original: int
) -> None:
    record = orjson.loads(line)
    report.rows_valid -= 1
    report.rows_duplicate += 1
    report.reasons[DUPLICATE] += 1
    kept = {k: record[k] for k in ("reasoning_language", "developer", "user", "analysis", "final")}
    detail = f"exact duplicate of row {original}"
    out.write(quarantine_entry(row, record["origin"], Rejection(DUPLICATE, detail), kept))


def _count_statistics(report, rows: _SpooledRows, languages, is_eval, kept) -> None:
    """Counts and lengths for the report and the card, over the rows kept."""
    answers = np.frombuffer(rows.answer_languages, dtype=np.uint8)[kept]
    sources = np.frombuffer(rows.answer_sources, dtype=np.uint8)[kept]
    lengths = {n: np.frombuffer(a, dtype=np.uint32)[kept] for n, a in rows.lengths.items()}
    languages, is_eval = languages[kept], is_eval[kept]
    report.eval_rows = int(is_eval.sum())
    report.train_rows = int(len(is_eval) - report.eval_rows)
    for i, lang in enumerate(SUPPORTED_LANGUAGES):
        mine = languages == i
        report.eval_by_language[lang] = int((mine & is_eval).sum())
        report.train_by_language[lang] = int((mine & ~is_eval).sum())
        report.answer_languages[lang] = int((answers == i).sum())
        if mine.any():
            report.lengths[lang] = {name: values[mine] for name, values in lengths.items()}
    for i, source in enumerate(ANSWER_SOURCES):
        if (sources == i).any():
            report.answer_sources[source] = int((sources == i).sum())
