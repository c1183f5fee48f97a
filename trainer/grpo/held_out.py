"""GRPO's held-out eval and the guard on it: the policy's metrics on the held-out prompts,
whether it may be kept as the best (its text stays real, its reasoning does not collapse, it
does not loop), and what a run does when it collapses or loops."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class GuardVerdict:
    """The guard's judgement of one held-out result against the SFT model's (``judge``)."""

    ratios: dict[str, float]
    """``HeldOutResult.reasoning_length_ratios`` against the SFT model's."""
    real_text: bool
    """The real-word share stayed within ``guard.max_real_word_drop`` of the SFT model's."""
    collapsed: bool
    """``reasoning_collapsed``: the reasoning shrank below ``guard.min_reasoning_length_ratio``."""
    loops: dict[str, float]
    """``looping``: the loop rates above ``guard.max_loop_rate`` (empty: none)."""

    @property
    def keepable(self) -> bool:
        """Whether the policy may be kept as the best: its text stays real, its reasoning does
        not collapse, it does not loop."""
        return self.real_text and not self.collapsed and not self.loops


def judge(cfg: GRPOConfig, held_out: HeldOutResult, baseline: HeldOutResult) -> GuardVerdict:
    """The guard's verdict on ``held_out`` against ``baseline`` (the SFT model's result)."""
    ratios = held_out.reasoning_length_ratios(baseline)
    floor = (1.0 - cfg.guard.max_real_word_drop) * baseline.real_word_share
    return GuardVerdict(
        ratios=ratios,
        real_text=held_out.real_word_share >= floor,
        collapsed=reasoning_collapsed(cfg, ratios),
        loops=looping(cfg, held_out),
    )


def better(held_out: HeldOutResult, best: HeldOutResult, verdict: GuardVerdict) -> bool:
    """A held-out result beats the best so far and the guard's ``verdict`` keeps it."""
    return verdict.keepable and held_out.mean_reward > best.mean_reward


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


def held_out_line(held_out: HeldOutResult, verdict: GuardVerdict) -> dict:
    """What a held-out eval adds to its step's metrics line: ``eval_<metric>`` for the held-out
    metrics and the reasoning length ratios, and the guard's flags
    ``eval_reasoning_collapsed`` and ``eval_looping`` (1.0 or 0.0)."""
    return {f"eval_{k}": v for k, v in (held_out.metrics() | verdict.ratios).items()} | {
        "eval_reasoning_collapsed": float(verdict.collapsed),
        "eval_looping": float(bool(verdict.loops)),
    }


def on_guard_flags(cfg: GRPOConfig, verdict: GuardVerdict, step: int) -> None:
    """After the line is logged: a collapse is flagged or stops the run (``on_collapse``), a
    loop rate above ``guard.max_loop_rate`` is a warning (the policy is not kept either way:
    ``GuardVerdict.keepable``)."""
    if verdict.collapsed:
        on_collapse(cfg, verdict.ratios, step)
    if verdict.loops:
        log.warning(
            "step %d: the held-out loop rate is above guard.max_loop_rate=%s: %s; "
            "this policy is not kept as the best",
            step,
            cfg.guard.max_loop_rate,
            verdict.loops,
        )
