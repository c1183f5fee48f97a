"""Sentence splitting and letter counting (core/sentences.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.sentences import count_letters, count_sentences, rough_segments, split_sentences


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 3.14. That is pi.", ["The answer is 3.14.", "That is pi."]),
        ("La réponse est 3,5 kg. C'est tout.", ["La réponse est 3,5 kg.", "C'est tout."]),
        ("It costs 1,234.50 dollars.", ["It costs 1,234.50 dollars."]),
        ("Dr. Smith said e.g. this. Then he left.", ["Dr. Smith said e.g. this.", "Then he left."]),
        ("Das ist z.B. gut. Und bzw. schlecht.", ["Das ist z.B. gut.", "Und bzw. schlecht."]),
        ("Il a dit p. ex. ceci. Puis il part.", ["Il a dit p. ex. ceci.", "Puis il part."]),
        ("La Sra. García llegó. Luego se fue.", ["La Sra. García llegó.", "Luego se fue."]),
        ("Il Sig. Rossi e il dott. Bianchi. Fine.", ["Il Sig. Rossi e il dott. Bianchi.", "Fine."]),
        ("J. K. Rowling wrote it. Next.", ["J. K. Rowling wrote it.", "Next."]),
        ("Hmm... let me think. Wait... No!", ["Hmm... let me think.", "Wait...", "No!"]),
        ("Hmm… voyons. Donc…", ["Hmm… voyons.", "Donc…"]),
        ("¿Qué hora es? Son las 3. ¡Vamos!", ["¿Qué hora es?", "Son las 3.", "¡Vamos!"]),
        ("He said “Stop.” Then silence.", ["He said “Stop.”", "Then silence."]),
        ("Wow! that works.", ["Wow! that works."]),
    ],
)
def test_split_sentences(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


def test_lists_count_items_not_markers() -> None:
    text = "Steps:\n1. Add 2.\n2. Multiply by 3.\n3) Done"
    assert split_sentences(text) == ["Steps:", "Add 2.", "Multiply by 3.", "Done"]
    assert count_sentences("- one\n- two\n* three\n• four") == 4
    assert count_sentences("a) yes\nb) no") == 2
    assert count_sentences("### Answer\n**42**") == 2


def test_line_breaks_end_sentences_and_empty_pieces_are_dropped() -> None:
    assert split_sentences("First line\n\nSecond line") == ["First line", "Second line"]
    assert split_sentences("...\n—\n**") == []
    assert count_sentences("") == 0
    assert count_sentences(None) == 0  # type: ignore[arg-type]


def test_a_brief_answer_with_a_decimal_is_one_sentence() -> None:
    assert count_sentences("La réponse est 3.5.") == 1
    assert count_sentences("Die Antwort ist 3,5. Das ist alles.") == 2


def test_count_letters() -> None:
    assert count_letters("Hello, world 42!") == 10
    assert count_letters("Grüße") == 5
    assert count_letters("Привет") == 6
    assert count_letters("12 + 30 = 42") == 0
    assert count_letters("") == 0


def test_rough_segments_cover_the_text() -> None:
    text = "One. Two!\nThree? Four"
    spans = rough_segments(text)
    assert "".join(text[a:b] for a, b in spans) == text
    assert [text[a:b].strip() for a, b in spans] == ["One.", "Two!", "Three?", "Four"]


_words = st.text(alphabet="abcdefghij ", min_size=1, max_size=30).filter(lambda t: t.strip())


@given(st.lists(_words, min_size=1, max_size=8))
def test_n_capitalized_sentences_count_as_n(bodies: list[str]) -> None:
    text = " ".join(f"Zz {body.strip()} end." for body in bodies)
    assert count_sentences(text) == len(bodies)


@given(st.text(max_size=400))
def test_never_raises_and_agrees_with_itself(text: str) -> None:
    sentences = split_sentences(text)
    assert count_sentences(text) == len(sentences)
    assert all(s == s.strip() and s for s in sentences)
    spans = rough_segments(text)
    assert "".join(text[a:b] for a, b in spans) == text


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=200))
def test_count_letters_is_exact_on_ascii(text: str) -> None:
    assert count_letters(text) == sum(c.isalpha() for c in text)
