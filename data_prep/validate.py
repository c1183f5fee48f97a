"""Check one raw row against the Multilingual-Thinking schema.

Schema: ``reasoning_language``, ``developer``, ``user``, ``analysis``, ``final`` (non-empty
strings) and ``messages``: a list of ``{"role", "content", "thinking"}`` dicts — the system
message (``reasoning language: X`` and the developer text), the user message (equal to
``user``) and the assistant message (content equal to ``final``, thinking equal to
``analysis``). A row that breaks the schema is rejected with a reason code and a message.

Beyond the schema, a row must be what it says: no text field holds a harmony control token
(``<|end|>``, ``<|start|>``…: rendered and tokenized, it would forge a turn), the reasoning has
letters (not only emoji or digits), and reasoning of ``CHECKED_REASONING_LETTERS`` letters or
more is written in the ``reasoning_language`` the row claims (the project's language
identifier, ``core.language_id``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from core.harmony import find_control_token
from core.language_id import identify_language
from core.languages import UNDETERMINED, UnknownLanguageError, normalize_language

TEXT_FIELDS = ("reasoning_language", "developer", "user", "analysis", "final")
REQUIRED_FIELDS = (*TEXT_FIELDS, "messages")

# Reason codes, one per way a row can be bad; each row in quarantine.jsonl carries one.
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
NOT_A_STRING = "not_a_string"
EMPTY_FIELD = "empty_field"
OVERSIZE = "oversize"
INVALID_TEXT = "invalid_text"
UNKNOWN_LANGUAGE = "unknown_language"
BROKEN_MESSAGES = "broken_messages"
DUPLICATE = "duplicate"
CONTROL_TOKEN = "control_token"
NO_LETTERS = "no_letters"
WRONG_LANGUAGE = "wrong_language"
REASONS = (
    INVALID_JSON,
    NOT_AN_OBJECT,
    MISSING_FIELD,
    NOT_A_STRING,
    EMPTY_FIELD,
    OVERSIZE,
    INVALID_TEXT,
    UNKNOWN_LANGUAGE,
    BROKEN_MESSAGES,
    DUPLICATE,
    CONTROL_TOKEN,
    NO_LETTERS,
    WRONG_LANGUAGE,
)

CHECKED_REASONING_LETTERS = 20
"""Reasoning with at least this many letters must be identified as its labelled language
(shorter text is too little to judge: ``core.language_id.CONFIDENT_LETTERS``)."""
CHECKED_REASONING_CHARS = 1_000
"""The head of the reasoning that is identified: enough to tell its language, and the cost
per row stays bounded whatever the reasoning's length."""

# C0/C1 control characters other than tab, newline and carriage return, and lone surrogates
# (text that is not valid Unicode and cannot be written as UTF-8).
_INVALID_CHAR = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


@dataclass(frozen=True)
class Rejection:
    """Why a row was rejected: a reason code (one of REASONS) and a human message."""

    reason: str
    detail: str


class ValidRow(NamedTuple):
    """The fields of a row that passed validation, with the reasoning language normalized."""

    reasoning_language: str
    developer: str
    user: str
    analysis: str
    final: str


def validate_row(data: Any, max_field_chars: int) -> ValidRow | Rejection:
    """Return the row's fields when it matches the schema, else the first problem found."""
    if not isinstance(data, dict):
        return Rejection(NOT_AN_OBJECT, f"row is a {type(data).__name__}, expected a JSON object")
    for field in REQUIRED_FIELDS:
        if data.get(field) is None:
            return Rejection(MISSING_FIELD, f"field {field!r} is missing")
    for field in TEXT_FIELDS:
        value = data[field]
        if not _is_good_text(value, max_field_chars):
            return check_text(field, value, max_field_chars)
    try:
        reasoning_language = normalize_language(data["reasoning_language"])
    except UnknownLanguageError as exc:
        return Rejection(UNKNOWN_LANGUAGE, f"field 'reasoning_language': {exc}")
    problem = _check_messages(data, max_field_chars) or _check_language(
        data["analysis"], data["final"], reasoning_language
    )
    if problem:
        return problem
    return ValidRow(
        reasoning_language=reasoning_language,
        developer=data["developer"].strip(),
        user=data["user"].strip(),
        analysis=data["analysis"].strip(),
        final=data["final"].strip(),
    )


def _check_language(analysis: str, final: str, language: str) -> Rejection | None:
    """The reasoning and answer hold words, and the reasoning is in its labelled language."""
    if not any(ch.isalpha() for ch in analysis):
        return Rejection(NO_LETTERS, "field 'analysis' has no letters (only symbols or emoji)")
    if not any(ch.isalnum() for ch in final):
        return Rejection(NO_LETTERS, "field 'final' has no letters or digits (only symbols)")
    if sum(ch.isalpha() for ch in analysis) < CHECKED_REASONING_LETTERS:
        return None
    found = identify_language(analysis[:CHECKED_REASONING_CHARS])
    if found not in (language, UNDETERMINED):
        return Rejection(
            WRONG_LANGUAGE,
            f"field 'analysis' is written in {found!r}, not in its reasoning_language {language!r}",
        )
    return None


def _is_good_text(value: Any, max_chars: int) -> bool:
    """What check_text accepts, decided fast (the usual case)."""
    if not isinstance(value, str) or not 0 < len(value) <= max_chars or value.isspace():
        return False
    if "<|" in value and find_control_token(value):
        return False
    # isprintable() is a fast C loop, true for most text; the regex decides the rest
    return value.isprintable() or _INVALID_CHAR.search(value) is None


def check_text(field: str, value: Any, max_chars: int, where: str = "field") -> Rejection | None:
    """The first problem of a text value (not a string, empty, too long, a control character
    or lone surrogate, a harmony control token), or None."""
    if _is_good_text(value, max_chars):
        return None
    if not isinstance(value, str):
        return Rejection(
            NOT_A_STRING, f"{where} {field!r} is a {type(value).__name__}, not a string"
        )
    if not value or value.isspace():
        return Rejection(EMPTY_FIELD, f"{where} {field!r} is empty")
    if len(value) > max_chars:
        return Rejection(
            OVERSIZE, f"{where} {field!r} has {len(value):,} characters (limit {max_chars:,})"
        )
    bad = _INVALID_CHAR.search(value)
    if bad:
        code = ord(bad.group())
        kind = "a lone surrogate (not valid Unicode)" if code >= 0xD800 else "a control character"
        return Rejection(
            INVALID_TEXT,
            f"{where} {field!r} holds {kind} U+{code:04X} at offset {bad.start()}",
        )
    token = find_control_token(value)
    if token:
        return Rejection(
            CONTROL_TOKEN,
            f"{where} {field!r} holds the harmony control token {token.group()} at offset "
            f"{token.start()} (control tokens are never text: it would forge a turn)",
        )
    return None


def _check_messages(data: dict, max_chars: int) -> Rejection | None:
    messages = data["messages"]
    if not isinstance(messages, list):
        return Rejection(BROKEN_MESSAGES, f"'messages' is a {type(messages).__name__}, not a list")
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles != ["system", "user", "assistant"]:
        return Rejection(
            BROKEN_MESSAGES,
            f"'messages' roles are {roles}, expected ['system', 'user', 'assistant']",
        )
    system, user, assistant = messages
    # user/assistant texts must equal fields already checked; compare before checking text
    identical = (
        user.get("content") == data["user"]
        and assistant.get("content") == data["final"]
        and assistant.get("thinking") == data["analysis"]
    )
    if not identical:  # equal after stripping will do; else say which one differs
        problem = _messages_text_problem(data, user, assistant)
        if problem:
            return problem
    problem = check_text("content", system.get("content"), max_chars, where="messages[0] (system)")
    if problem:
        return (
            problem
            if problem.reason == CONTROL_TOKEN
            else Rejection(BROKEN_MESSAGES, problem.detail)
        )
    if data["developer"].strip() not in system["content"]:
        return Rejection(BROKEN_MESSAGES, "messages[0] (system) does not hold the 'developer' text")
    return None


def _messages_text_problem(data: dict, user: dict, assistant: dict) -> Rejection | None:
    for where, key, value, field in (
        ("messages[1] (user)", "content", user.get("content"), "user"),
        ("messages[2] (assistant)", "content", assistant.get("content"), "final"),
        ("messages[2] (assistant)", "thinking", assistant.get("thinking"), "analysis"),
    ):
        if not isinstance(value, str) or (
            value != data[field] and value.strip() != data[field].strip()
        ):
            shown = "missing" if value is None else f"a {type(value).__name__}"
            what = "differs from" if isinstance(value, str) else f"is {shown}, expected"
            return Rejection(BROKEN_MESSAGES, f"{where} {key} {what} field {field!r}")
    return None
