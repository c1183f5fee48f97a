"""Expected failures as one line that names the cause and the path or field.

``describe_error(exc)`` gives the project's own exceptions their message, and turns the
failures a user can cause or fix (bad settings, a full or read-only disk, a path too long, a
file in the way, an unreachable server, a missing hub repo, a database file that cannot be
opened, a write that failed inside PyTorch or safetensors) into one redacted line; it returns
None for anything else (a bug: keep its traceback). ``names_write_failures`` turns a failed
write inside a function into ``WriteFailedError`` naming the folder it was writing.
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import re
from collections.abc import Callable
from typing import TypeVar

from core.redact import redact

F = TypeVar("F", bound=Callable)

ERRNO_CAUSES = {
    errno.ENOSPC: "no space left on the device: free some space, or write elsewhere",
    errno.EDQUOT: "disk quota exceeded: free some space, or write elsewhere",
    errno.EFBIG: "file too large for this file system or the file-size limit (ulimit -f)",
    errno.EROFS: "read-only file system: write elsewhere",
    errno.ENAMETOOLONG: (
        "file name too long: use a shorter path (at most 255 characters a name, 4096 in all)"
    ),
    errno.EEXIST: "a file is in the way: remove it, or pass another path",
    errno.ENOTDIR: "a part of this path is a file, not a folder: pass a folder path",
    errno.EISDIR: "is a folder; a file was expected",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory",
    errno.ENOTEMPTY: "the folder is not empty",
    errno.EMFILE: "too many open files (ulimit -n)",
    errno.ELOOP: "too many levels of symbolic links",
}
"""The cause a user reads for an ``OSError``'s errno."""

HF_TOKEN_HINT = (
    "a gated or private repo needs HF_TOKEN; in the pipeline it comes from the optional Secret "
    "lingo-hf, which `lingo cluster setup` creates from it"
)
_OS_ERROR_CODE = re.compile(r"os error (\d+)")
"""How Rust libraries (safetensors, tokenizers) name the OS error inside their message."""
MAX_PATH_SHOWN = 200
PROJECT_PACKAGES = ("core", "reward", "generation", "data_prep", "trainer", "eval", "capacity")
PROJECT_PACKAGES += ("plan", "cluster", "components", "pipelines")


class WriteFailedError(RuntimeError):
    """A file could not be written (disk full, read-only, too large); names the folder."""


def short_path(path: object) -> str:
    """``path`` as text, its middle cut out past ``MAX_PATH_SHOWN`` characters."""
    text = os.fsdecode(path) if isinstance(path, bytes | os.PathLike) else str(path)
    if len(text) <= MAX_PATH_SHOWN:
        return text
    return f"{text[:80]}…{text[-80:]} ({len(text):,} characters)"


def _os_error(exc: OSError) -> str:
    cause = ERRNO_CAUSES.get(exc.errno) or exc.strerror or str(exc)
    if exc.filename is None:
        return cause
    where = short_path(exc.filename)
    if exc.filename2 is not None:
        where += f" → {short_path(exc.filename2)}"
    return f"{where}: {cause}"


def validation_message(error: dict) -> str:
    """One pydantic error's problem, without the "Value error, " pydantic puts before the
    message of a validator's ``ValueError`` (which already says what is wrong)."""
    if error.get("type") == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return error.get("msg", "invalid")


def describe_validation_error(exc, names: dict[str, str] | None = None) -> str:
    """One line for a pydantic ``ValidationError``: each field (or the command-line option
    ``names`` gives for it: ``{"sampling.n": "--samples"}``), the value given and the problem."""
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error.get("loc", ())) or exc.title
        message = validation_message(error)
        if names and field in names:
            problems.append(f"{names[field]} {error.get('input')!r}: {message} ({field})")
            continue
        shown = f" (got {error['input']!r})" if "input" in error and error.get("loc") else ""
        problems.append(f"{field}: {message}{shown}")
    return ("" if names else f"invalid {exc.title}: ") + "; ".join(problems)


def _library_error(exc: BaseException) -> str | None:
    """Failures of the libraries we call that a user can fix; None when not one of them."""
    kind, text = type(exc).__name__, str(exc)
    module = type(exc).__module__.split(".")[0]
    if kind == "ValidationError" and module in ("pydantic", "pydantic_core"):
        return describe_validation_error(exc)
    if module == "huggingface_hub" or kind == "HFValidationError":
        first = text.strip().splitlines()[0] if text.strip() else kind
        if kind == "GatedRepoError" or "401 Client Error" in first:
            first += f" ({HF_TOKEN_HINT})"
        return f"Hugging Face hub: {first}"
    if module in ("requests", "urllib3", "httpx", "httpx2", "httpcore"):
        return f"network error: {kind}: {text}"
    if kind == "OperationalError" and module == "sqlite3":
        return f"SQLite: {text}"
    if isinstance(exc, RuntimeError) and "inline_container.cc" in text:
        return (
            "PyTorch could not write a file (disk full, file-size limit or read-only file "
            f"system?): {text}"
        )
    if kind == "SafetensorError" and (code := _OS_ERROR_CODE.search(text)):
        return f"safetensors could not write a file: {ERRNO_CAUSES.get(int(code[1]), text)}"
    return None


def describe_error(exc: BaseException, where: object = None) -> str | None:
    """One line (redacted) for an expected failure, or None for a bug.

    The project's own exceptions (``is_project_error``) are their message, redacted. Then
    ``OSError`` (its errno named as a cause and its file as the path), pydantic's
    ``ValidationError`` (each field, its problem and the value given), network errors
    (requests, httpx), Hugging Face hub errors (a repo id that is not one, a repo that does
    not exist, no network), SQLite's ``OperationalError``, and PyTorch's or safetensors' failed
    writes. ``where`` (the path the command writes) is named for a failure that names no file
    (a full disk met by a write, SQLite's "database or disk is full").
    """
    if is_project_error(exc):
        return redact(str(exc))
    if (described := _library_error(exc)) is not None:
        line = described
    elif isinstance(exc, OSError):
        line = _os_error(exc)
    else:
        return None
    if where is not None and _names_no_file(exc):
        line = f"{short_path(where)}: {line}"
    return redact(" ".join(line.split()))


def is_project_error(exc: BaseException) -> bool:
    """An exception the project raises on purpose: its message is the whole story."""
    return any(cls.__module__.split(".")[0] in PROJECT_PACKAGES for cls in type(exc).__mro__)


def _names_no_file(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and type(exc).__module__ == "builtins":
        return not exc.filename
    return type(exc).__name__ == "OperationalError" or _is_write_failure(exc)


def names_write_failures(parameter: str) -> Callable[[F], F]:
    """Decorate a function that writes under its argument ``parameter`` (a folder): a failed
    write inside it (an ``OSError`` of a full, read-only or too small file system, PyTorch's
    ``inline_container.cc`` failure, a safetensors I/O error) becomes ``WriteFailedError``
    naming that folder and the cause."""

    def decorate(function: F) -> F:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except Exception as exc:
                if not _is_write_failure(exc):
                    raise
                folder = signature.bind(*args, **kwargs).arguments.get(parameter)
                raise WriteFailedError(
                    f"cannot write {short_path(folder)}: {describe_error(exc)}"
                ) from exc

        return wrapper  # type: ignore[return-value]

    return decorate


WRITE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.ENAMETOOLONG}
)


def _is_write_failure(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in WRITE_ERRNOS
    text = str(exc)
    if isinstance(exc, RuntimeError) and "inline_container.cc" in text:
        return True
    if type(exc).__name__ == "SafetensorError" and (code := _OS_ERROR_CODE.search(text)):
        return int(code[1]) in WRITE_ERRNOS
    return False
