import pytest
from conftest import TEXTS, make_row

from data_prep import validate as v

LIMIT = 1000


def _reason(row):
    result = v.validate_row(row, LIMIT)
    assert isinstance(result, v.Rejection), result
    return result.reason, result.detail


def test_valid_row_is_normalized():
    row = make_row("Français", developer="  Be kind.  ", analysis=TEXTS["French"][0])
    row["messages"][0]["content"] = "reasoning language: Français\n\nBe kind."
    result = v.validate_row(row, LIMIT)
    assert isinstance(result, v.ValidRow)
    assert result.reasoning_language == "fr"
    assert result.developer == "Be kind."


@pytest.mark.parametrize("field", v.REQUIRED_FIELDS)
def test_missing_field(field):
    row = make_row()
    del row[field]
    assert _reason(row) == (v.MISSING_FIELD, f"field {field!r} is missing")


def test_null_field_counts_as_missing():
    row = make_row()
    row["final"] = None
    assert _reason(row)[0] == v.MISSING_FIELD


@pytest.mark.parametrize("field", v.TEXT_FIELDS)
def test_empty_field(field):
    row = make_row()
    row[field] = "   "
    assert _reason(row) == (v.EMPTY_FIELD, f"field {field!r} is empty")


@pytest.mark.parametrize("value", [3, 2.5, ["a"], {"a": 1}, True])
def test_not_a_string(value):
    row = make_row()
    row["user"] = value
    reason, detail = _reason(row)
    assert reason == v.NOT_A_STRING
    assert "'user'" in detail


def test_unknown_language():
    reason, detail = _reason(make_row("Klingon"))
    assert reason == v.UNKNOWN_LANGUAGE
    assert "Klingon" in detail


def test_oversize():
    row = make_row(analysis="x" * (LIMIT + 1))
    reason, detail = _reason(row)
    assert reason == v.OVERSIZE
    assert "'analysis'" in detail and "1,001" in detail


@pytest.mark.parametrize("bad", ["\x00", "\x07", "\x1b[31m", "\x85"])
def test_control_characters(bad):
    row = make_row(final=f"The answer{bad} is 4.")
    row["messages"][2]["content"] = row["final"]
    assert _reason(row)[0] == v.INVALID_TEXT


def test_lone_surrogate_is_invalid_text():
    row = make_row(user="broken \ud800 text")
    row["messages"][1]["content"] = row["user"]
    assert _reason(row)[0] == v.INVALID_TEXT


def test_not_an_object():
    assert _reason(["a", "b"])[0] == v.NOT_AN_OBJECT


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda r: r.__setitem__("messages", "not a list"), "not a list"),
        (lambda r: r["messages"].pop(), "roles"),
        (lambda r: r["messages"][1].__setitem__("role", "assistant"), "roles"),
        (lambda r: r["messages"][1].__setitem__("content", "another question"), "user"),
        (lambda r: r["messages"][2].__setitem__("content", "another answer"), "final"),
        (lambda r: r["messages"][2].__setitem__("thinking", "other thoughts"), "analysis"),
        (lambda r: r["messages"][2].__setitem__("thinking", None), "thinking"),
        (
            lambda r: r["messages"][0].__setitem__("content", "reasoning language: French"),
            "developer",
        ),
        (lambda r: r["messages"].__setitem__(0, "system"), "roles"),
    ],
)
def test_broken_messages(mutate, needle):
    row = make_row()
    mutate(row)
    reason, detail = _reason(row)
    assert reason == v.BROKEN_MESSAGES
    assert needle in detail
