"""Secrets never leave a process: one redaction for every print, log line, report and file.

``redact(text)`` replaces, wherever they appear in ``text``:

- the user info of a URL: ``http://dave:PW@host`` → ``http://dave:***@host`` (an http(s) URL
  whose user info is one token, ``https://TOKEN@host``, → ``https://***@host``), and a
  ``user:password@host`` without a scheme (``dave:PW@127.0.0.1:8000`` → ``dave:***@…``);
- credentials in a query string or a ``key=value`` list: ``token=``, ``access_token=``,
  ``key=``, ``api_key=``, ``sig=``, ``X-Amz-Signature=``, ``X-Amz-Credential=``,
  ``X-Amz-Security-Token=``, ``password=``, ``secret=``… → ``name=***``;
- a bearer token (``Authorization: Bearer …``) → ``Bearer ***``;
- the values of this process's secret environment variables (a name holding ``SECRET``,
  ``TOKEN``, ``PASSWORD``, ``PASSWD``, ``API_KEY``, ``ACCESS_KEY``, ``PRIVATE_KEY`` or
  ``CREDENTIAL``: ``AWS_SECRET_ACCESS_KEY``, ``MLFLOW_TRACKING_PASSWORD``, ``KFP_TOKEN``,
  ``HF_TOKEN``, ``OPENAI_API_KEY``…; values of ``MIN_SECRET_CHARS`` characters or more), and
  the passwords of URLs held by any environment variable (``AWS_ENDPOINT_URL``,
  ``MLFLOW_TRACKING_URI``…) → ``***``.

``redact_data`` does the same to every string of a JSON-like value (``results.json``, MLflow
parameters). ``install`` makes every log record of the process go through ``redact`` (a log
record factory: any logger, any handler, added before or after), and so do uncaught
exceptions and warnings; ``configure_logging`` is ``logging.basicConfig`` plus ``install``.
What a process prints on purpose goes through ``redact`` where it is printed (the CLI's
``echo``, the local run's console and log). What reaches a terminal (log records, uncaught
exceptions, warnings, the CLI's lines) also has its terminal controls escaped
(``printable``: an ANSI escape sequence from a server is shown as ``\\x1b[…``, not obeyed).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import warnings
from typing import Any

MASK = "***"
MIN_SECRET_CHARS = 8
"""A secret variable's value is redacted when it has at least this many characters (shorter
values, ``1`` or ``true``, would mask ordinary text)."""
MIN_URL_PASSWORD_CHARS = 4

SECRET_NAME = re.compile(
    r"SECRET|TOKEN|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.IGNORECASE
)
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^\s/?#\"<>]+)@")
"""A URL's user info: up to the last ``@`` before the host (a password may hold ``@``,
``'`` and RFC 3986's other sub-delimiters), never past a ``/``, ``?``, ``#`` or a space."""
_BARE_USERINFO = re.compile(
    r"(?<![\w.~%+/:-])(?P<user>[\w.~%+-]+):(?P<password>[^\s/?#\"'<>]+)@(?=[\w\[])"
)
"""``user:password@host`` without a scheme (a URL's authority, as a label or a host:port):
the password runs to the last ``@`` before the host, as in a URL."""
CREDENTIAL_NAME = re.compile(
    r"(?:token|key|sig|signature|password|passwd|pwd|secret|credential|auth)$", re.IGNORECASE
)
"""A parameter or field whose name ends so holds a credential (``X-Amz-Signature``,
``access_token``, ``api_key``, ``sig``); ``max_tokens`` or ``api_key_env`` do not."""
_CREDENTIAL_PARAM = re.compile(
    r"(?P<name>(?:^|(?<=[?&;\s,(\"']))[\w.-]*?(?:token|key|sig|signature|password|passwd|pwd"
    r"|secret|credential|auth)=[\"']?)(?P<value>[^&;\s#\"'<>,)]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<name>\bBearer\s+)(?P<value>[\w.~+/=-]+)", re.IGNORECASE)


def _userinfo(match: re.Match) -> str:
    scheme, userinfo = match["scheme"], match["userinfo"]
    user, colon, _ = userinfo.partition(":")
    if colon:
        return f"{scheme}{user}:{MASK}@"
    if scheme.lower().startswith("http"):  # https://TOKEN@host: the user is a credential
        return f"{scheme}{MASK}@"
    return match.group(0)  # ssh://git@host: a user name


def secret_values(environ: os._Environ | dict[str, str] | None = None) -> list[str]:
    """The secret values of ``environ`` (default: this process's), longest first."""
    from urllib.parse import urlsplit

    environ = os.environ if environ is None else environ
    found = set()
    for name, value in environ.items():
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_CHARS:
            found.add(value)
        if "://" in value and "@" in value:
            try:
                password = urlsplit(value).password
            except ValueError:
                password = None
            if password and len(password) >= MIN_URL_PASSWORD_CHARS:
                found.add(password)
    return sorted(found, key=len, reverse=True)


def redact(text: str, secrets: list[str] | None = None) -> str:
    """``text`` with every credential it holds replaced by ``***`` (see the module docstring).

    Args:
        text: Any text (a message, a URL, a report).
        secrets: The literal values to mask; default: ``secret_values()`` of the environment.
    """
    if not text:
        return text
    if "://" in text:
        text = _URL_USERINFO.sub(_userinfo, text)
    if "@" in text:
        text = _BARE_USERINFO.sub(lambda m: f"{m['user']}:{MASK}@", text)
    if "=" in text:
        text = _CREDENTIAL_PARAM.sub(lambda m: m["name"] + MASK, text)
    text = _BEARER.sub(lambda m: m["name"] + MASK, text)
    for value in secret_values() if secrets is None else secrets:
        if value in text:
            text = text.replace(value, MASK)
    return text


_CONSOLE_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""Characters a terminal acts on rather than shows: C0 controls but tab and newline (ESC
starts an ANSI sequence; CR overwrites a line), DEL, C1 controls and bidi overrides."""


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: the characters of ``_CONSOLE_UNSAFE`` (an ANSI
    escape from a server, a carriage return) written as ``\\x1b``, ``\\u202e``…."""
    if text.isprintable() or not _CONSOLE_UNSAFE.search(text):
        return text
    return _CONSOLE_UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def for_console(text: str) -> str:
    """``text`` as the project prints it: credentials redacted, terminal controls escaped."""
    return printable(redact(text))


def redact_data(value: Any, secrets: list[str] | None = None) -> Any:
    """A copy of a JSON-like ``value`` (dicts, lists, tuples, strings, numbers) with every
    string (keys included) redacted, and the string value of a key named like a credential
    (``CREDENTIAL_NAME``: ``password``, ``api_key``…) masked whole."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {
            redact_data(k, secrets): MASK
            if isinstance(k, str) and isinstance(v, str) and v and CREDENTIAL_NAME.search(k)
            else redact_data(v, secrets)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redact_data(v, secrets) for v in value)
    return value


def redact_exception(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, redacted (for one-line error messages)."""
    return redact(f"{type(exc).__name__}: {exc}")


_install_lock = threading.Lock()
_installed: list[bool] = []


def install() -> None:
    """Redact every log record, uncaught exception and warning of this process (idempotent).

    Log records are redacted when they are made (``logging.setLogRecordFactory``), so every
    handler sees the redacted message and traceback, whichever logger made the record and
    whenever the handler was added (a filter on a logger misses records its children
    propagate; one on a handler misses handlers added later).
    """
    with _install_lock:
        if _installed:
            return
        _installed.append(True)
        make_record = logging.getLogRecordFactory()

        def redacted_record(*args, **kwargs) -> logging.LogRecord:
            record = make_record(*args, **kwargs)
            _redact_record(record)
            return record

        def redacted_excepthook(kind, exc, tb) -> None:
            import traceback

            sys.stderr.write(for_console("".join(traceback.format_exception(kind, exc, tb))))
            sys.stderr.flush()

        def redacted_warning(message, category, filename, lineno, file=None, line=None):
            text = warnings.formatwarning(message, category, filename, lineno, line)
            (file or sys.stderr).write(for_console(text))

        logging.setLogRecordFactory(redacted_record)
        sys.excepthook = redacted_excepthook
        warnings.showwarning = redacted_warning


def _redact_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a malformed record: let the handler report it as logging does
        return
    record.msg, record.args = for_console(message), None
    if record.exc_info and not record.exc_text:
        record.exc_text = for_console(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = for_console(record.stack_info)


def configure_logging(level: int = logging.INFO, fmt: str | None = None) -> None:
    """``logging.basicConfig`` (``fmt``: the format, default ``LEVEL name: message``) with
    every record redacted (``install``)."""
    install()
    logging.basicConfig(level=level, format=fmt or "%(levelname)s %(name)s: %(message)s")
