"""Language identification restricted to en/fr/de/es/it + other (eval/language_id.py)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval.language_id import (
    MAX_PROFILE_PIECES,
    LanguageIdentifier,
    LanguageProfile,
    identify_language,
    language_profile,
)
from eval.languages import OTHER, SUPPORTED_LANGUAGES, UNDETERMINED

SENTENCES = {
    "en": "We need to find the total cost of three notebooks and two pens.",
    "fr": "Nous devons trouver le coût total de trois cahiers et de deux stylos.",
    "de": "Wir müssen die Gesamtkosten für drei Hefte und zwei Stifte berechnen.",
    "es": "Tenemos que calcular el coste total de tres cuadernos y dos bolígrafos.",
    "it": "Dobbiamo calcolare il costo totale di tre quaderni e due penne.",
}


@pytest.mark.parametrize(("code", "text"), SENTENCES.items())
def test_identifies_each_supported_language(code: str, text: str) -> None:
    assert identify_language(text) == code
    assert identify_language(text.upper()) == code  # all caps is lowered first


@pytest.mark.parametrize(
    "text",
    [
        "Precisamos calcular o custo total de três cadernos e duas canetas.",
        "Нам нужно вычислить общую стоимость трёх тетрадей и двух ручек.",
        "我们需要计算三本笔记本和两支笔的总价格。",
        "We moeten de totale kosten van drie schriften en twee pennen berekenen.",
    ],
)
def test_other_languages_are_other(text: str) -> None:
    assert identify_language(text) == OTHER


@pytest.mark.parametrize("text", ["42", "x = 3", "OK", "12 + 30 = 42", "", "   ", "…"])
def test_too_little_text_is_undetermined(text: str) -> None:
    assert identify_language(text) == UNDETERMINED


def test_short_text_needs_a_confident_model() -> None:
    assert identify_language("Bonjour à tous.") == "fr"
    assert identify_language("Vielen Dank!") in ("de", UNDETERMINED)
    calls: list[str] = []

    def unsure(text: str) -> tuple[str, float]:
        calls.append(text)
        return "fr", 0.3

    identifier = LanguageIdentifier(top_language=unsure)
    assert identifier.identify("Merci beaucoup") == UNDETERMINED  # 13 letters, p 0.3
    assert identifier.identify("Merci beaucoup, vraiment, mes amis") == "fr"  # >= 20 letters
    assert identifier.identify("Oui") == UNDETERMINED  # 3 letters: the model is not asked
    assert calls == ["Merci beaucoup", "Merci beaucoup, vraiment, mes amis"]


def test_non_strings_and_bad_unicode_do_not_raise() -> None:
    assert identify_language(None) == UNDETERMINED
    assert identify_language(b"bytes") == UNDETERMINED
    assert identify_language("\ud800 " + SENTENCES["en"]) == "en"  # lone surrogate
    assert language_profile(12) == LanguageProfile()


def test_profile_of_a_mostly_french_text_with_an_english_quote() -> None:
    text = (
        "Nous calculons d'abord le prix unitaire. Le client a écrit : \"Please send the "
        'invoice today." Ensuite nous multiplions par la quantité commandée. Le total est '
        "donc de quarante-huit euros."
    )
    profile = language_profile(text)
    assert profile.dominant == "fr"
    assert profile.fraction("fr") >= 0.65
    assert abs(sum(profile.fractions.values()) - 1.0) < 1e-9


def test_profile_of_a_half_english_text() -> None:
    text = (
        "Nous devons d'abord calculer le prix total des pommes. "
        "Then we divide the total price by the number of people."
    )
    profile = language_profile(text)
    assert 0.35 < profile.fraction("fr") < 0.65
    assert 0.35 < profile.fraction("en") < 0.65
    assert profile.pieces == 2


def test_short_sentences_are_joined_into_judgeable_pieces() -> None:
    profile = language_profile("Oui. Non. Peut-être. Bien sûr que oui, mon ami.")
    assert profile.pieces == 1
    assert profile.dominant == "fr"


def test_undetermined_profile() -> None:
    profile = language_profile("42. 17. x = 3.")
    assert not profile.determined
    assert profile.dominant == UNDETERMINED
    assert profile.fraction("en") == 0.0


def test_long_text_is_sampled_and_stays_fast() -> None:
    text = (SENTENCES["fr"] + " " + SENTENCES["en"] + " ") * 5000  # ~700 kB
    start = time.perf_counter()
    profile = language_profile(text)
    assert time.perf_counter() - start < 1.0
    assert profile.pieces == MAX_PROFILE_PIECES
    assert 0.25 < profile.fraction("fr") < 0.75


def test_invalid_settings_raise_value_error() -> None:
    with pytest.raises(ValueError, match="min_letters"):
        LanguageIdentifier(top_language=lambda t: ("en", 1.0), min_letters=30)
    with pytest.raises(ValueError, match="min_short_confidence"):
        LanguageIdentifier(top_language=lambda t: ("en", 1.0), min_short_confidence=2.0)
    with pytest.raises(ValueError, match="max_pieces"):
        LanguageIdentifier(top_language=lambda t: ("en", 1.0)).profile("text", max_pieces=0)


_OUTCOMES = {*SUPPORTED_LANGUAGES, OTHER, UNDETERMINED}


@settings(max_examples=150)
@given(st.text(max_size=300))
def test_identify_never_raises_and_stays_in_the_outcomes(text: str) -> None:
    assert identify_language(text) in _OUTCOMES


@settings(max_examples=150)
@given(st.text(max_size=600))
def test_profile_fractions_are_a_distribution(text: str) -> None:
    profile = language_profile(text)
    assert set(profile.fractions) <= {*SUPPORTED_LANGUAGES, OTHER}
    if profile.determined:
        assert abs(sum(profile.fractions.values()) - 1.0) < 1e-9
    else:
        assert profile.fractions == {}
    assert 0 <= profile.judged_letters <= profile.total_letters
