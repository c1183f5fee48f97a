"""The policy losses (``POLICY_LOSSES``), each ``loss(PolicyLossInputs,
PolicyLossSettings) -> (loss, stats)``: PPO-clip, the decoupled loss, GSPO."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from trainer.grpo.algorithm.aggregation import aggregate_loss, masked_mean
from trainer.grpo.algorithm.correction import CorrectionBounds, correction_stats, rollout_weights
from trainer.grpo.algorithm.log_probs import LOG_RATIO_CLAMP
from trainer.grpo.algorithm.registry import lookup


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    global_normalizer: float | Tensor | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric ("clip-higher") and dual clipping.

    Per token, with ``r = exp(log_probs - old_log_probs)`` (log-ratio clamped to ±20) and
    ``clip(r) = clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)``::

        l = max(-A·r, -A·clip(r))            if A >= 0
        l = min(max(-A·r, -A·clip(r)), -A·c)  if A < 0   (dual clip, c = clip_ratio_c)

    then ``w·l`` is reduced with ``aggregate_loss(w·l, response_mask, loss_agg_mode, ...)``
    (``w = token_weights``, 1 when None). The gradient is zero wherever a clipped branch or
    the dual bound is active.

    Args:
        log_probs: ``[B, T]`` current-policy log-probs of the sampled tokens (with grad).
        old_log_probs: ``[B, T]`` log-probs under the policy that sampled them.
        advantages: ``[B]`` (broadcast over tokens) or ``[B, T]``.
        response_mask: ``[B, T]`` 0/1 (or bool) mask of response tokens.
        clip_ratio_low: lower clip ``ε_low``, in ``[0, 1)``.
        clip_ratio_high: upper clip ``ε_high``, ``>= 0`` (clip-higher: > ``ε_low``).
        clip_ratio_c: dual-clip bound ``c > 1``.
        loss_agg_mode: a name in ``LOSS_AGG_MODES``.
        norm_length: passed to ``aggregate_loss``.
        global_normalizer: passed to ``aggregate_loss`` (gradient accumulation).
        token_weights: ``[B, T]`` detached per-token weights ``w`` (a rollout correction's,
            ``decoupled_policy_loss``), or None.

    Returns:
        ``(loss, stats)``; ``stats`` holds detached scalars over masked tokens:
        ``clip_fraction`` (share where ``-A·clip(r) > -A·r``), ``dual_clip_fraction`` (share
        where ``A < 0`` and the ``-A·c`` bound is active), ``approx_kl`` (mean of
        ``old_log_probs - log_probs``, the k1 estimate of KL(old‖new) under old samples),
        ``ratio_mean`` and ``ratio_max`` (0 when the mask is empty).

    Raises:
        ValueError: mismatched shapes, out-of-range clip values, or unknown mode.
    """
    loss_mat, stats = _clipped_surrogate(
        log_probs,
        old_log_probs,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    if token_weights is not None:
        loss_mat = token_weights.to(loss_mat.dtype) * loss_mat
    loss = aggregate_loss(
        loss_mat,
        response_mask,
        loss_agg_mode,
        norm_length=norm_length,
        global_normalizer=global_normalizer,
    )
    return loss, stats


def decoupled_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    behaviour_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    correction: str = "token_tis",
    tis_cap: float = 2.0,
    seq_mask_low: float = CorrectionBounds.seq_mask_low,
    seq_mask_high: float = CorrectionBounds.seq_mask_high,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    global_normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO with a rollout correction, for rollouts the trainer did not sample.

    Three policies: the behaviour policy ``μ`` that sampled the tokens (the rollout engine:
    other kernels, another precision, possibly a step behind), the proximal policy
    ``π_prox`` whose log-probs the trainer computes before the update (``old_log_probs``),
    and the current policy ``π_θ``. PPO clipping is against ``π_prox``; the behaviour gap
    ``d = log π_prox − log μ`` (per token) is corrected by detached weights ``w``
    (``rollout_weights``, registry ``ROLLOUT_CORRECTIONS``)::

        none        w = 1
        token_tis   w_t = min(exp(d_t), C)                              (C = tis_cap)
        seq_tis     w_b = min(exp(Σ_t d_bt), C)                          every token of row b
        seq_mask    w_b = 1 if low <= exp(mean_t d_bt) <= high else 0    every token of row b
        l = w · l_ppo

    with ``l_ppo`` the clipped, dual-clipped term of ``policy_loss`` (ratio
    ``r = π_θ / π_prox``), reduced with ``aggregate_loss(l, response_mask, ...)``: a masked
    sequence adds 0 to the numerator and still counts in the normalizer (as TRL's
    ``sequence_mask``). Log-ratios are clamped to ±20 before ``exp``. So
    ``∂l/∂log_probs = w · ∂l_ppo/∂log_probs``: ``-w·A·r`` where the unclipped branch is
    active, 0 where a clip or the dual bound is. With ``behaviour_log_probs == old_log_probs``
    every correction gives ``w = 1`` and this is ``policy_loss``. Masked-out tokens get
    ``w = 1`` whatever their behaviour log-probs hold (padding).

    Args:
        log_probs: ``[B, T]`` current-policy log-probs of the sampled tokens (with grad).
        old_log_probs: ``[B, T]`` proximal-policy log-probs (the trainer's, before the
            update).
        behaviour_log_probs: ``[B, T]`` log-probs the sampling policy gave the same tokens
            (recorded by the engine, or recomputed with the stale weights).
        advantages: ``[B]`` (broadcast over tokens) or ``[B, T]``.
        response_mask: ``[B, T]`` 0/1 (or bool) mask of response tokens.
        correction: a name in ``ROLLOUT_CORRECTIONS``.
        tis_cap: truncation ``C > 1`` of the importance weight.
        seq_mask_low: ``seq_mask``'s lower bound on the geometric-mean ratio.
        seq_mask_high: ``seq_mask``'s upper bound.
        clip_ratio_low: as ``policy_loss``.
        clip_ratio_high: as ``policy_loss``.
        clip_ratio_c: as ``policy_loss``.
        loss_agg_mode: a name in ``LOSS_AGG_MODES``.
        norm_length: passed to ``aggregate_loss``.
        global_normalizer: passed to ``aggregate_loss`` (gradient accumulation).

    Returns:
        ``(loss, stats)``: the ``policy_loss`` stats (of ``r = π_θ / π_prox``) plus, over
        masked tokens, ``importance_ratio_mean`` and ``importance_ratio_max`` of the
        untruncated ratio each weight comes from (the token's; the sequence's for the
        sequence-level corrections), ``tis_clipped_fraction``, the share of tokens whose
        weight was truncated, and ``seq_masked_fraction``, the share of tokens whose sequence
        was masked out (all 0 when the mask is empty).

    Raises:
        ValueError: as ``policy_loss``; ``behaviour_log_probs`` of another shape;
            bad bounds (``CorrectionBounds``); an unknown ``correction``; NaN/inf in
            ``old_log_probs`` or ``behaviour_log_probs`` on a masked-in token (the message
            names the ``[row, token]`` positions).
    """
    if behaviour_log_probs.shape != log_probs.shape:
        raise ValueError(
            f"behaviour_log_probs {tuple(behaviour_log_probs.shape)} must be the same [B, T] "
            f"as log_probs {tuple(log_probs.shape)}"
        )
    bounds = CorrectionBounds(tis_cap, seq_mask_low, seq_mask_high)
    corrected = rollout_weights(
        old_log_probs, behaviour_log_probs, response_mask, correction, bounds
    )
    loss, stats = policy_loss(
        log_probs,
        old_log_probs,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        norm_length=norm_length,
        global_normalizer=global_normalizer,
        token_weights=corrected.weights,
    )
    return loss, stats | correction_stats(corrected, response_mask)


@dataclass(frozen=True)
class PolicyLossSettings:
    """The knobs of the policy losses in ``POLICY_LOSSES`` (each takes the ones it uses)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    norm_length: int | None = None
    global_normalizer: float | Tensor | None = None
    correction: str = "none"
    tis_cap: float = 2.0
    seq_mask_low: float = CorrectionBounds.seq_mask_low
    seq_mask_high: float = CorrectionBounds.seq_mask_high

    def clipping(self) -> dict:
        """The keyword arguments ``policy_loss`` and ``decoupled_policy_loss`` share."""
        return {
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
            "clip_ratio_c": self.clip_ratio_c,
            "loss_agg_mode": self.loss_agg_mode,
            "norm_length": self.norm_length,
            "global_normalizer": self.global_normalizer,
        }


class PolicyLossInputs(NamedTuple):
    """The tensors a policy loss is computed from, in ``decoupled_policy_loss``'s order
    (``[B, T]``; ``advantages`` ``[B]`` or ``[B, T]``)."""

    log_probs: Tensor
    old_log_probs: Tensor
    behaviour_log_probs: Tensor | None
    """The sampling policy's log-probs (the engine's), for the decoupled loss; None: the
    proximal policy sampled."""
    advantages: Tensor
    response_mask: Tensor


PolicyLoss = Callable[[PolicyLossInputs, PolicyLossSettings], tuple[Tensor, dict[str, Tensor]]]
"""``loss(inputs, settings) -> (loss, stats)``: every entry of ``POLICY_LOSSES``."""


def ppo_loss(x: PolicyLossInputs, settings: PolicyLossSettings) -> tuple[Tensor, dict]:
    """``policy_loss`` (the clipped surrogate against ``old_log_probs``) with ``settings``'
    clipping; ``behaviour_log_probs`` is not used (the proximal policy sampled)."""
    return policy_loss(
        x.log_probs, x.old_log_probs, x.advantages, x.response_mask, **settings.clipping()
    )


def decoupled_loss(x: PolicyLossInputs, settings: PolicyLossSettings) -> tuple[Tensor, dict]:
    """``decoupled_policy_loss`` with ``settings``' correction, bounds and clipping.

    Raises:
        ValueError: no ``behaviour_log_probs`` (the engine must record them), or as
            ``decoupled_policy_loss``.
    """
    if x.behaviour_log_probs is None:
        raise ValueError(
            "the decoupled policy loss needs the behaviour policy's log-probs: the rollout "
            "engine must record them"
        )
    return decoupled_policy_loss(
        *x,
        correction=settings.correction,
        tis_cap=settings.tis_cap,
        seq_mask_low=settings.seq_mask_low,
        seq_mask_high=settings.seq_mask_high,
        **settings.clipping(),
    )


def ppo_clip_loss(x: PolicyLossInputs, settings: PolicyLossSettings) -> tuple[Tensor, dict]:
    """PPO-clip: ``decoupled_loss`` when the engine recorded its log-probs (the sampling
    policy is not the proximal one: other kernels, or a step behind), else ``ppo_loss``."""
    if x.behaviour_log_probs is None:
        return ppo_loss(x, settings)
    return decoupled_loss(x, settings)


def gspo_policy_loss(
    x: PolicyLossInputs, settings: PolicyLossSettings
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the importance ratio of
    a whole sequence, clipped per sequence, designed for MoE routing instability.

    With ``|y_i|`` the response tokens of sequence ``i``::

        s_i   = exp( (1/|y_i|) Σ_t (log π_θ(y_it) − log π_old(y_it)) )
        s_it  = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)]        (= s_i in value; per-token grad)
        l_it  = max(−A_i · s_it, −A_i · clip(s_it, 1 − ε_low, 1 + ε_high))

    reduced with ``aggregate_loss(w · l, mask, loss_agg_mode)`` (GSPO's paper averages per
    sequence: ``seq-mean-token-mean``; any mode works). ``∂l_it/∂log π_θ(y_it) = −A_i · s_i``
    where the sequence is unclipped, 0 where it is clipped: every token of a sequence is kept
    or clipped together. ``ε`` are the settings' clip ratios (the paper uses 3e-4 / 4e-4;
    ratios near 1 are the sequence's geometric mean, so token-level values clip nothing).
    With the engine's log-probs recorded (``behaviour_log_probs``), ``π_old`` is the proximal
    policy and ``w`` the settings' rollout correction (``rollout_weights``), as in
    ``decoupled_policy_loss``; else ``w = 1``. No dual clip (a sequence ratio cannot explode
    by one token). Log-ratios are clamped to ±20.

    Returns:
        ``(loss, stats)``: ``clip_fraction`` (share of tokens whose sequence is clipped),
        ``dual_clip_fraction`` (0), ``approx_kl``, ``ratio_mean`` and ``ratio_max`` (of the
        sequence ratios, over tokens), plus ``correction_stats`` when corrected.

    Raises:
        ValueError: as ``policy_loss``.
    """
    log_probs, old, behaviour, advantages, mask = x
    shapes_ok = log_probs.shape == old.shape == mask.shape and log_probs.dim() == 2
    if not shapes_ok:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old.shape)} and "
            f"response_mask {tuple(mask.shape)} must all be the same [B, T]"
        )
    if advantages.dim() == 2:
        advantages = advantages[:, 0] if advantages.shape == log_probs.shape else advantages
    if advantages.shape != log_probs.shape[:1]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, T]")
    low, high = settings.clip_ratio_low, settings.clip_ratio_high
    if not (0 <= low < 1 and high >= 0):
        raise ValueError(
            f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {low} and {high}"
        )
    m = mask.to(log_probs.dtype)
    tokens = m.sum(-1)
    log_ratio = (log_probs - old) * m
    seq_log_ratio = log_ratio.sum(-1) / torch.where(tokens > 0, tokens, torch.ones_like(tokens))
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    a = advantages.to(ratio.dtype).unsqueeze(-1)
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1 - low, 1 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    stats_extra: dict[str, Tensor] = {}
    if behaviour is not None:
        bounds = CorrectionBounds(settings.tis_cap, settings.seq_mask_low, settings.seq_mask_high)
        corrected = rollout_weights(old, behaviour, mask, settings.correction, bounds)
        loss_mat = corrected.weights.to(loss_mat.dtype) * loss_mat
        stats_extra = correction_stats(corrected, mask)
    loss = aggregate_loss(
        loss_mat,
        mask,
        settings.loss_agg_mode,
        norm_length=settings.norm_length,
        global_normalizer=settings.global_normalizer,
    )
    with torch.no_grad():
        seq_ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        per_token = seq_ratio.unsqueeze(-1).expand_as(m)
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).to(m.dtype), m),
            "dual_clip_fraction": m.new_zeros(()),
            "approx_kl": masked_mean(old - log_probs.detach(), m),
            "ratio_mean": masked_mean(per_token, m),
            "ratio_max": (per_token * m).max() if m.numel() else m.new_zeros(()),
        }
    return loss, {k: v.detach() for k, v in stats.items()} | stats_extra


def _clipped_surrogate(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``policy_loss``'s per-token ``[B, T]`` loss ``l`` (unmasked) and its stats."""
    if not (log_probs.shape == old_log_probs.shape == response_mask.shape) or (
        log_probs.dim() != 2
    ):
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} "
            f"and response_mask {tuple(response_mask.shape)} must all be the same [B, T]"
        )
    if advantages.dim() == 1 and advantages.shape[0] == log_probs.shape[0]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != log_probs.shape:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be [B] or [B, T] "
            f"with [B, T] = {tuple(log_probs.shape)}"
        )
    if not (0 <= clip_ratio_low < 1 and clip_ratio_high >= 0):
        raise ValueError(
            f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
            f"got {clip_ratio_low} and {clip_ratio_high}"
        )
    if not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")

    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(pessimistic, dual_bound), pessimistic)

    with torch.no_grad():
        mask = response_mask.to(ratio.dtype)
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "dual_clip_fraction": masked_mean(
                (negative & (pessimistic > dual_bound)).to(mask.dtype), mask
            ),
            "approx_kl": masked_mean(old_log_probs - log_probs, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": (ratio * mask).max() if ratio.numel() else ratio.new_zeros(()),
        }
    return loss_mat, {name: value.detach() for name, value in stats.items()}


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_policy_loss,
    "ppo": ppo_loss,
    "decoupled": decoupled_loss,
}


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss called ``name``; ValueError listing the valid names."""
    return lookup(POLICY_LOSSES, name, "policy loss")
