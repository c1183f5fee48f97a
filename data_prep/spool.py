"""The row spool: the records of the rows kept, in input order, until the split is known.

Two scratch files: the records (JSON lines, as they will be written) and, per record, a
13-byte entry (reasoning language, split hash, record length). When the eval thresholds are
known, both are read back a block of rows at a time: the eval decision is made for the whole
block with numpy, and each run of consecutive train (or eval) records is written with one call,
so the copy costs next to nothing per row and memory holds one block.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from core.atomic import IO_BUFFER

BLOCK_ROWS = 512
"""Rows read back at a time (about 1.3 MiB of records for the bundled sample's rows)."""

_ENTRY = struct.Struct("<BQI")
_ENTRY_DTYPE = np.dtype([("language", "u1"), ("split", "<u8"), ("length", "<u4")])
assert _ENTRY_DTYPE.itemsize == _ENTRY.size


class RowSpool:
    """Append records with their language and split hash (inside ``with``); after it, copy
    them into train and eval."""

    def __init__(self, folder: Path) -> None:
        self._records_path, self._entries_path = folder / "records", folder / "entries"
        self._records = self._records_path.open("wb", buffering=IO_BUFFER)
        self._entries = self._entries_path.open("wb", buffering=IO_BUFFER)

    def append(self, language: int, split_hash: int, record: bytes) -> None:
        self._records.write(record)
        self._entries.write(_ENTRY.pack(language, split_hash, len(record)))

    def __enter__(self) -> RowSpool:
        return self

    def __exit__(self, *exc) -> None:
        """Close the files being written (``copy_split`` reads them back)."""
        self._records.close()
        self._entries.close()

    def copy_split(self, thresholds: list[int | None], train, evaluation) -> list[int]:
        """Write each record, in order, to ``evaluation`` when its split hash is at most its
        language's threshold (None: no eval rows), else to ``train``. Returns the eval rows
        per language."""
        has_threshold = np.array([t is not None for t in thresholds])
        limits = np.array([t or 0 for t in thresholds], dtype=np.uint64)
        eval_rows = np.zeros(len(thresholds), dtype=np.int64)
        with (
            self._records_path.open("rb", buffering=IO_BUFFER) as records,
            self._entries_path.open("rb", buffering=IO_BUFFER) as entries,
        ):
            while block := entries.read(BLOCK_ROWS * _ENTRY.size):
                entry = np.frombuffer(block, dtype=_ENTRY_DTYPE)
                language = entry["language"]
                is_eval = has_threshold[language] & (entry["split"] <= limits[language])
                eval_rows += np.bincount(language[is_eval], minlength=len(thresholds))
                ends = np.cumsum(entry["length"], dtype=np.int64).tolist()
                data = memoryview(records.read(ends[-1]))
                # runs of consecutive rows going to the same file
                cuts = (np.flatnonzero(is_eval[1:] != is_eval[:-1]) + 1).tolist()
                for start, stop in zip([0, *cuts], [*cuts, len(entry)], strict=True):
                    first = ends[start - 1] if start else 0
                    (evaluation if is_eval[start] else train).write(data[first : ends[stop - 1]])
        return eval_rows.tolist()
