"""GRPO prompts: the unique harmony prompts of a data-prep split, with their labels."""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from core.harmony import ForgedTurnError, check_rendered
from core.languages import UnknownLanguageError
from reward.labels import parse_labels

if TYPE_CHECKING:
    from trainer.grpo.config import GRPOConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """A prompt as token ids, with the label string its responses are judged against."""

    ids: list[int]
    label: str
    text: str
    weight: float = 1.0
    """How likely the prompt is drawn, relative to the others (a question set's ``weight``)."""


PromptFilter = Literal["all", "in-language"]


def load_prompts(
    path: str | Path, tokenizer, max_prompt_tokens: int, prompt_filter: PromptFilter = "all"
) -> list[Prompt]:
    """Unique prompts of a data-prep JSONL file (synthetic rows share their base's prompt).

    Prompts longer than ``max_prompt_tokens`` are dropped and counted in the log.
    ``prompt_filter="in-language"`` keeps only the prompts of the deployed task: a question
    written in the language it asks the reasoning and the answer in (``user_language`` =
    ``reasoning_language`` = ``answer_language``; question-set prompts always are).

    Raises:
        ValueError: no prompt fits, or a line is not a data-prep record.
        UnknownLanguageError: a label the reward cannot read (a ValueError; file and line).
    """
    path = Path(path)
    seen: set[str] = set()
    prompts: list[Prompt] = []
    too_long = filtered = 0
    for line_no, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text, label = record["prompt"], record["label"]
            weight = float(record.get("prompt_weight", 1.0))
            if prompt_filter == "in-language" and not in_language(record):
                filtered += 1
                continue
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{line_no}: not a data-prep record ({exc})") from exc
        try:  # here, not mid-training when the reward first reads it
            parse_labels(label)
        except UnknownLanguageError as exc:
            raise UnknownLanguageError(f"{path}:{line_no}: label {label!r}: {exc}") from exc
        try:  # a control token in a row's text would be tokenized to its id: a forged turn
            if "<|" in text:  # a rendered prompt has exactly the harmony prompt's tokens
                check_rendered(text)
        except ForgedTurnError as exc:
            raise ForgedTurnError(f"{path}:{line_no}: {exc}") from None
        if text in seen:
            continue
        seen.add(text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{path}:{line_no}: prompt_weight {weight} must be a positive number")
        prompts.append(Prompt(ids, label, text, weight))
    if too_long:
        log.warning(
            "%s: %d prompts longer than %d tokens dropped", path, too_long, max_prompt_tokens
        )
    if filtered:
        log.info("%s: %d rows left out by prompt_filter=%s", path, filtered, prompt_filter)
    if not prompts:
        raise ValueError(
            f"{path}: no prompt of at most {max_prompt_tokens} tokens "
            f"({too_long} longer ones dropped, {filtered} left out by prompt_filter="
            f"{prompt_filter}); raise rollout.max_prompt_tokens or widen prompt_filter"
        )
    return prompts


def in_language(record: dict) -> bool:
    """The question is written in the language the reasoning and the answer are asked in."""
    return record["user_language"] == record["reasoning_language"] == record["answer_language"]


def step_prompts(prompts: list[Prompt], step: int, per_step: int, seed: int) -> list[int]:
    """Indices of the ``per_step`` prompts of (0-based) ``step``: deterministic in
    ``(seed, step)``, so a resumed run draws what the uninterrupted one would have.

    * Equal weights (the usual case): epochs. Each epoch is a seeded shuffle of all prompts,
      walked ``per_step`` at a time, so every prompt is used once per epoch.
    * Unequal weights (question sets mixed in): each step draws ``per_step`` distinct prompts
      with probability proportional to their weights (weighted sampling without replacement,
      Efraimidis–Spirakis keys ``u ** (1 / w)``, the largest ``per_step`` win).
    """
    n = len(prompts)
    if len({p.weight for p in prompts}) <= 1:
        order = list(range(n))
        random.Random(f"{seed}:{step * per_step // n}").shuffle(order)
        first = (step * per_step) % n
        return [order[(first + i) % n] for i in range(per_step)]
    rng = random.Random(f"{seed}:weighted:{step}")
    keys = [rng.random() ** (1.0 / p.weight) for p in prompts]
    return sorted(range(n), key=keys.__getitem__, reverse=True)[:per_step]


def resample_prompts(
    prompts: list[Prompt], step: int, round_: int, per_step: int, seed: int
) -> list[int]:
    """Indices of the ``per_step`` fresh prompts of dynamic sampling's round ``round_`` (≥ 1)
    of ``step`` (``trainer.grpo.dynamic_sampling``): deterministic in ``(seed, step, round)``,
    so a resumed run draws what the uninterrupted one would have, and drawn beside the epoch
    schedule, not from it, so every step's own prompts (``step_prompts``) are the same with
    dynamic sampling on or off.

    Drawn with probability proportional to the prompts' weights, without replacement
    (Efraimidis–Spirakis keys, as ``step_prompts``' weighted case), from the prompts neither
    this step nor an earlier round of it used; when fewer than ``per_step`` of those remain,
    from those the step itself did not use; when fewer still, from all.

    Raises:
        ValueError: ``round_`` < 1 (round 0 is the step's own prompts).
    """
    if round_ < 1:
        raise ValueError(f"resample round {round_}: rounds count from 1 (0 is the step's own)")
    own = set(step_prompts(prompts, step, per_step, seed))
    used, drawn = set(own), []
    for current in range(1, round_ + 1):  # the earlier rounds' draws, then this one
        pool = [i for i in range(len(prompts)) if i not in used]
        if len(pool) < per_step:
            pool = [i for i in range(len(prompts)) if i not in own]
        if len(pool) < per_step:
            pool = list(range(len(prompts)))
        rng = random.Random(f"{seed}:resample:{step}:{current}")
        keys = {i: rng.random() ** (1.0 / prompts[i].weight) for i in pool}
        drawn = sorted(pool, key=keys.__getitem__, reverse=True)[:per_step]
        used.update(drawn)
    return drawn


def load_prompt_sets(
    cfg: GRPOConfig, tokenizer, train_path: str | Path, eval_path: str | Path
) -> tuple[list[Prompt], list[Prompt]]:
    """A GRPO run's training prompts and its first ``eval_prompts`` held-out prompts
    (``load_prompts`` with the config's token limit and filter).

    Raises:
        ValueError: fewer unique training prompts than ``prompts_per_step``.
    """
    limit, kept = cfg.rollout.max_prompt_tokens, cfg.prompt_filter
    train_prompts = load_prompts(train_path, tokenizer, limit, kept)
    eval_prompts = load_prompts(eval_path, tokenizer, limit, kept)[: cfg.eval_prompts]
    if len(train_prompts) < cfg.prompts_per_step:
        raise ValueError(
            f"{train_path}: {len(train_prompts)} unique prompts, fewer than prompts_per_step "
            f"{cfg.prompts_per_step}"
        )
    return train_prompts, eval_prompts
