"""Write files so that a reader never sees a half-written one, and replace only what we wrote.

Files: ``atomic_writer`` / ``atomic_write_text`` (one file), ``PendingFiles`` (several, put
in place together). Folders (a model directory): ``check_output_dir`` before the work starts,
``staging_dir`` to write in, ``publish_dir`` to swap it in. A folder output, and the folder of
file outputs, carry a record (``OUTPUT_RECORD``) of the names we wrote there: a folder is
replaced, or a file overwritten, only when the record lists everything that would go; anything
else is refused with ``OutputNotOursError`` before any work, and nothing is removed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
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


class LinkRefusedError(OSError):
    """A file this project writes in place is a symbolic link (or not a regular file): writing
    through it would change another file (anyone who can write the folder can plant one)."""

    def __str__(self) -> str:
        return str(self.strerror)


_OPEN_FLAGS = {
    "r+": os.O_RDWR | os.O_CREAT,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
}


def open_no_follow(path: str | os.PathLike, mode: str = "w", **kwargs) -> IO:
    """Open (create) ``path`` for writing in place without following a symbolic link: a lock,
    a log, a file appended to. ``mode``: ``w``, ``a``, ``a+`` or ``r+`` (read and write,
    created when missing, not truncated), with ``b`` for bytes; ``kwargs`` go to ``open``.

    Whole files are better written with ``atomic_writer`` (a new temp file renamed over the
    target: a link there is replaced, never written through).

    Raises:
        LinkRefusedError: ``path`` is a symbolic link, a FIFO, a device or a folder; nothing
            was written.
    """
    path = Path(path)
    flags = _OPEN_FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_refused(path) from None
        if exc.errno == errno.ENXIO:  # a FIFO without a reader (or a socket)
            raise _not_regular(path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_regular(path)
        os.set_blocking(fd, True)
        if "b" not in mode:
            kwargs.setdefault("encoding", "utf-8")
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def _not_regular(path: Path) -> LinkRefusedError:
    return LinkRefusedError(
        errno.EINVAL,
        f"{path} is not a regular file; lingo-rl writes only regular files there: move it away",
        str(path),
    )


def _link_refused(path: Path) -> LinkRefusedError:
    try:
        to = f" (to {os.readlink(path)})"
    except OSError:
        to = ""
    return LinkRefusedError(
        errno.ELOOP,
        f"{path} is a symbolic link{to}; lingo-rl does not write through links: remove the "
        "link (or pass another folder)",
        str(path),
    )


class PendingFiles:
    """Several outputs written to temp files and put in place together.

    ``commit`` flushes every file, fsyncs them concurrently (one disk round trip instead of one
    per file), renames each over its target and records them as ours (``OUTPUT_RECORD``);
    ``discard`` (also on an exception inside a ``with`` block) deletes them. Nothing appears at
    a target path before ``commit``; ``check_output_files`` first refuses targets we did not
    write.
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
        record_output_files([target for target, _, _ in chosen])
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


# Output folders: we replace only what we wrote.

OUTPUT_RECORD = ".lingo-output.json"
"""The file in a folder this project writes that lists what it wrote there (top-level names).
A folder is replaced, or a file in it overwritten, only when the record lists it."""


class OutputNotOursError(RuntimeError):
    """An output path holds something this project did not write; nothing was changed."""


def _recorded(directory: Path) -> set[str]:
    try:
        record = json.loads((directory / OUTPUT_RECORD).read_text(encoding="utf-8"))
        return set(record["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _write_record(directory: Path, entries: set[str]) -> None:
    body = {"written_by": "lingo-rl", "entries": sorted(entries - {OUTPUT_RECORD})}
    atomic_write_text(directory / OUTPUT_RECORD, json.dumps(body, indent=1) + "\n")


def _foreign(names: list[str], target: Path, option: str) -> OutputNotOursError:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return OutputNotOursError(
        f"{option} {target} holds files this project did not write ({shown}); nothing was "
        f"removed: pass a new or empty folder as {option}, or move those files away"
    )


def check_output_dir(
    target: str | os.PathLike, option: str = "the output", work_dir: str | os.PathLike | None = None
) -> None:
    """Refuse, before any work, a folder output that would replace what we did not write.

    ``target`` may be missing, an empty folder, or a folder whose record lists everything in
    it (an earlier output of this project, which ``publish_dir`` replaces).

    Args:
        target: The folder the step will write (a model directory).
        option: How the user named it (``--model-output``), for the message.
        work_dir: The step's work folder, which must not lie inside ``target`` (replacing the
            output would remove the run's own checkpoints).

    Raises:
        OutputNotOursError: ``target`` is a file or a link, holds files we did not write, or
            contains ``work_dir``.
    """
    target = Path(target)
    if work_dir is not None:
        inside, outside = Path(work_dir).resolve(), target.resolve()
        if inside == outside or outside in inside.parents:
            raise OutputNotOursError(
                f"the work folder {work_dir} lies inside {option} {target}, which is replaced "
                f"when the model is written: pass a work folder outside {target}"
            )
    if target.is_symlink():
        raise OutputNotOursError(
            f"{option} {target} is a symbolic link; pass the folder it points to, or a new one"
        )
    if not target.exists():
        return
    if not target.is_dir():
        raise OutputNotOursError(f"{option} {target} is a file; pass a folder path")
    foreign = sorted(set(os.listdir(target)) - _recorded(target) - {OUTPUT_RECORD})
    if foreign:
        raise _foreign(foreign, target, option)


def check_output_files(paths: list[str | os.PathLike], option: str = "the output folder") -> None:
    """Refuse, before any work, to overwrite a file we did not write.

    Raises:
        OutputNotOursError: a path's folder is a file, or the path exists and its folder's
            record does not list it.
    """
    for path in map(Path, paths):
        directory = path.parent
        if directory.exists() and not directory.is_dir():
            raise OutputNotOursError(f"{option} {directory} is a file; pass a folder path")
        if path.exists() and path.name not in _recorded(directory):
            raise _foreign([path.name], directory, option)


def check_writable(directory: str | os.PathLike) -> Path:
    """Make ``directory`` (and its parents) and write a probe file in it, before any work.

    Raises:
        OSError: the folder cannot be made or written (read-only, full, a file in the way,
            a name too long); the error names the path.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".lingo-probe-") as probe:
        probe.write(b"\0" * 4096)
        probe.flush()
        os.fsync(probe.fileno())
    return directory


def record_output_files(paths: list[str | os.PathLike]) -> None:
    """Add ``paths`` to what their folders' records say we wrote there."""
    by_folder: dict[Path, set[str]] = {}
    for path in map(Path, paths):
        by_folder.setdefault(path.parent, set()).add(path.name)
    for directory, names in by_folder.items():
        _write_record(directory, _recorded(directory) | names)


def staging_dir(target: str | os.PathLike) -> Path:
    """An empty folder ``.<name>.partial`` beside ``target`` to write it in (``publish_dir``
    then puts it in place). A staging folder a killed run left is removed when its record says
    we made it; a folder of that name we did not make is refused.

    Raises:
        OutputNotOursError: ``.<name>.partial`` exists and we did not make it.
    """
    target = Path(target)
    staged = target.with_name(f".{target.name}.partial")
    if staged.exists() or staged.is_symlink():
        if staged.is_symlink() or not (staged / OUTPUT_RECORD).is_file():
            raise OutputNotOursError(
                f"{staged} exists and this project did not make it; move it away (it is where "
                f"{target} is written before it is put in place)"
            )
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    _write_record(staged, set())
    return staged


def discard_staging(staged: str | os.PathLike) -> None:
    """Remove a staging folder ``staging_dir`` made (a failed write); nothing else."""
    staged = Path(staged)
    if (staged / OUTPUT_RECORD).is_file() and not staged.is_symlink():
        shutil.rmtree(staged, ignore_errors=True)


def publish_dir(
    staged: str | os.PathLike, target: str | os.PathLike, option: str = "the output"
) -> Path:
    """Put the complete folder ``staged`` at ``target``: recorded as ours, swapped in atomically
    (``renameat2(RENAME_EXCHANGE)`` where the kernel has it: a reader sees the old folder or the
    new one, never neither), the previous ``target`` (ours: ``check_output_dir``) removed.

    Raises:
        OutputNotOursError: ``target`` holds files we did not write (``staged`` is kept).
    """
    staged, target = Path(staged), Path(target)
    _write_record(staged, set(os.listdir(staged)))
    try:
        check_output_dir(target, option)
    except OutputNotOursError as exc:
        raise OutputNotOursError(f"{exc}; what this run wrote is kept in {staged}") from None
    if not target.exists():
        os.rename(staged, target)
        return target
    if _exchange(staged, target):
        shutil.rmtree(staged)  # now the previous output
        return target
    aside = target.with_name(f".{target.name}.replaced-{os.getpid()}")
    os.rename(target, aside)
    os.rename(staged, target)
    shutil.rmtree(aside)
    return target


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where that is not available."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # not on this file system
        return False
    raise OSError(error, os.strerror(error), str(b))
