"""Split a gpt-oss response into its reasoning (``analysis`` channel) and final answer.

Handles the forms a response reaches the reward in:

* **harmony with special tokens** (``skip_special_tokens=False``)::

      <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>

* **harmony decoded with special tokens skipped**: the markers vanish and the role and
  channel names are glued to the text: ``analysis…assistantfinal…`` (a response decoded on its
  own starts with the bare channel name; a prompt+response decode has ``assistantanalysis``);
* **cut off by the token limit**: an analysis channel and no final channel (``truncated``);
* **several analysis blocks**: their texts are joined with a newline;
* **plain text** with no channel at all: the whole text is the answer and there is no
  reasoning.

When the text holds several turns (a full prompt+response transcript), only the last turn
counts: the last final block and the analysis blocks after the final block before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

_SPECIAL_TOKEN = re.compile(r"<\|[a-z_]+\|>")
_TOKEN_SPLIT = re.compile(r"(<\|[a-z_]+\|>)")
# Tokens that close the body of a message.
_TERMINATORS = frozenset(
    {"<|end|>", "<|return|>", "<|call|>", "<|start|>", "<|channel|>", "<|endoftext|>"}
)
_PROMPT_ROLES = ("system", "developer", "user")

# Decoded form: "assistant" + channel name glued together; at the very start of a response
# decoded on its own, the bare channel name glued to text that does not continue a word.
_DECODED_CHANNELS = ("analysis", "final", "commentary")
_DECODED_START = re.compile(r"\s*(analysis|final)(?![a-z ])")
_ROLE = "assistant"


class ResponseFormat(StrEnum):
    """How the response was written."""

    HARMONY = "harmony"
    """Harmony with its special tokens."""
    HARMONY_DECODED = "harmony_decoded"
    """Harmony decoded with special tokens skipped (``analysis…assistantfinal…``)."""
    PLAIN = "plain"
    """No channel markers: the whole text is the answer."""
    EMPTY = "empty"
    """``None``, not a string, or only whitespace."""


@dataclass(frozen=True)
class ParsedResponse:
    """What was found in a response.

    Attributes:
        format: The form the response was written in.
        reasoning: Text of the analysis blocks joined by newlines; ``None`` when there is none.
        final: Text of the final answer; ``None`` when there is no final channel.
        analysis_blocks: Number of analysis blocks in the scored turn.
        truncated: Generation stopped before the answer was finished: an analysis channel
            with no final channel, or (special-token form) a final message with no end token.
    """

    format: ResponseFormat
    reasoning: str | None
    final: str | None
    analysis_blocks: int = 0
    truncated: bool = False

    @property
    def has_final(self) -> bool:
        """True when a final answer with some non-space text was found."""
        return self.final is not None and bool(self.final.strip())

    @property
    def has_reasoning(self) -> bool:
        """True when reasoning with some non-space text was found."""
        return self.reasoning is not None and bool(self.reasoning.strip())


@dataclass
class _Block:
    channel: str
    text: str
    closed: bool


def _clean(text: str) -> str:
    if "<|" in text:
        text = _SPECIAL_TOKEN.sub("", text)
    return text.strip()


def _token_blocks(text: str) -> list[_Block]:
    """Blocks of an assistant turn in special-token form, prompt messages left out."""
    pieces = _TOKEN_SPLIT.split(text)
    blocks: list[_Block] = []
    role = "assistant"  # a bare response starts inside the assistant turn
    i = 0
    while i < len(pieces):
        piece = pieces[i]
        if piece == "<|start|>" and i + 1 < len(pieces):
            header = pieces[i + 1].strip()
            role = header.split()[0] if header else "assistant"
            i += 2
            continue
        if piece == "<|channel|>" or (piece == "<|message|>" and role == "assistant"):
            channel = "final"  # an assistant message without a channel is read as the answer
            if piece == "<|channel|>":
                header_parts: list[str] = []
                i += 1
                while i < len(pieces) and pieces[i] != "<|message|>":
                    header_parts.append(pieces[i])
                    i += 1
                header = _clean("".join(header_parts))
                channel = header.split()[0] if header else ""
            # pieces[i] is "<|message|>" (or we ran off the end)
            i += 1
            body: list[str] = []
            closed = False
            while i < len(pieces):
                if pieces[i] in _TERMINATORS:
                    closed = True
                    break
                body.append(pieces[i])
                i += 1
            if role not in _PROMPT_ROLES:
                blocks.append(_Block(channel, _clean("".join(body)), closed))
            continue
        i += 1
    return blocks


def _decoded_markers(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, channel)`` of each channel marker in a decoded response."""
    markers: list[tuple[int, int, str]] = []
    start = _DECODED_START.match(text)
    if start is not None:
        markers.append((start.start(1), start.end(), start.group(1)))
    position = text.find(_ROLE)
    while position != -1:
        after = position + len(_ROLE)
        for channel in _DECODED_CHANNELS:
            if text.startswith(channel, after):
                markers.append((position, after + len(channel), channel))
                break
        position = text.find(_ROLE, after)
    return markers


def _decoded_blocks(text: str) -> list[_Block]:
    markers = _decoded_markers(text)
    blocks: list[_Block] = []
    for index, (_, body_start, channel) in enumerate(markers):
        end = markers[index + 1][0] if index + 1 < len(markers) else len(text)
        blocks.append(_Block(channel, _clean(text[body_start:end]), closed=False))
    return blocks


def _last_turn(blocks: list[_Block]) -> tuple[list[_Block], _Block | None]:
    """Analysis blocks and final block of the last turn."""
    final_positions = [i for i, b in enumerate(blocks) if b.channel == "final"]
    if final_positions:
        last = final_positions[-1]
        previous = final_positions[-2] if len(final_positions) > 1 else -1
        turn = blocks[previous + 1 : last]
        final: _Block | None = blocks[last]
    else:
        turn, final = blocks, None
    return [b for b in turn if b.channel == "analysis"], final


def _result(fmt: ResponseFormat, blocks: list[_Block], *, check_closed: bool) -> ParsedResponse:
    analysis, final = _last_turn(blocks)
    reasoning = "\n".join(b.text for b in analysis) if analysis else None
    truncated = final is None and bool(analysis)
    if final is not None and check_closed and not final.closed:
        truncated = True
    return ParsedResponse(
        format=fmt,
        reasoning=reasoning,
        final=final.text if final is not None else None,
        analysis_blocks=len(analysis),
        truncated=truncated,
    )


def parse_response(response: object) -> ParsedResponse:
    """Parse a model response into reasoning and final answer.

    Never raises: ``None``, non-strings and blank text give a ``ParsedResponse`` with format
    ``EMPTY``; ``bytes`` are decoded as UTF-8 with replacement characters.

    Args:
        response: The generated text (with or without the prompt in front).

    Returns:
        The parts found and how the text was written.
    """
    if isinstance(response, bytes | bytearray):
        response = bytes(response).decode("utf-8", errors="replace")
    if not isinstance(response, str) or not response.strip():
        return ParsedResponse(ResponseFormat.EMPTY, None, None)
    if "<|channel|>" in response or "<|message|>" in response:
        blocks = _token_blocks(response)
        if blocks:
            return _result(ResponseFormat.HARMONY, blocks, check_closed=True)
    blocks = _decoded_blocks(response)
    if blocks:
        return _result(ResponseFormat.HARMONY_DECODED, blocks, check_closed=False)
    return ParsedResponse(ResponseFormat.PLAIN, reasoning=None, final=_clean(response))
