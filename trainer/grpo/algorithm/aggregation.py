"""How the per-token losses of a mini-batch become one number (``LOSS_AGG_MODES``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from trainer.grpo.algorithm.registry import lookup


class LossAggregation(NamedTuple):
    """How a ``[B, T]`` loss matrix becomes a scalar: ``total(...) / count(mask)``.

    ``total(masked_loss, mask, norm_length)`` is additive over sequences, so splitting a
    mini-batch into micro-batches and dividing each micro-batch total by the whole
    mini-batch's ``count`` makes the micro-batch losses sum to the mini-batch loss.
    """

    total: Callable[[Tensor, Tensor, int], Tensor]
    count: Callable[[Tensor], Tensor]


def _sum_total(masked: Tensor, mask: Tensor, norm_length: int) -> Tensor:
    return masked.sum()


def _seq_token_mean_total(masked: Tensor, mask: Tensor, norm_length: int) -> Tensor:
    tokens = mask.sum(-1)
    return (masked.sum(-1) / torch.where(tokens > 0, tokens, torch.ones_like(tokens))).sum()


def _sum_norm_total(masked: Tensor, mask: Tensor, norm_length: int) -> Tensor:
    return masked.sum() / norm_length


def _token_count(mask: Tensor) -> Tensor:
    return mask.sum()


def _nonempty_sequence_count(mask: Tensor) -> Tensor:
    return (mask.sum(-1) > 0).sum().to(mask.dtype)


def _sequence_count(mask: Tensor) -> Tensor:
    return torch.tensor(float(mask.shape[0]), dtype=mask.dtype, device=mask.device)


LOSS_AGG_MODES: dict[str, LossAggregation] = {
    "token-mean": LossAggregation(_sum_total, _token_count),
    "seq-mean-token-mean": LossAggregation(_seq_token_mean_total, _nonempty_sequence_count),
    "seq-mean-token-sum": LossAggregation(_sum_total, _nonempty_sequence_count),
    "seq-mean-token-sum-norm": LossAggregation(_sum_norm_total, _sequence_count),
}


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    norm_length: int | None = None,
    global_normalizer: float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss matrix to a scalar.

    With ``l`` the loss, ``m`` the mask, ``n_b = Σ_t m_bt`` and ``N`` the normalizer:

    - ``token-mean``: ``Σ l·m / N``, ``N = Σ m`` (tokens).
    - ``seq-mean-token-mean``: ``Σ_b (Σ_t l·m / n_b) / N``, ``N`` = sequences with ``n_b > 0``.
    - ``seq-mean-token-sum``: ``Σ_b Σ_t l·m / N``, ``N`` = sequences with ``n_b > 0``.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): ``Σ l·m / (N · norm_length)``, ``N = B`` (all
      rows) and ``norm_length = T`` unless given: a constant, length-unbiased denominator.

    Gradient accumulation: pass ``global_normalizer=get_loss_agg_mode(mode).count(mask)`` of
    the whole mini-batch (and the same ``norm_length``) to every micro-batch; the micro-batch
    losses then sum exactly to the mini-batch loss. Under data parallelism with gradient
    averaging, pass the all-reduced count divided by the world size.
    A batch with no masked-in tokens gives 0 (not NaN) when the normalizer is the default.

    Args:
        loss_mat: ``[B, T]`` per-token losses.
        mask: ``[B, T]`` 0/1 (or bool) mask of tokens that count.
        mode: a name in ``LOSS_AGG_MODES``.
        norm_length: ``seq-mean-token-sum-norm`` only: the constant length; default ``T``.
        global_normalizer: replaces ``N`` (see above); must be positive.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: unknown mode, mismatched shapes, or a non-positive normalizer/length.
    """
    aggregation = get_loss_agg_mode(mode)
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    if norm_length is not None and norm_length < 1:
        raise ValueError(f"norm_length must be a positive int, got {norm_length}")
    if isinstance(global_normalizer, int | float) and not global_normalizer > 0:
        raise ValueError(f"global_normalizer must be positive, got {global_normalizer}")
    mask = mask.to(loss_mat.dtype)
    total = aggregation.total(loss_mat * mask, mask, norm_length or loss_mat.shape[-1])
    if global_normalizer is not None:
        return total / global_normalizer
    count = aggregation.count(mask)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    count = mask.sum()
    return (values * mask).sum() / torch.where(count > 0, count, torch.ones_like(count))


def get_loss_agg_mode(name: str) -> LossAggregation:
    """The loss aggregation called ``name``; ValueError listing the valid names."""
    return lookup(LOSS_AGG_MODES, name, "loss aggregation mode")


def check_finite_tokens(values: Tensor, counted: Tensor, name: str) -> None:
    bad = counted & ~torch.isfinite(values)
    if bool(bad.any()):
        positions = bad.nonzero().tolist()
        shown = ", ".join(str(p) for p in positions[:20])
        more = f" and {len(positions) - 20} more" if len(positions) > 20 else ""
        raise ValueError(
            f"{name} are NaN or infinite at [row, token] {shown}{more} (masked-in tokens); "
            "fix the engine or trainer that scored them, or mask those tokens out"
        )
