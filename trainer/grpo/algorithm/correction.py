"""Correcting for the gap between the engine that sampled and the trainer
(``ROLLOUT_CORRECTIONS``): importance ratios, truncated or masked, and their statistics."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from trainer.grpo.algorithm.aggregation import check_finite_tokens, masked_mean
from trainer.grpo.algorithm.log_probs import LOG_RATIO_CLAMP
from trainer.grpo.algorithm.registry import lookup


@dataclass(frozen=True)
class CorrectionBounds:
    """The bounds of the rollout corrections.

    Attributes:
        tis_cap: truncation ``C > 1`` of the importance weights (``token_tis``, ``seq_tis``).
        seq_mask_low: ``seq_mask`` keeps a sequence whose geometric-mean ratio is at least
            this (``0 < low <= 1``).
        seq_mask_high: … and at most this (``>= 1``).
    """

    tis_cap: float = 2.0
    seq_mask_low: float = 0.999
    seq_mask_high: float = 1.001

    def __post_init__(self) -> None:
        if not self.tis_cap > 1:
            raise ValueError(
                f"tis_cap (importance-weight truncation) must be > 1, got {self.tis_cap}"
            )
        if not 0 < self.seq_mask_low <= 1 <= self.seq_mask_high:
            raise ValueError(
                f"need 0 < seq_mask_low <= 1 <= seq_mask_high, got {self.seq_mask_low} and "
                f"{self.seq_mask_high}"
            )


class RolloutWeights(NamedTuple):
    """What a rollout correction makes of the log-ratio ``d = old − behaviour`` (``[B, T]``).

    ``weights`` multiply the per-token PPO loss (detached; 1 on tokens outside the mask);
    ``ratio`` is the untruncated importance ratio each token's weight comes from (its own,
    or its sequence's); ``truncated`` / ``masked`` flag the tokens whose weight was capped /
    whose sequence was masked out (weight 0).
    """

    weights: Tensor
    ratio: Tensor
    truncated: Tensor
    masked: Tensor


def _token_ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _no_flags(log_ratio: Tensor) -> Tensor:
    return torch.zeros_like(log_ratio, dtype=torch.bool)


def correction_none(log_ratio: Tensor, mask: Tensor, bounds: CorrectionBounds) -> RolloutWeights:
    """No correction: ``w = 1``. ``ratio`` is the per-token ``exp(d)``, for the statistics."""
    return RolloutWeights(
        torch.ones_like(log_ratio), _token_ratio(log_ratio), _no_flags(log_ratio), _no_flags(mask)
    )


def correction_token_tis(
    log_ratio: Tensor, mask: Tensor, bounds: CorrectionBounds
) -> RolloutWeights:
    """Token-level truncated importance sampling: ``w_t = min(exp(d_t), C)``."""
    ratio = _token_ratio(log_ratio)
    return RolloutWeights(
        ratio.clamp(max=bounds.tis_cap), ratio, mask & (ratio > bounds.tis_cap), _no_flags(mask)
    )


def correction_seq_tis(log_ratio: Tensor, mask: Tensor, bounds: CorrectionBounds) -> RolloutWeights:
    """Sequence-level truncated importance sampling: every token of sequence ``b`` gets
    ``w_b = min(exp(Σ_t m_bt · d_bt), C)``, the truncated ratio of the whole sequence's
    probabilities (the sum clamped to ±20 before ``exp``)."""
    total = (log_ratio * mask).sum(-1, keepdim=True)
    ratio = _token_ratio(total).expand_as(log_ratio)
    return RolloutWeights(
        ratio.clamp(max=bounds.tis_cap), ratio, mask & (ratio > bounds.tis_cap), _no_flags(mask)
    )


def correction_seq_mask(
    log_ratio: Tensor, mask: Tensor, bounds: CorrectionBounds
) -> RolloutWeights:
    """Sequence masking by the geometric-mean ratio ``g_b = exp(Σ_t m_bt·d_bt / Σ_t m_bt)``:
    ``w_b = 1`` if ``low <= g_b <= high`` else 0 (the sequence leaves the update; compared in
    log space)."""
    tokens = mask.sum(-1, keepdim=True)
    mean = (log_ratio * mask).sum(-1, keepdim=True) / tokens.clamp(min=1)
    inside = (mean >= math.log(bounds.seq_mask_low)) & (mean <= math.log(bounds.seq_mask_high))
    inside = inside.expand_as(log_ratio)
    return RolloutWeights(
        inside.to(log_ratio.dtype),
        _token_ratio(mean).expand_as(log_ratio),
        _no_flags(mask),
        mask & ~inside,
    )


ROLLOUT_CORRECTIONS: dict[str, Callable[[Tensor, Tensor, CorrectionBounds], RolloutWeights]] = {
    "none": correction_none,
    "token_tis": correction_token_tis,
    "seq_tis": correction_seq_tis,
    "seq_mask": correction_seq_mask,
}


def rollout_weights(
    old_log_probs: Tensor,
    behaviour_log_probs: Tensor,
    response_mask: Tensor,
    correction: str,
    bounds: CorrectionBounds = CorrectionBounds(),
) -> RolloutWeights:
    """The per-token weights of ``correction`` for the log-ratio
    ``d = old_log_probs − behaviour_log_probs`` (trainer over engine), over ``response_mask``.

    Tokens outside the mask get ``w = 1`` and no flag, whatever their log-probs hold.

    Raises:
        ValueError: unknown ``correction``, mismatched shapes, or (every correction but
            ``none``, whose weights are 1 whatever they hold) NaN/inf in either log-prob
            tensor on a masked-in token (the message names the ``[row, token]``).
    """
    fn = get_rollout_correction(correction)
    if not (old_log_probs.shape == behaviour_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"old_log_probs {tuple(old_log_probs.shape)}, behaviour_log_probs "
            f"{tuple(behaviour_log_probs.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must all be the same [B, T]"
        )
    counted = response_mask.bool()
    if fn is not correction_none:  # ``none`` weighs nothing by them (its ratio: statistics only)
        check_finite_tokens(old_log_probs, counted, "old_log_probs")
        check_finite_tokens(behaviour_log_probs, counted, "behaviour_log_probs")
    with torch.no_grad():
        log_ratio = torch.where(
            counted, old_log_probs - behaviour_log_probs, torch.zeros_like(old_log_probs)
        )
        out = fn(log_ratio, counted, bounds)
        ones = torch.ones_like(out.weights)
        return RolloutWeights(
            torch.where(counted, out.weights, ones),
            torch.where(counted, out.ratio, ones),
            out.truncated & counted,
            out.masked & counted,
        )


def correction_stats(corrected: RolloutWeights, response_mask: Tensor) -> dict[str, Tensor]:
    """Token means over ``response_mask`` of a correction's ratio and flags, and the largest
    ratio (all 0 when the mask is empty): ``importance_ratio_mean``, ``importance_ratio_max``,
    ``tis_clipped_fraction``, ``seq_masked_fraction``."""
    with torch.no_grad():
        ratio = corrected.ratio
        mask = response_mask.to(ratio.dtype)
        return {
            "importance_ratio_mean": masked_mean(ratio, mask),
            "importance_ratio_max": (ratio * mask).max() if ratio.numel() else ratio.new_zeros(()),
            "tis_clipped_fraction": masked_mean(corrected.truncated.to(mask.dtype), mask),
            "seq_masked_fraction": masked_mean(corrected.masked.to(mask.dtype), mask),
        }


def get_rollout_correction(
    name: str,
) -> Callable[[Tensor, Tensor, CorrectionBounds], RolloutWeights]:
    """The rollout correction called ``name``; ValueError listing the valid names."""
    return lookup(ROLLOUT_CORRECTIONS, name, "rollout correction")
