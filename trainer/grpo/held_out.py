"""GRPO's held-out eval and the guard on it: the policy's metrics on the held-out prompts,
whether it may be kept as the best (its text stays real, its reasoning does not collapse, it
does not loop), and what a run does when it collapses or loops."""

from __future__ import annotations

import logging
import math

from core.seeds import group_seeds
from reward.degeneracy import measure_degeneracy
from reward.outcome import HeldOutResult, Outcome
from trainer.grpo.config import GRPOConfig
from trainer.grpo.prompts import Prompt
from trainer.grpo.update import decode

log = logging.getLogger(__name__)


def evaluate_policy(
    engine, tokenizer, prompts: list[Prompt], scorer, samples: int, seed: int
) -> HeldOutResult:
    """Held-out metrics: mean reward, language accuracies, and text degeneracy.

    Every evaluation draws the same seeds (common random numbers: policies are compared on
    the same draws), one per (held-out prompt, sample).
    """
    seeds = group_seeds(seed, "held-out", range(len(prompts)), samples)
    rollouts = engine.generate([p.ids for p in prompts], seeds)
    texts = [decode(tokenizer, r.response_ids) for r in rollouts]
    asked = [prompts[r.prompt_index] for r in rollouts]
    results = scorer.score_batch(texts, [p.label for p in asked], prompts=[p.text for p in asked])
    outcomes = []
    for result in results:  # per language of the prompt: its reasoning label
        language = result.labels.answer if result.labels else "en"
        measured = measure_degeneracy(result.parsed.reasoning, result.parsed.final, language)
        reasoning = result.labels.reasoning if result.labels else None
        outcomes.append(Outcome.scored(reasoning, result, measured))
    return HeldOutResult.from_outcomes(outcomes, [r.finished for r in rollouts])


def better(
    cfg: GRPOConfig, held_out: HeldOutResult, baseline: HeldOutResult, best: HeldOutResult
) -> bool:
    """A held-out result beats the best so far without its text degenerating or its reasoning
    collapsing (the guard)."""
    floor = (1.0 - cfg.guard.max_real_word_drop) * baseline.real_word_share
    collapsed = reasoning_collapsed(cfg, held_out.reasoning_length_ratios(baseline))
    return (
        held_out.real_word_share >= floor
        and not collapsed
        and not looping(cfg, held_out)
        and held_out.mean_reward > best.mean_reward
    )


def looping(cfg: GRPOConfig, held_out: HeldOutResult) -> dict[str, float]:
    """The held-out loop rates above ``guard.max_loop_rate`` (``loop_rate`` overall,
    ``loop_rate_<language>`` per language); empty when none is."""
    rates = {"loop_rate": held_out.loop_rate} | {
        f"loop_rate_{language}": result.loop_rate
        for language, result in held_out.per_language.items()
    }
    return {k: round(v, 3) for k, v in rates.items() if v > cfg.guard.max_loop_rate}


class ReasoningCollapsedError(RuntimeError):
    """The held-out reasoning shrank below ``guard.min_reasoning_length_ratio`` of the SFT
    model's, and ``guard.reasoning_collapse`` is ``stop``."""


def reasoning_collapsed(cfg: GRPOConfig, ratios: dict[str, float]) -> bool:
    """Whether the held-out reasoning collapsed: overall or in a language, the median
    reasoning length fell below ``guard.min_reasoning_length_ratio`` of the SFT model's
    (``HeldOutResult.reasoning_length_ratios``; NaN ratios, where the SFT model did not
    reason, are not judged)."""
    floor = cfg.guard.min_reasoning_length_ratio
    return any(ratio < floor for ratio in ratios.values() if not math.isnan(ratio))


def on_collapse(cfg: GRPOConfig, ratios: dict[str, float], step: int) -> None:
    """Flag (a warning; the policy is not kept as the best) or stop the run."""
    low = {k: round(v, 3) for k, v in ratios.items() if v < cfg.guard.min_reasoning_length_ratio}
    message = (
        f"step {step}: the held-out reasoning collapsed below "
        f"guard.min_reasoning_length_ratio={cfg.guard.min_reasoning_length_ratio} of the SFT "
        f"model's median length: {low}"
    )
    if cfg.guard.stops_on_collapse:
        raise ReasoningCollapsedError(message + " (guard.reasoning_collapse=stop)")
    log.warning("%s; this policy is not kept as the best", message)


def held_out_line(cfg: GRPOConfig, held_out: HeldOutResult, baseline: HeldOutResult) -> dict:
    """What a held-out eval adds to its step's metrics line: ``eval_<metric>`` for the held-out
    metrics and the reasoning length ratios against ``baseline`` (the SFT model's), and the
    guard's flags ``eval_reasoning_collapsed`` and ``eval_looping`` (1.0 or 0.0)."""
    ratios = held_out.reasoning_length_ratios(baseline)
    return {f"eval_{k}": v for k, v in (held_out.metrics() | ratios).items()} | {
        "eval_reasoning_collapsed": float(reasoning_collapsed(cfg, ratios)),
        "eval_looping": float(bool(looping(cfg, held_out))),
    }


def on_guard_flags(
    cfg: GRPOConfig, held_out: HeldOutResult, baseline: HeldOutResult, step: int
) -> None:
    """After the line is logged: a collapse is flagged or stops the run (``on_collapse``), a
    loop rate above ``guard.max_loop_rate`` is a warning (the policy is not kept either way:
    ``better``)."""
    ratios = held_out.reasoning_length_ratios(baseline)
    if reasoning_collapsed(cfg, ratios):
        on_collapse(cfg, ratios, step)
    loops = looping(cfg, held_out)
    if loops:
        log.warning(
            "step %d: the held-out loop rate is above guard.max_loop_rate=%s: %s; "
            "this policy is not kept as the best",
            step,
            cfg.guard.max_loop_rate,
            loops,
        )
