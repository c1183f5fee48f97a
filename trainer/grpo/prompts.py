"""GRPO prompts: the unique harmony prompts of a data-prep split, with their labels."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """A prompt as token ids, with the label string its responses are judged against."""

    ids: list[int]
    label: str
    text: str


def load_prompts(path: str | Path, tokenizer, max_prompt_tokens: int) -> list[Prompt]:
    """Unique prompts of a data-prep JSONL file (synthetic rows share their base's prompt).

    Prompts longer than ``max_prompt_tokens`` are dropped and counted in the log.

    Raises:
        ValueError: no prompt fits, or a line is not a data-prep record.
    """
    path = Path(path)
    seen: set[str] = set()
    prompts: list[Prompt] = []
    too_long = 0
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text, label = record["prompt"], record["label"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{path}:{line_no}: not a data-prep record ({exc})") from exc
        if text in seen:
            continue
        seen.add(text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(Prompt(ids, label, text))
    if too_long:
        log.warning(
            "%s: %d prompts longer than %d tokens dropped", path, too_long, max_prompt_tokens
        )
    if not prompts:
        raise ValueError(
            f"{path}: no prompt of at most {max_prompt_tokens} tokens "
            f"({too_long} longer ones dropped); raise rollout.max_prompt_tokens"
        )
    return prompts
