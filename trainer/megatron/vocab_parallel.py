"""Log-probs and entropies from logits split over tensor parallelism along the vocabulary:
computed from the shards with sums over the TP group and an analytic backward that needs no
communication (as Megatron's ``vocab_parallel_cross_entropy``); columns of Megatron's padded
vocabulary beyond the model's are masked out."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# --- log-probs from vocabulary-parallel logits ----------------------------------------------


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the (padded) vocabulary in the logits."""

    start: int = 0
    """Vocabulary id of the first logit column on this rank (``tp_rank × columns``)."""
    size: int | None = None
    """The model's own vocabulary size; columns at or past it (Megatron's padding) are
    masked. ``None``: no padding."""
    group: Any = None
    """The tensor-parallel process group; ``None``: the logits hold the whole vocabulary."""


def _sum_over(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(tensor, group=group)
    return tensor


class _VocabParallelLogProbs(torch.autograd.Function):
    """Log-probs and entropies from vocabulary shards, with the analytic gradient.

    ``z`` is the logits divided by the temperature ``T`` (not at all at 1). Forward:
    ``s = Σ_v e^{z_v − m}`` (``m`` the global max; local sums, then a sum over the
    group), ``log p(x) = z_x − m − log s``, ``H = log s − Σ_v p_v (z_v − m)``. Backward, per
    rank and without communication (the upstream gradients are the same on every rank: the
    loss after them is computed alike on each): ``∂ log p(x)/∂z_v = 1[v = x] − p_v`` and
    ``∂H/∂z_v = −p_v (z_v − m − Σ_u p_u (z_u − m))``. Autograd through the sums could not do
    this: ``p_v`` on one rank depends on every rank's shard through ``s``. The gradient to
    the logits is the gradient to ``z`` divided by ``T``.
    """

    @staticmethod
    def forward(ctx, logits, targets, start: int, size: int | None, group, temperature: float):
        import torch.distributed as dist

        dtype = logits.dtype
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        local = logits.shape[-1]
        padding = None
        if size is not None and start + local > size:
            padding = torch.arange(start, start + local, device=logits.device) >= size
        # padded columns: out of the max, and 0 in every later term (no infinities)
        visible = logits if padding is None else logits.masked_fill(padding, -math.inf)
        maximum = visible.amax(dim=-1)
        if group is not None:
            dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - maximum.unsqueeze(-1)
        if padding is not None:
            shifted = shifted.masked_fill(padding, 0.0)
        exp = shifted.exp()
        if padding is not None:
            exp = exp.masked_fill(padding, 0.0)
        total = _sum_over(exp.sum(-1), group)
        log_norm = total.log()
        local_target = targets - start
        inside = (local_target >= 0) & (local_target < local)
        local_target = local_target.clamp(0, local - 1)
        chosen = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * inside
        log_probs = _sum_over(chosen, group) - log_norm
        probs = exp / total.unsqueeze(-1)
        expected = _sum_over((probs * shifted).sum(-1), group)  # Σ_v p_v (z_v − m)
        ctx.save_for_backward(shifted, log_norm, expected, local_target, inside)
        ctx.padding = padding
        ctx.dtype = dtype
        ctx.temperature = temperature
        return log_probs, log_norm - expected

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        shifted, log_norm, expected, local_target, inside = ctx.saved_tensors
        probs = (shifted - log_norm.unsqueeze(-1)).exp()
        if ctx.padding is not None:
            probs = probs.masked_fill(ctx.padding, 0.0)
        grad = torch.zeros_like(shifted)
        if grad_log_probs is not None:
            grad -= probs * grad_log_probs.unsqueeze(-1)
            grad.scatter_add_(
                -1, local_target.unsqueeze(-1), (grad_log_probs * inside).unsqueeze(-1)
            )
        if grad_entropy is not None:
            grad -= grad_entropy.unsqueeze(-1) * probs * (shifted - expected.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad /= ctx.temperature
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    shard: VocabShard,
    with_entropy: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and entropies from this rank's vocabulary shard of ``logits``.

    ``log p(x) = z_x − log Σ_v e^{z_v}`` and ``H = log Σ_v e^{z_v} − Σ_v p_v z_v`` with
    ``z = logits / temperature`` (as ``algorithm.token_log_probs``), in float32, the sums over
    the vocabulary being local sums then a sum over the TP group; gradients to ``logits``
    (see ``_VocabParallelLogProbs``).

    Args:
        logits: ``[..., V_local]`` this rank's columns.
        targets: ``[...]`` vocabulary ids (any rank's).
        shard: where the columns sit, the model's vocabulary size, the TP group.
        with_entropy: also return the entropies.
        temperature: > 0; 1: the raw logits.

    Returns:
        ``([...], [...] | None)``: log-probs and entropies.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, targets, shard.start, shard.size, shard.group, temperature
    )
    return log_probs, entropy if with_entropy else None
