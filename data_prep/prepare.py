"""The data-prep step: load → validate (quarantine bad rows) → label → render → split → write.

Streaming, in two passes; memory holds neither row contents nor per-row bookkeeping, so it
does not grow with the row count:
1. each row is validated; a bad row goes to the quarantine file with its row number, origin
   and reason; a good row is labelled and rendered in harmony format, then looked up by its
   content hash in a disk-backed index (:mod:`data_prep.row_index`, SQLite): a duplicate
   (the same example seen earlier; the first is kept) goes to a duplicates file, a new row to
   the row spool (:mod:`data_prep.spool`) with its language and split hash;
2. per reasoning language, the ``round(n × eval_fraction)`` distinct rows with the smallest
   split hash form the eval split (at least one when the language has two or more rows): the
   index gives each language's threshold; the row spool is copied, a block at a time, into
   ``train.jsonl`` or ``eval.jsonl``, and the duplicates after the bad rows into quarantine.
The split hash is seeded and depends only on a row's content, so the split is deterministic,
independent of row order, and exactly stratified by reasoning language. Hashes are 64-bit:
two different rows are taken for duplicates with probability about n² / 2⁶⁵ (3·10⁻⁸ for a
million rows). What stays in memory: counters, length histograms for the card (bounded by
``max_field_chars``), SQLite's page cache (capped), file buffers and one chunk of rows.
All outputs are written to temp files and appear together, fsynced, only when the whole step
succeeded; ``quarantine.jsonl`` alone is put in place when the step fails (too many bad rows),
so the rejected rows can be inspected. Scratch files live in a temp folder beside the outputs.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from core.atomic import IO_BUFFER, PendingFiles, check_output_files
from core.languages import SUPPORTED_LANGUAGES
from data_prep.augment import append_synthetic
from data_prep.card import render_card
from data_prep.config import DataPrepConfig
from data_prep.fingerprint import data_fingerprint
from data_prep.lengths import LengthHistogram
from data_prep.process import ANSWER_SOURCES, Bad, Good, process_rows, quarantine_entry
from data_prep.question_sets import QuestionSetError, append_question_prompts
from data_prep.report import DataPrepReport
from data_prep.row_index import RowIndex
from data_prep.sources import iter_source
from data_prep.spool import RowSpool
from data_prep.validate import DUPLICATE, Rejection

log = logging.getLogger(__name__)

FIRST_BAD_ROWS_SHOWN = 5
LENGTH_FIELDS = ("user", "analysis", "final")


class TooManyBadRowsError(ValueError):
    """More rows were quarantined than ``max_bad_fraction`` allows."""


WORK_PREFIX = ".data-prep-"
"""The step's work folder beside its outputs: ``.data-prep-<pid>-<random>``."""


class EmptyDatasetError(ValueError):
    """The source held no row that passed validation."""


class OutputInsideSourceError(ValueError):
    """The output folder is, or is inside, the local source (or a question set's)."""


def check_output_apart(config: DataPrepConfig, output_dir: Path, outputs: list[Path]) -> None:
    """Refuse an output folder that is a local source folder or lies inside one, and a
    source that is one of the outputs: data prep would read its own outputs (and its marker
    file) as rows on the next run, and replace the files it read from.

    Raises:
        OutputInsideSourceError: names both paths.
    """
    out = output_dir.resolve()
    sources = [("--source", config.source)]
    sources += [(f"question_sets[{i}]", q.source) for i, q in enumerate(config.question_sets)]
    for name, source in sources:
        if source in ("bundled", "") or "://" in source or not Path(source).exists():
            continue
        place = Path(source).resolve()
        if place in {p.resolve() for p in outputs}:
            raise OutputInsideSourceError(
                f"{name} {source} is one of data prep's outputs: it would be replaced by what "
                "is read from it; give the source another name or write elsewhere"
            )
        if out == place or place in out.parents:
            where = "" if out == place else "inside "
            raise OutputInsideSourceError(
                f"--output-dir {output_dir} is {where}{name} {source}: data prep would read "
                "its own outputs as rows on the next run; write them elsewhere"
            )


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
        OutputNotOursError: an output path holds a file this project did not write.
        QuestionSetError: a question set gave no question or lost too many rows.
        DataPrepBusyError: another data prep writes into the same directory.
    """
    report = DataPrepReport(source=config.source, fingerprint=data_fingerprint(config))
    work_parent = Path(train_path).parent
    outputs_named = [train_path, eval_path, quarantine_path, card_path]
    check_output_apart(config, work_parent, [Path(p) for p in outputs_named if p is not None])
    check_output_files([p for p in outputs_named if p is not None], "--output-dir")
    work_parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(work_parent, [Path(p).name for p in outputs_named if p is not None])
    with (
        output_dir_lock(work_parent),
        tempfile.TemporaryDirectory(
            prefix=f"{WORK_PREFIX}{os.getpid()}-", dir=work_parent
        ) as work_dir,
        PendingFiles() as outputs,
    ):
        clean_leftovers(work_parent, [Path(p).name for p in outputs_named if p is not None])
        work = Path(work_dir)
        quarantine = outputs.open(quarantine_path)
        index = RowIndex(work / "rows.sqlite")
        try:
            with (
                RowSpool(work) as spool,
                (work / "duplicates").open("wb", buffering=IO_BUFFER) as dups,
            ):
                kept = _first_pass(config, report, index, spool, dups, quarantine)
            failure = _bad_fraction_error(config, report)
            if failure is None and report.rows_valid == 0:
                failure = EmptyDatasetError(
                    f"{config.source}: no valid rows ({report.rows_read} read)"
                )
            if failure is not None:
                _fail(failure, outputs, quarantine_path, (train_path, eval_path, card_path))
            thresholds = [
                index.smallest_split_hash(i, k) if k else None
                for i, k in enumerate(eval_count(n, config.eval_fraction) for n in kept.rows)
            ]
        finally:
            index.close()
        train, evaluation = outputs.open(train_path), outputs.open(eval_path)
        eval_rows = spool.copy_split(thresholds, train, evaluation)
        with (work / "duplicates").open("rb", buffering=IO_BUFFER) as dups:
            shutil.copyfileobj(dups, quarantine)  # after the bad rows, as they were found
        _count_statistics(report, kept, eval_rows)
        paths = (train_path, eval_path, quarantine_path, card_path)
        _append_added_rows(config, report, outputs, train, quarantine, paths)
        if card_path is not None:
            outputs.open(card_path).write(render_card(config, report).encode())
        outputs.commit()  # every output appears at once
    _log_report(report)
    return report


def _append_added_rows(
    config: DataPrepConfig, report: DataPrepReport, outputs: PendingFiles, train, quarantine, paths
) -> None:
    """After the source's rows: the synthetic rows (``synthetic_per_row``) and the question
    sets' prompt-only rows (their bad rows to the quarantine), counted in ``report``.

    ``paths``: the train, eval, quarantine and card paths (a question set that fails fails the
    step as ``_fail`` does)."""
    train_path, eval_path, quarantine_path, card_path = paths
    if config.augment_factor == "auto" and not config.synthetic_per_row:
        log.info("augment_factor auto: %s is not the bundled sample, no synthetic rows",
                 config.source)  # fmt: skip
    if config.synthetic_per_row:
        train.flush()
        report.synthetic_rows = append_synthetic(
            outputs.temp_path(train_path), train, config.synthetic_per_row, config.seed,
            config.reasoning_effort,
        )  # fmt: skip
    if config.question_sets:
        try:
            questions = append_question_prompts(
                config.question_sets, train, quarantine, config.reasoning_effort,
                config.max_field_chars,
            )  # fmt: skip
        except QuestionSetError as exc:
            _fail(exc, outputs, quarantine_path, (train_path, eval_path, card_path))
        report.prompt_only_rows = questions.kept
        report.question_rows_bad = questions.bad
        report.prompt_only_by_language.update(questions.by_language)


def _log_report(report: DataPrepReport) -> None:
    """The data fingerprint and the step's counts, in the log."""
    log.info("data fingerprint %s", report.fingerprint.sha256)
    log.info(
        "data prep: %d rows read, %d train (+%d synthetic, +%d prompt-only from question sets), "
        "%d eval, %d quarantined (%d duplicates)",
        report.rows_read,
        report.train_rows,
        report.synthetic_rows,
        report.prompt_only_rows,
        report.eval_rows,
        report.quarantined,
        report.rows_duplicate,
    )


def _fail(failure: Exception, outputs: PendingFiles, quarantine_path, stale_paths) -> None:
    """Put the quarantine in place alone (the rejected rows stay inspectable) and raise
    ``failure``; train/eval are not written."""
    # an earlier run's train/eval must not sit beside this run's quarantine
    for stale in stale_paths:
        if stale is not None:
            Path(stale).unlink(missing_ok=True)
    outputs.commit(only=[quarantine_path])
    raise failure


class DataPrepBusyError(RuntimeError):
    """Another data prep is writing into the same output directory."""


@contextlib.contextmanager
def output_dir_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` for the whole data prep (``flock`` on the
    directory itself: no lock file is left behind; the kernel releases it when the process
    ends, however it ends).

    Raises:
        DataPrepBusyError: another data prep holds it (two runs into one folder would each
            replace the other's outputs).
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pids = sorted(
                pid
                for work in directory.glob(f"{WORK_PREFIX}*")
                if (pid := work.name.removeprefix(WORK_PREFIX).split("-", 1)[0]).isdigit()
            )
            holder = f" (pid {', '.join(pids)})" if pids else ""
            raise DataPrepBusyError(
                f"{directory} is in use by another data prep{holder}; wait for it to end or "
                "write into another output directory"
            ) from None
        yield
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_leftovers(directory: Path, output_names: list[str]) -> None:
    """Remove what a killed data prep left in ``directory``: its work folder
    (``.data-prep-<pid>-*``, when that process is gone) and, when no data prep is running
    there, the temp files of ``output_names`` (``.<name>.*.partial``). This process's own
    work folder is left alone."""
    running = False
    for work in directory.glob(f"{WORK_PREFIX}*"):
        pid = work.name.removeprefix(WORK_PREFIX).split("-", 1)[0]
        if pid == str(os.getpid()):
            continue
        if pid.isdigit() and _alive(int(pid)):
            running = True
            continue
        log.warning("removing %s, left by a data prep that was killed", work)
        shutil.rmtree(work, ignore_errors=True)
    if running:
        return
    for name in output_names:
        for partial in directory.glob(f".{name}.*.partial"):
            log.warning("removing %s, left by a data prep that was killed", partial)
            partial.unlink(missing_ok=True)


@dataclass
class _KeptRows:
    """Tallies of the distinct valid rows (the ones that go to train or eval), by language."""

    rows: list[int] = field(default_factory=lambda: [0] * len(SUPPORTED_LANGUAGES))
    answer_languages: list[int] = field(default_factory=lambda: [0] * len(SUPPORTED_LANGUAGES))
    answer_sources: list[int] = field(default_factory=lambda: [0] * len(ANSWER_SOURCES))
    lengths: list[tuple[LengthHistogram, ...]] = field(
        default_factory=lambda: [
            tuple(LengthHistogram() for _ in LENGTH_FIELDS) for _ in SUPPORTED_LANGUAGES
        ]
    )

    def add(self, row: Good) -> None:
        self.rows[row.language] += 1
        self.answer_languages[row.answer_language] += 1
        self.answer_sources[row.answer_source] += 1
        for histogram, length in zip(self.lengths[row.language], row.lengths, strict=True):
            histogram.add(length)


def _first_pass(
    config, report, index: RowIndex, spool: RowSpool, duplicates, quarantine
) -> _KeptRows:
    """Validate, label and render every row; spool the new ones, set aside the duplicates and
    quarantine the bad ones."""
    kept = _KeptRows()
    for outcome in process_rows(iter_source(config.source, config.hub_split), config):
        report.rows_read += 1
        if isinstance(outcome, Bad):
            report.rows_bad += 1
            report.reasons[outcome.reason] += 1
            if len(report.first_bad) < FIRST_BAD_ROWS_SHOWN:
                report.first_bad.append(f"row {outcome.index} ({outcome.origin}): {outcome.detail}")
            quarantine.write(outcome.entry)
            continue
        first = index.add(outcome.content_hash, outcome.index, outcome.language, outcome.split_hash)
        if first is not None:
            report.rows_duplicate += 1
            duplicates.write(_duplicate_entry(outcome, first))
            continue
        spool.append(outcome.language, outcome.split_hash, outcome.record)
        kept.add(outcome)
        report.rows_valid += 1
    return kept


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


def _duplicate_entry(row: Good, first: int) -> bytes:
    record = orjson.loads(row.record)
    kept = {k: record[k] for k in ("reasoning_language", "developer", "user", "analysis", "final")}
    detail = f"exact duplicate of row {first}"
    return quarantine_entry(row.index, record["origin"], Rejection(DUPLICATE, detail), kept)


def _count_statistics(report: DataPrepReport, kept: _KeptRows, eval_rows: list[int]) -> None:
    """Counts and lengths for the report and the card, over the rows kept."""
    if report.rows_duplicate:
        report.reasons[DUPLICATE] += report.rows_duplicate
    report.eval_rows = sum(eval_rows)
    report.train_rows = report.rows_valid - report.eval_rows
    for i, lang in enumerate(SUPPORTED_LANGUAGES):
        report.eval_by_language[lang] = eval_rows[i]
        report.train_by_language[lang] = kept.rows[i] - eval_rows[i]
        report.answer_languages[lang] = kept.answer_languages[i]
        if kept.rows[i]:
            report.lengths[lang] = dict(zip(LENGTH_FIELDS, kept.lengths[i], strict=True))
    for i, source in enumerate(ANSWER_SOURCES):
        if kept.answer_sources[i]:
            report.answer_sources[source] = kept.answer_sources[i]
