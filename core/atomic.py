"""Write files so that a reader never sees a half-written one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

IO_BUFFER = 1 << 18
"""Bytes buffered per file that data prep streams through."""


@contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temp file beside ``path``; on success rename it over ``path``, else delete it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_writer(path) as fh:
        fh.write(text)


class PendingFiles:
    """Several outputs written to temp files and put in place together.

    ``commit`` flushes every file, fsyncs them concurrently (one disk round trip instead of one
    per file) and renames each over its target; ``discard`` (also on an exception inside a
    ``with`` block) deletes them. Nothing appears at a target path before ``commit``.
    """

    def __init__(self) -> None:
        self._files: dict[Path, tuple[IO, Path]] = {}

    def open(self, path: str | os.PathLike, mode: str = "wb", buffering: int = IO_BUFFER) -> IO:
        """A new temp file for ``path``; big buffers: one system call per 256 KiB, not per row."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        handle = os.fdopen(fd, mode, buffering, encoding=None if "b" in mode else "utf-8")
        self._files[target] = (handle, Path(tmp))
        return handle

    def temp_path(self, path: str | os.PathLike) -> Path:
        """Where ``path``'s content is being written (flush the handle before reading it)."""
        return self._files[Path(path)][1]

    def commit(self, only: list[str | os.PathLike] | None = None) -> None:
        """Put the files (or ``only`` these) in place; the others are discarded."""
        from concurrent.futures import ThreadPoolExecutor

        keep = set(self._files) if only is None else {Path(p) for p in only}
        chosen = [(t, h, tmp) for t, (h, tmp) in self._files.items() if t in keep]
        for _, handle, _ in chosen:
            handle.flush()

        def sync(handle: IO) -> None:
            os.fsync(handle.fileno())
            handle.close()

        with ThreadPoolExecutor(max_workers=max(1, len(chosen))) as pool:
            list(pool.map(sync, [h for _, h, _ in chosen]))
        for target, _, tmp in chosen:
            os.replace(tmp, target)
            del self._files[target]
        self.discard()

    def discard(self) -> None:
        for handle, tmp in self._files.values():
            handle.close()
            tmp.unlink(missing_ok=True)
        self._files.clear()

    def __enter__(self) -> PendingFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()
