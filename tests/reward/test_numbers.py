"""Reading the numeric answer out of a final answer (reward/numbers.py)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reward.numbers import extract_numeric_answer, numbers_match


@pytest.mark.parametrize(
    ("text", "language", "expected"),
    [
        ("The answer is 42.", "en", 42.0),
        ("La réponse est 3,5 kg.", "fr", 3.5),
        ("La réponse est 3.5 kg.", "fr", 3.5),
        ("Total: 1,234.50 dollars", "en", 1234.5),
        ("Insgesamt 1.234,5 Euro", "de", 1234.5),
        ("1,234", "en", 1234.0),
        ("1,234", "fr", 1.234),
        ("1.234", "de", 1234.0),
        ("1.234", "en", 1.234),
        ("0,125", "en", 0.125),
        ("12 000 habitants", "fr", 12000.0),
        ("It is -5 degrees", "en", -5.0),
        ("x = −3,25", "fr", -3.25),
        ("3/4 of it", "en", 0.75),
        ("25%", "fr", 25.0),
        ("\\boxed{17} but later 18", "en", 17.0),
        ("**42** because 6 × 7", "en", 42.0),
        ("From 3 baskets of 4 apples we get 12 apples.", "en", 12.0),
    ],
)
def test_digits(text: str, language: str, expected: float) -> None:
    assert extract_numeric_answer(text, language) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "language", "expected"),
    [
        ("forty-two apples", "en", 42),
        ("two hundred and five", "en", 205),
        ("one thousand two hundred", "en", 1200),
        ("quarante-deux pommes", "fr", 42),
        ("soixante et onze", "fr", 71),
        ("quatre-vingt-dix-sept", "fr", 97),
        ("quatre-vingts", "fr", 80),
        ("deux cents", "fr", 200),
        ("dix-neuf mille", "fr", 19000),
        ("zweiundvierzig Äpfel", "de", 42),
        ("dreihundertzwölf", "de", 312),
        ("einhundertdreißig", "de", 130),
        ("cuarenta y dos manzanas", "es", 42),
        ("veintidós", "es", 22),
        ("doscientos treinta", "es", 230),
        ("quarantadue mele", "it", 42),
        ("ventotto", "it", 28),
        ("duemilatrecento", "it", 2300),
        ("quarante-deux, un nombre pair", "fr", 42),
    ],
)
def test_number_words(text: str, language: str, expected: int) -> None:
    assert extract_numeric_answer(text, language) == expected


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("Ein Apfel", "de"),  # a lone article is not "1"
        ("the due date", "en"),  # "due" is Italian for 2, not English
        ("Version 1.2.3", "en"),
        ("5/0", "en"),
        ("no number here", "en"),
        ("forty-two", None),  # words are read only in a known language
        (None, "en"),
        ("", "fr"),
    ],
)
def test_no_number(text: str | None, language: str | None) -> None:
    assert extract_numeric_answer(text, language) is None


def test_numbers_match() -> None:
    assert numbers_match(42.0, 42)
    assert numbers_match(0.1 + 0.2, 0.3)
    assert not numbers_match(41.9, 42)
    assert not numbers_match(None, 42)
    assert not numbers_match(math.nan, math.nan)


def test_huge_input_is_read_quickly_from_its_tail() -> None:
    start = time.perf_counter()
    assert extract_numeric_answer("bla " * 250_000 + "donc quarante-deux.", "fr") == 42
    assert extract_numeric_answer("a" * 1_000_000, "fr") is None
    assert extract_numeric_answer("1 " * 500_000 + "7", "en") == 7
    assert time.perf_counter() - start < 1.0


@given(st.integers(min_value=-(10**9), max_value=10**9), st.integers(min_value=0, max_value=99))
def test_formatted_numbers_read_back(integer: int, cents: int) -> None:
    value = integer + math.copysign(cents / 100, integer or 1)
    english = f"The total is {value:,.2f} dollars."
    french = "Le total est de " + f"{value:,.2f}".replace(",", " ").replace(".", ",") + " €."
    assert extract_numeric_answer(english, "en") == pytest.approx(value)
    assert extract_numeric_answer(french, "fr") == pytest.approx(value)


@given(st.text(max_size=200), st.sampled_from(["en", "fr", "de", "es", "it", None]))
def test_never_raises(text: str, language: str | None) -> None:
    value = extract_numeric_answer(text, language)
    assert value is None or isinstance(value, float)
