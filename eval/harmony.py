"""Render conversations in gpt-oss's harmony format, as text.

The rendering equals what ``openai-harmony`` produces for the same conversation
(``render_conversation_for_completion`` for the prompt, ``render_conversation_for_training``
with ``auto_drop_analysis=False`` for prompt + completion); a test checks it token for token.
We render text rather than token ids so that any tokenizer carrying the harmony special tokens
(gpt-oss's, or the tiny model's) can encode it.

Choices, kept as openai-harmony's defaults: the system message carries the model identity,
knowledge cutoff and ``Reasoning: medium``, and no current date (so the rendering is
deterministic; the Hugging Face chat template of gpt-oss adds today's date).
"""

from __future__ import annotations

from functools import lru_cache

START, END, MESSAGE, CHANNEL, RETURN = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
)
HARMONY_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<|constrain|>",
    "<|call|>",
    "<|startoftext|>",
    "<|endoftext|>",
)

SYSTEM_MESSAGE = (
    "You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\n"
    "Reasoning: {effort}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)


def developer_instructions(
    reasoning_language_name: str, developer: str, answer_language_name: str | None = None
) -> str:
    """The developer instructions of a prompt, in the dataset's convention.

    ``reasoning language: French`` first (as Multilingual-Thinking's system message does),
    then ``answer language: English`` when the answer must be in another language than the
    user wrote in, then the persona text.
    """
    lines = [f"reasoning language: {reasoning_language_name}"]
    if answer_language_name:
        lines.append(f"answer language: {answer_language_name}")
    return "\n".join(lines) + "\n\n" + developer


def render_prompt(instructions: str, user: str, reasoning_effort: str = "medium") -> str:
    """System, developer and user messages, ending where the assistant starts to write."""
    system = _system_message(reasoning_effort)
    return (
        f"{START}system{MESSAGE}{system}{END}"
        f"{START}developer{MESSAGE}# Instructions\n\n{instructions}{END}"
        f"{START}user{MESSAGE}{user}{END}"
        f"{START}assistant"
    )


@lru_cache(maxsize=8)
def _system_message(reasoning_effort: str) -> str:
    return SYSTEM_MESSAGE.format(effort=reasoning_effort)


def render_completion(analysis: str, final: str) -> str:
    """The assistant's turn after the prompt: the analysis channel, then the final channel."""
    return (
        f"{CHANNEL}analysis{MESSAGE}{analysis}{END}"
        f"{START}assistant{CHANNEL}final{MESSAGE}{final}{RETURN}"
    )
