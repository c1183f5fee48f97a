"""GRPO math as pure tensor functions, selected by name from small registries.

Shapes: ``B`` sequences (rollouts), ``T`` response tokens, ``V`` vocabulary entries.
Token tensors are ``[B, T]`` with a 0/1 ``response_mask`` marking the tokens that count.
Every function here is side-effect free; the training loop wires them together.

Registries (validate config names once with the ``get_*`` functions):

- ``ADVANTAGE_ESTIMATORS``: ``grpo`` (group-normalized by std), ``dr_grpo`` (mean-centred).
- ``KL_ESTIMATORS``: ``k1``, ``k2``, ``k3`` (alias ``low_var_kl``).
- ``LOSS_AGG_MODES``: ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
  ``seq-mean-token-sum-norm``.
- ``ROLLOUT_CORRECTIONS``: ``none``, ``token_tis``, ``seq_tis``, ``seq_mask`` (how the gap
  between the engine that sampled and the trainer is corrected).
- ``POLICY_LOSSES``: ``ppo_clip`` (``ppo`` on-policy, ``decoupled`` when the engine recorded
  its log-probs), ``gspo`` (``gspo_policy_loss``: the sequence-level ratio), ``ppo``
  (``policy_loss``), ``decoupled`` (``decoupled_policy_loss``), each called as
  ``loss(PolicyLossInputs, PolicyLossSettings)``; ``algorithm.policy_loss`` names one.

``overlong_penalty`` is DAPO's soft overlong punishment, added to the rewards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ±this before ``exp`` so one wild token cannot overflow."""
K3_CLAMP = 10.0
"""The k3 estimate is clamped to ±this per token (as verl does)."""


# --------------------------------------------------------------------------- advantages


@dataclass(frozen=True)
class GroupStats:
    """Per-group reward statistics (``G`` distinct groups).

    Attributes:
        ids: ``[G]`` the distinct group labels, sorted (``0..G-1`` for a fixed group size).
        index: ``[B]`` each sample's position in ``ids``; ``all_equal[index]`` maps a
            per-group value back onto samples.
        size: ``[G]`` samples per group.
        mean: ``[G]`` mean reward.
        std: ``[G]`` unbiased (Bessel-corrected, ``n - 1``) standard deviation, as
            ``torch.std``; 0 for groups of one.
        all_equal: ``[G]`` True where every reward in the group is identical (groups of one
            included): such groups carry no learning signal and get zero advantage.
    """

    ids: Tensor
    index: Tensor
    size: Tensor
    mean: Tensor
    std: Tensor
    all_equal: Tensor


def _check_finite_rewards(rewards: Tensor) -> None:
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        positions = bad.nonzero().flatten().tolist()
        shown = ", ".join(str(p) for p in positions[:20])
        more = f" and {len(positions) - 20} more" if len(positions) > 20 else ""
        raise ValueError(
            f"rewards are NaN or infinite at positions [{shown}]{more} of {rewards.numel()}; "
            "fix the reward function or drop those samples before computing advantages"
        )


def _group_index(rewards: Tensor, groups: Tensor | int) -> tuple[Tensor, Tensor]:
    """Return (distinct group labels, each sample's position among them)."""
    n = rewards.shape[0]
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1 or n % groups:
            raise ValueError(
                f"group_size={groups} must be a positive divisor of the batch size {n}; "
                "pass a tensor of group ids for uneven groups"
            )
        ids = torch.arange(n // groups, device=rewards.device)
        return ids, torch.arange(n, device=rewards.device) // groups
    integer = isinstance(groups, Tensor) and not (
        groups.dtype.is_floating_point or groups.dtype.is_complex or groups.dtype == torch.bool
    )
    if not integer:
        raise ValueError(
            f"groups must be an int group size or an integer tensor of group ids, got {groups!r}"
        )
    if groups.shape != rewards.shape:
        raise ValueError(
            f"group ids shape {tuple(groups.shape)} != rewards shape {tuple(rewards.shape)}"
        )
    ids, index = torch.unique(groups, return_inverse=True)
    return ids, index


def group_stats(rewards: Tensor, groups: Tensor | int) -> GroupStats:
    """Per-group size, mean, unbiased std and an all-equal (no signal) mask.

    Args:
        rewards: ``[B]`` one scalar reward per rollout.
        groups: a fixed group size (consecutive runs of that many samples form a group), or
            a ``[B]`` integer tensor of group ids (any labels, any order, uneven sizes).

    Returns:
        The statistics; see ``GroupStats``.

    Raises:
        ValueError: rewards are not 1-D or contain NaN/inf (the message names the
            positions), or ``groups`` is malformed.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    _check_finite_rewards(rewards)
    if not rewards.dtype.is_floating_point:
        rewards = rewards.to(torch.float32)
    ids, index = _group_index(rewards, groups)
    g = ids.shape[0]
    zeros = rewards.new_zeros(g)
    size = torch.zeros(g, dtype=torch.long, device=rewards.device).index_add(
        0, index, torch.ones_like(index)
    )
    mean = zeros.index_add(0, index, rewards) / size.to(rewards.dtype)
    squares = zeros.index_add(0, index, (rewards - mean[index]) ** 2)
    std = torch.where(size > 1, (squares / (size - 1).clamp(min=1)).sqrt(), zeros)
    high = zeros.scatter_reduce(0, index, rewards, "amax", include_self=False)
    low = zeros.scatter_reduce(0, index, rewards, "amin", include_self=False)
    return GroupStats(ids=ids, index=index, size=size, mean=mean, std=std, all_equal=high == low)


def group_advantages(
    rewards: Tensor, groups: Tensor | int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages, one per rollout.

    GRPO (``norm_by_std=True``): ``A_i = (r_i - mean_g) / (std_g + eps)`` with ``std_g`` the
    unbiased (``n - 1``) standard deviation of group ``g``, as ``torch.std`` and verl.
    Dr.GRPO (``norm_by_std=False``): ``A_i = r_i - mean_g``.
    Groups of one and groups whose rewards are all equal get exactly 0.

    Args:
        rewards: ``[B]`` one scalar reward per rollout.
        groups: fixed group size, or ``[B]`` integer group ids (uneven groups allowed).
        norm_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std before dividing.

    Returns:
        ``[B]`` advantages (float dtype of ``rewards``, float32 for integer rewards).

    Raises:
        ValueError: as ``group_stats`` (NaN/inf rewards are named by position).
    """
    stats = group_stats(rewards, groups)
    centred = rewards.to(stats.mean.dtype) - stats.mean[stats.index]
    advantages = centred / (stats.std[stats.index] + eps) if norm_by_std else centred
    return torch.where(stats.all_equal[stats.index], torch.zeros_like(advantages), advantages)


def grpo_advantages(rewards: Tensor, groups: Tensor | int) -> Tensor:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + 1e-6)``; see ``group_advantages``."""
    return group_advantages(rewards, groups, norm_by_std=True)


def dr_grpo_advantages(rewards: Tensor, groups: Tensor | int) -> Tensor:
    """Dr.GRPO: ``A_i = r_i - mean_g``; see ``group_advantages``."""
    return group_advantages(rewards, groups, norm_by_std=False)


# --------------------------------------------------------------------------- aggregation


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


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    count = mask.sum()
    return (values * mask).sum() / torch.where(count > 0, count, torch.ones_like(count))


# --------------------------------------------------------------------------- policy loss


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


# --------------------------------------------------------------------------- rollout correction


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
        _check_finite_tokens(old_log_probs, counted, "old_log_probs")
        _check_finite_tokens(behaviour_log_probs, counted, "behaviour_log_probs")
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
            "clip_fraction": _masked_mean((clipped > unclipped).to(m.dtype), m),
            "dual_clip_fraction": m.new_zeros(()),
            "approx_kl": _masked_mean(old - log_probs.detach(), m),
            "ratio_mean": _masked_mean(per_token, m),
            "ratio_max": (per_token * m).max() if m.numel() else m.new_zeros(()),
        }
    return loss, {k: v.detach() for k, v in stats.items()} | stats_extra


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each reward.

    With ``L_max = max_length`` (the generation limit) and ``L_cache = buffer``::

        R(y) = 0                                   |y| <= L_max − L_cache
        R(y) = ((L_max − L_cache) − |y|) / L_cache  L_max − L_cache < |y| <= L_max
        R(y) = −1                                  L_max < |y|

    times ``factor``: a response is pushed back gradually as it nears the limit instead of
    being cut off with no signal. ``buffer = 0`` turns it off (all 0).

    Args:
        lengths: ``[B]`` response lengths in tokens.
        max_length: ``L_max``.
        buffer: ``L_cache``, ``0 <= buffer < max_length``.
        factor: the penalty's scale (the reward's units per 1).

    Raises:
        ValueError: ``buffer`` out of range.
    """
    if not 0 <= buffer < max_length:
        raise ValueError(f"overlong buffer must be in [0, max_length={max_length}), got {buffer}")
    lengths = lengths.to(torch.float32)
    if buffer == 0:
        return torch.zeros_like(lengths)
    expected = max_length - buffer
    ramp = ((expected - lengths) / buffer).clamp(max=0.0)
    return factor * torch.where(lengths > max_length, torch.full_like(lengths, -1.0), ramp)


def correction_stats(corrected: RolloutWeights, response_mask: Tensor) -> dict[str, Tensor]:
    """Token means over ``response_mask`` of a correction's ratio and flags, and the largest
    ratio (all 0 when the mask is empty): ``importance_ratio_mean``, ``importance_ratio_max``,
    ``tis_clipped_fraction``, ``seq_masked_fraction``."""
    with torch.no_grad():
        ratio = corrected.ratio
        mask = response_mask.to(ratio.dtype)
        return {
            "importance_ratio_mean": _masked_mean(ratio, mask),
            "importance_ratio_max": (ratio * mask).max() if ratio.numel() else ratio.new_zeros(()),
            "tis_clipped_fraction": _masked_mean(corrected.truncated.to(mask.dtype), mask),
            "seq_masked_fraction": _masked_mean(corrected.masked.to(mask.dtype), mask),
        }


def _check_finite_tokens(values: Tensor, counted: Tensor, name: str) -> None:
    bad = counted & ~torch.isfinite(values)
    if bool(bad.any()):
        positions = bad.nonzero().tolist()
        shown = ", ".join(str(p) for p in positions[:20])
        more = f" and {len(positions) - 20} more" if len(positions) > 20 else ""
        raise ValueError(
            f"{name} are NaN or infinite at [row, token] {shown}{more} (masked-in tokens); "
            "fix the engine or trainer that scored them, or mask those tokens out"
        )


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
            "clip_fraction": _masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "dual_clip_fraction": _masked_mean(
                (negative & (pessimistic > dual_bound)).to(mask.dtype), mask
            ),
            "approx_kl": _masked_mean(old_log_probs - log_probs, mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "ratio_max": (ratio * mask).max() if ratio.numel() else ratio.new_zeros(()),
        }
    return loss_mat, {name: value.detach() for name, value in stats.items()}


# --------------------------------------------------------------------------- KL


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


# --------------------------------------------------------------------------- logits


def _over_row_chunks(
    fn: Callable[[Tensor], Tensor], logits: Tensor, chunk_rows: int, temperature: float = 1.0
) -> Tensor:
    """Apply ``fn`` (``[n, V] -> [n]``) to row chunks of ``logits`` upcast to >= float32 and
    divided by ``temperature`` (not at all at 1: the raw logits, bit for bit)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = logits.reshape(-1, logits.shape[-1])
    parts = [fn(_tempered(chunk.to(dtype), temperature)) for chunk in rows.split(chunk_rows)]
    out = torch.cat(parts) if parts else rows.new_zeros(0, dtype=dtype)
    return out.reshape(logits.shape[:-1])


def _entropy_rows(logits: Tensor) -> Tensor:
    shifted = logits - logits.amax(-1, keepdim=True).detach()
    probs = torch.softmax(shifted, -1)
    # -inf logits have zero probability; zero them so 0·(-inf) does not make NaN.
    finite = shifted.masked_fill(probs == 0, 0.0)
    return torch.logsumexp(shifted, -1) - (probs * finite).sum(-1)


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature``; the logits themselves at 1 (no rounding, no copy)."""
    return logits if temperature == 1.0 else logits / temperature


def entropy_from_logits(
    logits: Tensor, *, temperature: float = 1.0, chunk_rows: int = 1024
) -> Tensor:
    """Entropy of the tempered softmax: ``H = logsumexp(z) - Σ_v softmax(z)_v · z_v``,
    ``z = logits / temperature``.

    ``z`` is shifted by its (detached) max, which leaves ``H`` unchanged and avoids
    cancellation between two large numbers. Computed in float32 (or float64) a chunk of rows
    at a time, so a bfloat16 ``[B, T, V]`` is never upcast (or divided) whole in the forward
    pass.

    Args:
        logits: ``[..., T, V]``.
        temperature: the sampling temperature the distribution is of (> 0; 1: raw logits).
        chunk_rows: rows (tokens) per chunk.

    Returns:
        ``[..., T]`` entropies in nats.
    """
    return _over_row_chunks(_entropy_rows, logits, chunk_rows, temperature)


def token_log_probs(
    logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0, chunk_rows: int = 1024
) -> Tensor:
    """Log-probabilities of the given tokens under the tempered softmax:
    ``log p(x_t) = z_{x_t} - logsumexp(z)``, ``z = logits / temperature``.

    The policy a rollout engine samples from at temperature ``T`` is ``softmax(logits / T)``;
    its log-probs (the importance ratio's, the KL's, the mismatch's) are these with the same
    ``T``, as verl's and OpenRLHF's actors divide the logits by the rollout temperature.
    Gathers the chosen logit and subtracts a per-row logsumexp computed a chunk of rows at a
    time in float32, so no ``[..., T, V]`` log-softmax (or divided copy) is materialized.

    Args:
        logits: ``[..., T, V]`` (any float dtype).
        token_ids: ``[..., T]`` integer ids in ``[0, V)``.
        temperature: > 0; 1 (the default) is the raw logits, computed exactly as without it.
        chunk_rows: rows (tokens) per logsumexp chunk.

    Returns:
        ``[..., T]`` log-probs in float32 (float64 for float64 logits).

    Raises:
        ValueError: ``token_ids`` shape is not ``logits.shape[:-1]`` or not integer, or
            ``temperature`` is not > 0.
    """
    if token_ids.shape != logits.shape[:-1] or token_ids.dtype.is_floating_point:
        raise ValueError(
            f"token_ids must be integer with shape {tuple(logits.shape[:-1])} (logits without "
            f"the vocab dim), got {token_ids.dtype} {tuple(token_ids.shape)}"
        )
    chosen = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    normalizer = _over_row_chunks(
        lambda rows: torch.logsumexp(rows, -1), logits, chunk_rows, temperature
    )
    return _tempered(chosen.to(normalizer.dtype), temperature) - normalizer


# --------------------------------------------------------------------------- registries

ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor, Tensor | int], Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
}


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_policy_loss,
    "ppo": ppo_loss,
    "decoupled": decoupled_loss,
}


_Entry = TypeVar("_Entry")


def _lookup(registry: dict[str, _Entry], name: str, what: str) -> _Entry:
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid names: {', '.join(sorted(registry))}")
    return registry[name]


def get_advantage_estimator(name: str) -> Callable[[Tensor, Tensor | int], Tensor]:
    """The advantage estimator called ``name``; ValueError listing the valid names."""
    return _lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The per-token KL estimator called ``name``; ValueError listing the valid names."""
    return _lookup(KL_ESTIMATORS, name, "KL estimator")


def get_loss_agg_mode(name: str) -> LossAggregation:
    """The loss aggregation called ``name``; ValueError listing the valid names."""
    return _lookup(LOSS_AGG_MODES, name, "loss aggregation mode")


def get_rollout_correction(
    name: str,
) -> Callable[[Tensor, Tensor, CorrectionBounds], RolloutWeights]:
    """The rollout correction called ``name``; ValueError listing the valid names."""
    return _lookup(ROLLOUT_CORRECTIONS, name, "rollout correction")


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss called ``name``; ValueError listing the valid names."""
    return _lookup(POLICY_LOSSES, name, "policy loss")
