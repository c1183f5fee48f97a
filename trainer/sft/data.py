"""SFT examples: tokenized harmony prompt + completion, loss only on the assistant's tokens.

``prompt`` (system, developer, user, up to ``<|start|>assistant``) is masked with -100;
``completion`` (``<|channel|>analysis…<|end|><|start|>assistant<|channel|>final…<|return|>``)
is learned. Both halves are tokenized separately: the completion starts with a special token,
so the concatenation is exactly the tokenization of the whole text.

Batches are length-bucketed: a seeded shuffle per epoch, then within windows of many
micro-batches the examples are sorted by length and cut into micro-batches, whose order is
shuffled again. Every rank computes the same order and takes its own share of each step.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.harmony import ForgedTurnError, check_rendered

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
BUCKET_WINDOW = 32
"""Micro-batches per sorting window of the length bucketing."""


class EmptyDatasetError(ValueError):
    """No usable example in a dataset file."""


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def target_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


@dataclass
class LoadStats:
    """What happened to the records of a file."""

    records: int = 0
    kept: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    dropped_prompt_too_long: int = 0
    prompt_only: int = 0
    """Prompt-only records (question sets, for GRPO): skipped, SFT needs an answer."""
    reasons: dict[str, int] = field(default_factory=dict)


def encode_record(record: dict, tokenizer) -> Example:
    """Token ids and labels of one data-prep record (see the module docstring).

    Raises:
        ForgedTurnError: the record's text holds a control token its structure does not (a
            row's text would be tokenized to a control id: a forged turn).
    """
    check_rendered(record["prompt"], record["completion"])
    prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
    completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
    return Example(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion)


def load_examples(
    path: str | Path, tokenizer, max_seq_len: int, overlong: str = "drop"
) -> tuple[list[Example], LoadStats]:
    """Encode every record of a data-prep JSONL file, applying the overlong policy.

    ``drop``: an example longer than ``max_seq_len`` is skipped; ``truncate``: its completion
    is cut to fit (examples whose prompt alone does not fit are dropped either way). Both are
    counted in the returned stats and logged, never silent.

    Raises:
        EmptyDatasetError: the file holds no usable example.
    """
    path = Path(path)
    stats = LoadStats()
    examples: list[Example] = []
    with path.open(encoding="utf-8-sig") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            stats.records += 1
            try:
                record = json.loads(line)
                if record.get("prompt_only"):  # a GRPO prompt from a question set: no answer
                    stats.prompt_only += 1
                    continue
                example = encode_record(record, tokenizer)
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{line_no}: not a data-prep record with 'prompt' and "
                    f"'completion' ({exc})"
                ) from exc
            except ForgedTurnError as exc:
                raise ForgedTurnError(f"{path}:{line_no}: {exc}") from None
            if len(example.input_ids) > max_seq_len:
                prompt_len = len(example.labels) - example.target_tokens
                if overlong == "drop":
                    stats.dropped_overlong += 1
                    continue
                if prompt_len >= max_seq_len - 1:
                    stats.dropped_prompt_too_long += 1
                    continue
                example = Example(example.input_ids[:max_seq_len], example.labels[:max_seq_len])
                stats.truncated += 1
            examples.append(example)
    stats.kept = len(examples)
    if stats.dropped_overlong or stats.truncated or stats.dropped_prompt_too_long:
        log.warning(
            "%s: %d of %d examples longer than max_seq_len=%d (%s): %d dropped, %d truncated, "
            "%d dropped (prompt alone too long)",
            path,
            stats.dropped_overlong + stats.truncated + stats.dropped_prompt_too_long,
            stats.records,
            max_seq_len,
            overlong,
            stats.dropped_overlong,
            stats.truncated,
            stats.dropped_prompt_too_long,
        )
    if not examples:
        raise EmptyDatasetError(
            f"{path}: no usable example ({stats.records} records, "
            f"{stats.dropped_overlong + stats.dropped_prompt_too_long} longer than "
            f"max_seq_len={max_seq_len})"
        )
    return examples, stats


def micro_batches(
    lengths: list[int], micro_batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Length-bucketed micro-batches of example indices, in a seeded order for ``epoch``."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = micro_batch_size * BUCKET_WINDOW
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        batches += [chunk[i : i + micro_batch_size] for i in range(0, len(chunk), micro_batch_size)]
    batches = [b for b in batches if len(b) == micro_batch_size]
    rng.shuffle(batches)
    return batches


def collate(examples: list[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: input_ids, attention_mask, labels (-100 on padding)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the positions whose label is not -100."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
