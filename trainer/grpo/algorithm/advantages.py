"""Group-relative advantages (``ADVANTAGE_ESTIMATORS``) and DAPO's overlong reward shaping."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.grpo.algorithm.registry import lookup


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


ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor, Tensor | int], Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
}


def get_advantage_estimator(name: str) -> Callable[[Tensor, Tensor | int], Tensor]:
    """The advantage estimator called ``name``; ValueError listing the valid names."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
