"""Per-token KL estimators to the reference policy (``KL_ESTIMATORS``) and the KL loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer.grpo.algorithm.aggregation import aggregate_loss
from trainer.grpo.algorithm.log_probs import LOG_RATIO_CLAMP
from trainer.grpo.algorithm.registry import lookup

K3_CLAMP = 10.0
"""The k3 estimate is clamped to ±this per token (as verl does)."""


def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k1: ``log p - log q`` (p = policy, q = reference); unbiased, high variance, signed."""
    return log_probs - ref_log_probs


def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k2: ``½ (log p - log q)²``; non-negative, low variance, biased."""
    return 0.5 * (log_probs - ref_log_probs) ** 2


def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k3 ("low_var_kl"): ``exp(δ) - δ - 1`` with ``δ = log q - log p``; unbiased, >= 0.

    ``δ`` is clamped to ±20 before ``exp`` and the result to [0, 10] (so its gradient is zero
    for tokens past the clamp), as verl does (its lower bound, -10, is never reached).
    """
    delta = (ref_log_probs - log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # expm1: exp(δ) - 1 - δ in two roundings could come out at -1e-16 for a tiny δ (hypothesis
    # found one); the lower clamp keeps the documented ≥ 0 exact
    return (torch.expm1(delta) - delta).clamp(0.0, K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
}


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy ‖ reference) from sampled-token log-probs.

    Args:
        log_probs: ``[..., T]`` policy log-probs of the sampled tokens.
        ref_log_probs: same shape, reference-model log-probs of the same tokens.
        kind: a name in ``KL_ESTIMATORS`` (``k1``, ``k2``, ``k3``/``low_var_kl``).

    Returns:
        Per-token estimates, same shape.

    Raises:
        ValueError: unknown kind or mismatched shapes.
    """
    estimator = get_kl_estimator(kind)
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} != ref_log_probs {tuple(ref_log_probs.shape)}"
        )
    return estimator(log_probs, ref_log_probs)


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kind: str,
    loss_agg_mode: str,
    *,
    norm_length: int | None = None,
    global_normalizer: float | Tensor | None = None,
) -> Tensor:
    """KL loss term: ``aggregate_loss(kl_penalty(log_probs, ref_log_probs, kind), mask)``.

    As a loss, prefer ``k3``/``low_var_kl`` or ``k2``: k1's gradient is zero in expectation
    over on-policy samples. The caller scales the term by its coefficient (β).

    Args:
        log_probs: ``[B, T]`` policy log-probs (with grad).
        ref_log_probs: ``[B, T]`` reference log-probs.
        response_mask: ``[B, T]`` 0/1 (or bool) mask of response tokens.
        kind: a name in ``KL_ESTIMATORS``.
        loss_agg_mode: a name in ``LOSS_AGG_MODES``.
        norm_length: passed to ``aggregate_loss``.
        global_normalizer: passed to ``aggregate_loss`` (gradient accumulation).

    Returns:
        A scalar tensor.
    """
    return aggregate_loss(
        kl_penalty(log_probs, ref_log_probs, kind),
        response_mask,
        loss_agg_mode,
        norm_length=norm_length,
        global_normalizer=global_normalizer,
    )


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The per-token KL estimator called ``name``; ValueError listing the valid names."""
    return lookup(KL_ESTIMATORS, name, "KL estimator")
