"""The bookkeeping of dedup and split, on disk (SQLite), so memory does not grow with the rows.

One table holds a row per distinct example kept: its content hash (the primary key, so a
duplicate is found by one B-tree look-up as it arrives), its row number, reasoning language and
split hash. SQLite keeps at most ``CACHE_KIB`` of pages in memory; the rest stays in the file.
After all rows are in, an index on (language, split hash) gives each language's k-th smallest
split hash, the eval threshold. Nothing here is durable: it is a scratch file of one run
(no journal, no fsync).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

CACHE_KIB = 4096
"""SQLite page cache, the only memory this bookkeeping uses whatever the row count."""

_SIGN = 1 << 63
"""SQLite integers are signed 64-bit: unsigned hashes are stored shifted by 2**63, which keeps
their order."""


SQLITE_MAX_PATH = 511
"""The longest path SQLite's unix file layer opens (``SQLITE_MAX_PATHNAME`` 512, with its
terminating zero: a 512-byte path fails with "unable to open database file")."""


class RowIndexError(OSError):
    """The scratch database cannot be opened (a path too long for SQLite, a full disk)."""


def _open_problem(path: Path, exc: sqlite3.OperationalError) -> str:
    length = len(str(Path(path).absolute()).encode())
    if length > SQLITE_MAX_PATH:
        return (
            f"data prep's scratch database {str(path)[:60]}…/{Path(path).name} has a path of "
            f"{length:,} bytes; SQLite opens at most {SQLITE_MAX_PATH}: pass an output folder "
            f"whose path is at most {SQLITE_MAX_PATH - 60} characters ({exc})"
        )
    return f"{path}: SQLite cannot open data prep's scratch database ({exc})"


class RowIndex:
    """Distinct rows seen so far: content hash → (row number, language, split hash)."""

    def __init__(self, path: Path) -> None:
        try:
            self._db = sqlite3.connect(path, isolation_level=None)
        except sqlite3.OperationalError as exc:
            raise RowIndexError(_open_problem(path, exc)) from exc
        for pragma in (
            "journal_mode = OFF",
            "synchronous = OFF",
            "locking_mode = EXCLUSIVE",
            "temp_store = FILE",
            f"cache_size = -{CACHE_KIB}",
        ):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute(
            "CREATE TABLE kept (content INTEGER PRIMARY KEY, row INTEGER NOT NULL, "
            "language INTEGER NOT NULL, split INTEGER NOT NULL)"
        )
        self._db.execute("BEGIN")
        self._cursor = self._db.cursor()  # reused: a new cursor per row costs ~0.1 µs

    def add(self, content_hash: int, row: int, language: int, split_hash: int) -> int | None:
        """Record a row; None when its content is new, else the row number of its first copy."""
        values = (content_hash - _SIGN, row, language, split_hash - _SIGN)
        if self._cursor.execute("INSERT OR IGNORE INTO kept VALUES (?, ?, ?, ?)", values).rowcount:
            return None
        query = "SELECT row FROM kept WHERE content = ?"
        return self._cursor.execute(query, (values[0],)).fetchone()[0]

    def smallest_split_hash(self, language: int, k: int) -> int:
        """The ``k``-th smallest split hash (``k`` ≥ 1) among the language's distinct rows."""
        self._db.execute("CREATE INDEX IF NOT EXISTS by_split ON kept (language, split)")
        query = "SELECT split FROM kept WHERE language = ? ORDER BY split LIMIT 1 OFFSET ?"
        return self._db.execute(query, (language, k - 1)).fetchone()[0] + _SIGN

    def close(self) -> None:
        self._db.close()
