"""The batched language profile (numpy re-implementation of fastText's prediction, pieces of
all texts identified at once) gives exactly the verdicts of the careful path: each piece cut
with ``rough_segments`` + ``count_letters`` and identified by fastText's own ``predict``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.fasttext_batch import OUTCOMES
from core.language_id import (
    MAX_PROFILE_CHARS,
    MAX_PROFILE_PIECES,
    LanguageIdentifier,
    LanguageProfile,
    _model_input,
    _stratified_sample,
    default_identifier,
)
from core.languages import UNDETERMINED
from core.sentences import count_letters, letter_mask, rough_segment_ends, rough_segments
from reward.scoring import ComplianceScorer

ROOT = Path(__file__).resolve().parents[2]
TESTSET = ROOT / "bench" / "data" / "langid_testset.jsonl"


def careful_profile(
    identifier: LanguageIdentifier,
    text: object,
    max_chars: int = MAX_PROFILE_CHARS,
    max_pieces: int = MAX_PROFILE_PIECES,
) -> LanguageProfile:
    """The per-sentence profile as it was written before batching: one fastText call per piece."""
    if not isinstance(text, str) or not text:
        return LanguageProfile()
    text = text[:max_chars]
    pieces: list[tuple[int, int, int]] = []
    piece_start = letters = 0
    for start, end in rough_segments(text):
        letters += count_letters(text[start:end])
        if letters >= identifier.confident_letters:
            pieces.append((piece_start, end, letters))
            piece_start, letters = end, 0
    if piece_start < len(text):
        if pieces and letters < identifier.confident_letters:
            last_start, _, last_letters = pieces.pop()
            pieces.append((last_start, len(text), last_letters + letters))
        else:
            pieces.append((piece_start, len(text), letters))
    if len(pieces) > max_pieces:
        pieces = _stratified_sample(pieces, max_pieces)
    counts = dict.fromkeys(OUTCOMES, 0)
    judged = total = 0
    for start, end, letters in pieces:
        total += letters
        outcome = identifier._decide(text[start:end], letters)  # fastText's own predict
        if outcome != UNDETERMINED:
            counts[outcome] += letters
            judged += letters
    fractions = {k: v / judged for k, v in counts.items() if v} if judged else {}
    return LanguageProfile(MappingProxyType(fractions), judged, total, len(pieces))


def assert_same(fast: LanguageProfile, careful: LanguageProfile, text: object) -> None:
    assert (fast.pieces, fast.judged_letters, fast.total_letters) == (
        careful.pieces,
        careful.judged_letters,
        careful.total_letters,
    ), repr(text)[:200]
    assert dict(fast.fractions) == dict(careful.fractions), repr(text)[:200]


def _testset_texts() -> list[str]:
    with TESTSET.open(encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


def test_same_profiles_as_the_careful_path_on_the_test_set_and_its_mixtures() -> None:
    identifier = default_identifier()
    texts = _testset_texts()
    rng = random.Random(0)
    mixtures = [" ".join(rng.sample(texts, rng.randint(2, 30))) for _ in range(300)]
    mixtures += ["\n".join(rng.sample(texts, rng.randint(2, 80))) for _ in range(50)]
    mixtures += [t.upper() for t in texts[:50]] + [t.lower() for t in texts[:50]]
    every = [*texts, *mixtures, None, "", 42, "   ", "x"]
    for text, fast in zip(every, identifier.profiles(every), strict=True):
        assert_same(fast, careful_profile(identifier, text), text)
    for text in mixtures[:20]:  # one at a time too, and with small limits
        assert_same(identifier.profile(text), careful_profile(identifier, text), text)
        assert_same(
            identifier.profile(text, max_chars=300, max_pieces=3),
            careful_profile(identifier, text, max_chars=300, max_pieces=3),
            text,
        )


@pytest.mark.parametrize(
    "text",
    [
        "Bonjour à tous \x00 les amis. Wie geht es dir heute?",  # NUL: a space to fastText
        "Ein Satz\u00a0mit geschütztem\u202fLeerzeichen. Et une phrase en français ici.",
        "x\ud800y z\udfff Bonjour tout le monde, comment allez-vous?",  # lone surrogates
        "__label__en hello there my friends. Hola amigos, ¿cómo estáis hoy?",
        "We stop here </s> and fastText reads no further. Nous continuons quand même.",
        "TOUT EN MAJUSCULES ICI. But this part is in ordinary English text.",
        "a\r\nb\tc\vd\fe\x1cf\x85g tabs and\u3000odd spaces. Ça marche aussi très bien.",
    ],
)
def test_same_profiles_on_odd_characters(text: str) -> None:
    identifier = default_identifier()
    assert_same(
        identifier.profiles([text, "padding text."])[0], careful_profile(identifier, text), text
    )


_WORDS = _testset_texts()
_ALPHABET = "aébßñ ÉA.!?…\n\t\x00\u00a0»)*_-1'"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(_WORDS),
            st.text(
                alphabet=st.sampled_from(list("aébßñ ÉA.!?…\n\t\x00\u00a0»)*_-1'")), max_size=40
            ),
        ),
        max_size=12,
    ).map(" ".join)
)
def test_same_profiles_on_generated_text(text: str) -> None:
    identifier = default_identifier()
    assert_same(identifier.profiles([text])[0], careful_profile(identifier, text), text)


def test_batched_model_gives_fasttexts_label_and_probability() -> None:
    identifier = default_identifier()
    texts = [t for t in _testset_texts() if t.strip()]
    lines = [_model_input(t) for t in texts]
    codes, probabilities = identifier._batch_model.top_many(lines)
    for text, code, probability in zip(lines, codes.tolist(), probabilities.tolist(), strict=True):
        label, expected = identifier._top(text)
        assert OUTCOMES[code] == (label if label in OUTCOMES[:-1] else OUTCOMES[-1])
        assert probability == pytest.approx(expected, abs=1e-5)


def test_letter_mask_and_segment_ends_match_the_one_by_one_helpers() -> None:
    for text in [*_testset_texts()[:100], "", "Grüße. Привет!\n\n42 x\ud800 «»", "Fin. "]:
        mask = letter_mask(text).tolist()
        assert len(mask) == len(text)
        assert mask == [count_letters(c) == 1 for c in text]
        ends = rough_segment_ends(text)
        if text and (not ends or ends[-1] < len(text)):
            ends.append(len(text))
        assert ends == [end for _, end in rough_segments(text)]


def test_score_batch_gives_the_verdicts_of_scoring_one_by_one() -> None:
    texts = _testset_texts()
    rng = random.Random(1)
    responses = [
        f"assistantanalysis{' '.join(rng.sample(texts, rng.randint(1, 20)))}"
        f"assistantfinal{rng.choice(texts)}"
        for _ in range(200)
    ] + [None, "", "assistantanalysis only reasoning here, cut off", "plain answer 42"]
    labels = [rng.choice(["en", "fr/en", "de/es", "it", "es/fr"]) for _ in responses]
    scorer = ComplianceScorer()
    batch = scorer.score_batch(responses, labels)
    for response, label, result in zip(responses, labels, batch, strict=True):
        one = scorer.score(response, label)
        assert result == one


def test_word_cache_that_overflows_is_emptied_without_changing_results() -> None:
    identifier = LanguageIdentifier()
    identifier._batch_model._CACHE_LIMIT = 64  # far fewer than the words of one batch
    identifier._batch_model._clear_cache()
    texts = _testset_texts()
    rng = random.Random(2)
    for _ in range(3):
        batch = [" ".join(rng.sample(texts, 8)) for _ in range(10)]
        for text, fast in zip(batch, identifier.profiles(batch), strict=True):
            assert_same(fast, careful_profile(identifier, text), text)
        assert len(identifier._batch_model._token_index) > 64  # grew for this batch
