"""Parsing a gpt-oss response into reasoning and final answer (core/parsing.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from core.parsing import ParsedResponse, ResponseFormat, parse_response

REASONING = "We need to add two and three."
FINAL = "The answer is 5."


def test_harmony_with_special_tokens() -> None:
    text = (
        f"<|channel|>analysis<|message|>{REASONING}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>"
    )
    parsed = parse_response(text)
    assert parsed == ParsedResponse(ResponseFormat.HARMONY, REASONING, FINAL, 1, False)
    assert parsed.has_final and parsed.has_reasoning


def test_harmony_decoded_without_special_tokens() -> None:
    parsed = parse_response(f"analysis{REASONING}assistantfinal{FINAL}")
    assert parsed.format is ResponseFormat.HARMONY_DECODED
    assert (parsed.reasoning, parsed.final, parsed.truncated) == (REASONING, FINAL, False)


def test_decoded_prompt_and_response_as_the_reference_recipe_sees_them() -> None:
    prompt = "systemYou are ChatGPT.userWhat is 2+3?"
    text = f"{prompt}assistantanalysis{REASONING}assistantfinal{FINAL}"
    parsed = parse_response(text)
    assert (parsed.reasoning, parsed.final) == (REASONING, FINAL)


def test_cut_off_by_the_token_limit_has_no_final() -> None:
    for text in (
        f"<|channel|>analysis<|message|>{REASONING} And then",
        f"analysis{REASONING} And then",
    ):
        parsed = parse_response(text)
        assert parsed.final is None and not parsed.has_final
        assert parsed.truncated
        assert parsed.reasoning == f"{REASONING} And then"


def test_final_message_without_end_token_is_truncated() -> None:
    parsed = parse_response(f"<|channel|>final<|message|>{FINAL} And more")
    assert parsed.final == f"{FINAL} And more"
    assert parsed.truncated
    assert parsed.reasoning is None


def test_several_analysis_blocks_are_joined() -> None:
    text = (
        "<|channel|>analysis<|message|>First thought.<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Second thought.<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>"
    )
    parsed = parse_response(text)
    assert parsed.reasoning == "First thought.\nSecond thought."
    assert parsed.analysis_blocks == 2
    decoded = parse_response(f"analysisFirst.assistantanalysisSecond.assistantfinal{FINAL}")
    assert (decoded.reasoning, decoded.analysis_blocks) == ("First.\nSecond.", 2)


def test_plain_text_is_the_answer_without_reasoning() -> None:
    parsed = parse_response("Just an answer. Analysis of the data shows nothing.")
    assert parsed.format is ResponseFormat.PLAIN
    assert parsed.reasoning is None
    assert parsed.final == "Just an answer. Analysis of the data shows nothing."


def test_a_plain_text_starting_with_the_word_analysis_is_plain() -> None:
    assert parse_response("analysis of the results").format is ResponseFormat.PLAIN


def test_empty_and_non_string_inputs() -> None:
    for value in (None, "", "   \n", 42, ["a"]):
        parsed = parse_response(value)
        assert parsed.format is ResponseFormat.EMPTY
        assert parsed.final is None and parsed.reasoning is None


def test_bytes_are_decoded_with_replacement() -> None:
    parsed = parse_response(b"\xff\xfeanalysisOk.assistantfinalYes.")
    assert parsed.final == "Yes."


def test_only_the_last_turn_of_a_transcript_counts() -> None:
    text = (
        "<|start|>system<|message|>You are ChatGPT.<|end|>"
        "<|start|>user<|message|>Q1<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Old answer.<|end|>"
        "<|start|>user<|message|>Q2<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>New thought.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>New answer.<|return|>"
    )
    parsed = parse_response(text)
    assert (parsed.reasoning, parsed.final) == ("New thought.", "New answer.")


def test_commentary_channel_and_header_options_are_handled() -> None:
    tool_call = parse_response(
        "<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{}<|call|>"
    )
    assert tool_call.final is None and tool_call.reasoning is None
    constrained = parse_response(
        '<|channel|>final <|constrain|>json<|message|>{"a": 1}<|return|><|endoftext|>'
    )
    assert constrained.final == '{"a": 1}' and not constrained.truncated


def test_stray_special_tokens_are_removed_from_parts() -> None:
    parsed = parse_response(f"analysis{REASONING}assistantfinal{FINAL}<|return|><|endoftext|>")
    assert parsed.final == FINAL


_plain_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<|>"), max_size=80
).filter(lambda t: "assistant" not in t and not t.lstrip().startswith(("analysis", "final")))


@given(reasoning=_plain_text, final=_plain_text)
def test_round_trip_through_both_harmony_forms(reasoning: str, final: str) -> None:
    tokens = (
        f"<|channel|>analysis<|message|>{reasoning}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{final}<|return|>"
    )
    parsed = parse_response(tokens)
    assert (parsed.reasoning, parsed.final) == (reasoning.strip(), final.strip())
    decoded = parse_response(f"assistantanalysis{reasoning}assistantfinal{final}")
    assert (decoded.reasoning, decoded.final) == (reasoning.strip(), final.strip())


@given(st.one_of(st.text(max_size=300), st.binary(max_size=300), st.none()))
def test_never_raises(value: str | bytes | None) -> None:
    parsed = parse_response(value)
    assert isinstance(parsed.format, ResponseFormat)
    assert parsed.analysis_blocks >= 0


@given(
    st.lists(
        st.sampled_from(
            [
                "<|channel|>",
                "<|message|>",
                "<|end|>",
                "<|start|>",
                "<|return|>",
                "analysis",
                "final",
                "assistant",
                "user",
                "text ",
            ]
        ),
        max_size=30,
    )
)
def test_never_raises_on_shuffled_markers(pieces: list[str]) -> None:
    parsed = parse_response("".join(pieces))
    assert parsed.final is None or "<|" not in parsed.final
