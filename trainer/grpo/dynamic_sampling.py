"""DAPO's dynamic sampling: keep the step's batch full of groups that carry a learning signal.

A group whose rewards are all equal has advantage 0 for every response under both advantage
estimators (``algorithm.group_advantages``): it adds nothing to the gradient, and as more
prompts become always-solved (or never-solved) the batch's effective size shrinks. DAPO (Yu et
al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476,
§3.2 "Dynamic Sampling") trains only on groups whose ``G`` outputs satisfy the constraint of
its objective

    0 < |{o_i : o_i is equivalent to the answer a}| < G

— here: not every reward of the group is the same (``algorithm.GroupStats.all_equal``) — and
over-samples until the batch holds enough of them. As built here (``fill_signal_groups``),
after the step's groups are scored:

1. the slots of the batch whose group has no signal are counted; when no data-parallel replica
   has one, nothing happens;
2. otherwise a round samples ``prompts_per_step`` fresh prompts (every replica its share, as a
   step; ``trainer.grpo.prompts.resample_prompts``) with the policy's current weights, scores
   them, and each replica puts its round's groups with signal, in order, into its slots
   without signal, in order (``refill_plan``); surplus groups are dropped, as DAPO's;
3. repeat until every slot holds signal or ``algorithm.dynamic_sampling.max_resample_rounds``
   rounds ran; slots still without signal stay (advantage 0, left out of the loss with
   ``algorithm.filter_no_signal_groups``).

The batch keeps its shape (``prompts_per_step × n_samples`` rows), so mini-batches, loss
normalizers and every training backend see a batch like any other. Every replica runs the same
number of rounds (the decision is all-reduced), since a round's generation may be collective
(ZeRO-3's lockstep decode, engines shared by several ranks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from trainer.backends import DataParallel
from trainer.grpo import algorithm as algo
from trainer.grpo.config import DynamicSamplingConfig
from trainer.grpo.update import Batch

PREFIX = "dynamic_sampling/"
"""The metrics' prefix in ``training_metrics.jsonl`` and MLflow."""


def slot_signal(batch: Batch) -> list[bool]:
    """Per prompt slot of ``batch`` (``batch.prompts``' order): True when its group's rewards
    are not all equal (``algorithm.group_stats``). A slot with no rollouts has no signal."""
    groups = torch.tensor([r.prompt_index for r in batch.rollouts], dtype=torch.long)
    signal = [False] * len(batch.prompts)
    if not batch.rollouts:
        return signal
    stats = algo.group_stats(batch.rewards, groups)
    for slot, all_equal in zip(stats.ids.tolist(), stats.all_equal.tolist(), strict=True):
        signal[slot] = not all_equal
    return signal


def refill_plan(has_signal: Sequence[bool], fresh_signal: Sequence[bool]) -> dict[int, int]:
    """Which fresh group fills which slot: the slots without signal, in order, take the fresh
    groups with signal, in order, one each, as far as those go.

    Returns:
        ``{slot: fresh group}``.
    """
    takers = [slot for slot, signal in enumerate(has_signal) if not signal]
    givers = [group for group, signal in enumerate(fresh_signal) if signal]
    return dict(zip(takers, givers, strict=False))


def replace_groups(batch: Batch, fresh: Batch, plan: dict[int, int]) -> Batch:
    """``batch`` with the group of each slot in ``plan`` replaced by ``fresh``'s group
    ``plan[slot]`` (its prompt, rollouts, rewards, advantages, keep flags and results; the
    rollouts renumbered to the slot). Rows stay in slot order, so an empty plan gives the
    same rows in the same order.

    Advantages are per group, so a group moves with its own unchanged.
    """
    if not plan:
        return batch
    rows: dict[int, list[tuple[Batch, int]]] = {slot: [] for slot in range(len(batch.prompts))}
    for i, rollout in enumerate(batch.rollouts):
        if rollout.prompt_index not in plan:
            rows[rollout.prompt_index].append((batch, i))
    slot_of = {group: slot for slot, group in plan.items()}
    for i, rollout in enumerate(fresh.rollouts):
        if rollout.prompt_index in slot_of:
            rows[slot_of[rollout.prompt_index]].append((fresh, i))
    prompts = [
        fresh.prompts[plan[slot]] if slot in plan else prompt
        for slot, prompt in enumerate(batch.prompts)
    ]
    picked = [(slot, source, i) for slot in rows for source, i in rows[slot]]
    rollouts = [replace(source.rollouts[i], prompt_index=slot) for slot, source, i in picked]

    def gather(field: str) -> torch.Tensor:
        return torch.stack([getattr(source, field)[i] for _, source, i in picked])

    return Batch(
        prompts,
        rollouts,
        gather("rewards"),
        gather("advantages"),
        gather("keep"),
        [source.results[i] for _, source, i in picked],
    )


def fill_signal_groups(
    cfg: DynamicSamplingConfig,
    batch: Batch,
    resample: Callable[[int], Batch],
    dp: DataParallel,
) -> tuple[Batch, dict[str, float]]:
    """DAPO's dynamic sampling of one step on this replica (see the module's docstring).

    Args:
        cfg: ``algorithm.dynamic_sampling``; off: ``batch`` unchanged and no metrics.
        batch: this replica's scored batch of the step.
        resample: round ``k`` (≥ 1) → this replica's share of that round's fresh prompts,
            generated and scored (a ``Batch`` of ``len(batch.prompts)`` slots).
        dp: the data-parallel replicas (the rounds are decided over all of them; the counts
            summed).

    Returns:
        The filled batch, and the step's ``dynamic_sampling/…`` metrics (every replica's):
        ``rounds`` (resample rounds run), ``sampled_groups`` (the step's groups and every
        round's), ``signal_groups`` (of those, the ones with signal), ``signal_rate``
        (their share), ``refilled_groups`` (slots given a fresh group), ``unfilled_groups``
        (slots still without signal: the cap was reached), ``resample_s`` (seconds in the
        rounds: generation and scoring).
    """
    if not cfg.enabled:
        return batch, {}
    started = time.monotonic()
    signal = slot_signal(batch)
    sampled, with_signal, refilled, rounds = len(signal), sum(signal), 0, 0
    while rounds < cfg.max_resample_rounds and dp.all_reduce_max(float(not all(signal))) > 0:
        rounds += 1
        fresh = resample(rounds)
        fresh_signal = slot_signal(fresh)
        sampled += len(fresh_signal)
        with_signal += sum(fresh_signal)
        plan = refill_plan(signal, fresh_signal)
        batch = replace_groups(batch, fresh, plan)
        refilled += len(plan)
        signal = [s or slot in plan for slot, s in enumerate(signal)]
    sampled_all = dp.all_reduce_sum(float(sampled))
    signal_all = dp.all_reduce_sum(float(with_signal))
    metrics = {
        "rounds": float(rounds),
        "sampled_groups": sampled_all,
        "signal_groups": signal_all,
        "signal_rate": signal_all / max(1.0, sampled_all),
        "refilled_groups": dp.all_reduce_sum(float(refilled)),
        "unfilled_groups": dp.all_reduce_sum(float(signal.count(False))),
        "resample_s": time.monotonic() - started,
    }
    return batch, {PREFIX + name: value for name, value in metrics.items()}
