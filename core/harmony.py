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

import re
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

CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")
"""A harmony control token as text: ``HARMONY_SPECIAL_TOKENS`` and every other ``<|name|>``
the o200k_harmony tokenizer of gpt-oss holds as a special token (``<|reserved_200013|>``,
``<|endofprompt|>``…). Control tokens are never user text: a data row, a question or an
endpoint's reply that holds one is refused or neutralised (``neutralize_control_tokens``), so
that it cannot forge a turn when the prompt is rendered and tokenized, nor a channel when a
response is parsed."""

PROMPT_CONTROL_TOKENS: tuple[str, ...] = (START, MESSAGE, END) * 3 + (START,)
"""The control tokens of ``render_prompt``'s text, in order: system, developer, user, then
the assistant's ``<|start|>``."""
COMPLETION_CONTROL_TOKENS: tuple[str, ...] = (
    CHANNEL,
    MESSAGE,
    END,
    START,
    CHANNEL,
    MESSAGE,
    RETURN,
)
"""The control tokens of ``render_completion``'s text, in order."""


def find_control_token(text: str) -> re.Match | None:
    """The first harmony control token written in ``text`` (``<|end|>``…), or ``None``."""
    return CONTROL_TOKEN.search(text) if "<|" in text else None


def neutralize_control_tokens(text: str) -> str:
    """``text`` with every control token made inert and left readable: ``<|end|>`` →
    ``‹|end|›``, which neither the parser nor a tokenizer takes for the token."""
    if "<|" not in text:
        return text
    return CONTROL_TOKEN.sub(lambda m: "\u2039" + m.group()[1:-1] + "\u203a", text)


class ForgedTurnError(ValueError):
    """A rendered harmony text holds control tokens that its structure does not: text from a
    user, a data row or a question carried them."""


def check_rendered(prompt: str, completion: str | None = None) -> None:
    """Check that a rendered prompt (and completion) hold exactly the control tokens of
    ``render_prompt`` (and ``render_completion``): a token more means some text carried one,
    and tokenizing it would give that text a control id (a forged turn).

    Raises:
        ForgedTurnError: names the part and the first token out of place.
    """
    for part, text, expected in (
        ("prompt", prompt, PROMPT_CONTROL_TOKENS),
        ("completion", completion, COMPLETION_CONTROL_TOKENS),
    ):
        if text is None:
            continue
        found = CONTROL_TOKEN.findall(text)
        if tuple(found) != expected:
            at = next(
                (i for i, (a, b) in enumerate(zip(found, expected, strict=False)) if a != b),
                min(len(found), len(expected)),
            )
            token = found[at] if at < len(found) else "(end of text)"
            raise ForgedTurnError(
                f"the {part} holds {len(found)} control tokens where the harmony format has "
                f"{len(expected)} (token {at + 1}: {token}): text in it carries a control "
                "token; rerun data prep, which quarantines such rows"
            )


STOP_TOKENS: tuple[str, ...] = ("<|return|>", "<|call|>")
"""Tokens that end an assistant turn: ``<|return|>`` after the final answer, ``<|call|>``
after a tool call."""

SYSTEM_MESSAGE = (
    "You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\n"
    "Reasoning: {effort}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)


def task_instructions(reasoning_language_name: str, answer_language_name: str, persona: str) -> str:
    """The developer instructions of every lingo-rl prompt: data prep, GRPO rollouts, the eval.

    Both languages are always named, as the reference recipe's system prompt does
    (``reasoning language: French`` then ``answer language: French``), then the persona::

        reasoning language: French
        answer language: French

        You are a helpful assistant who solves word problems.

    One function for every path, so that the prompts a model is trained on are the prompts it
    is judged on (``tests/test_prompt_convention.py`` checks the three paths agree).
    """
    return (
        f"reasoning language: {reasoning_language_name}\n"
        f"answer language: {answer_language_name}\n\n{persona}"
    )


def task_prompt(
    reasoning_language_name: str,
    answer_language_name: str,
    persona: str,
    user: str,
    reasoning_effort: str = "medium",
) -> tuple[str, str]:
    """``(instructions, harmony prompt)`` of a question: :func:`task_instructions` rendered
    with :func:`render_prompt`."""
    instructions = task_instructions(reasoning_language_name, answer_language_name, persona)
    return instructions, render_prompt(instructions, user, reasoning_effort)


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


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The token ids that end a response: one convention for every engine (GRPO's rollouts
    and the eval's, Hugging Face and vLLM).

    Harmony's stop tokens the vocabulary has (``STOP_TOKENS``), the tokenizer's eos, and
    the eos ids of the model's generation config when given (gpt-oss-20b's:
    ``<|return|>``, ``<|endoftext|>``, ``<|call|>``), sorted. A response keeps its stop token.
    """
    vocab = tokenizer.get_vocab()
    stops = {vocab[t] for t in STOP_TOKENS if t in vocab}
    eos = [tokenizer.eos_token_id]
    if generation_config is not None:
        configured = generation_config.eos_token_id
        eos += configured if isinstance(configured, list) else [configured]
    stops.update(t for t in eos if t is not None)
    if not stops:
        raise ValueError(
            "the tokenizer has no stop token: neither harmony's "
            f"{' '.join(STOP_TOKENS)} nor an eos token"
        )
    return sorted(stops)
