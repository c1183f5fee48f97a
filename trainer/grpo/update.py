"""The GRPO update of one step: score the rollouts (rewards, group advantages, the groups
that carry signal), then PPO epochs over mini-batches through the training backend, with the
policy loss picked by name from ``algorithm.POLICY_LOSSES`` (``algorithm.policy_loss``; each
corrects for the engine's policy when the engine recorded its log-probs), KL to the
reference, entropy, and the rollout-correction and mismatch statistics; and the step's reward
metrics.

Nothing here builds anything: the recipe (``trainer.grpo.recipe``) hands in the config, the
backend and the batch. Every rank calls it; normalizers and metrics are summed over the
data-parallel replicas, so N processes follow the single-process run.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from reward.scoring import Verdict
from trainer.backends import BackendRequest, DataParallel, LossFn, TrainingBackend
from trainer.distributed import DistInfo
from trainer.grpo import algorithm as algo
from trainer.grpo.config import GRPOConfig
from trainer.grpo.micro_batch import Micro, sequences, with_routing
from trainer.grpo.mismatch import MismatchMeter
from trainer.grpo.prompts import Prompt
from trainer.grpo.rollout import Rollout
from trainer.grpo.routing import RouterCounts
from trainer.sft.lora import apply_lora


@dataclass
class Batch:
    """The rollouts of one step on this rank, with everything the update needs."""

    prompts: list[Prompt]
    rollouts: list[Rollout]
    rewards: torch.Tensor
    advantages: torch.Tensor
    keep: torch.Tensor
    """1 for samples in groups with signal (or all, when filtering is off), else 0."""
    results: list


def decode(tokenizer, ids: list[int]) -> str:
    """A response's text with its harmony tokens (what the reward parses)."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def both_languages_match(result) -> bool:
    """Reasoning and answer both in their requested languages."""
    return result.answer_verdict == Verdict.MATCH and result.reasoning_verdict == Verdict.MATCH


def backend_request(
    cfg: GRPOConfig, sft_model: str | Path, dtype: torch.dtype, info: DistInfo, pad_id: int
) -> BackendRequest:
    """The training backend the update drives: one optimizer step per mini-batch of every PPO
    epoch of every step, ``mini_batch_size / (micro_batch_size × processes)`` micro-batches
    accumulated per step on each process, a frozen reference when KL is on."""
    mini_batches = cfg.prompts_per_step * cfg.rollout.n_samples // cfg.mini_batch_size
    return BackendRequest(
        sft_model,
        cfg.optim,
        dtype,
        info,
        cfg.max_steps * cfg.algorithm.ppo_epochs * mini_batches,
        cfg.micro_batch_size,
        cfg.mini_batch_size // (cfg.micro_batch_size * info.world_size),
        gradient_checkpointing=cfg.gradient_checkpointing,
        with_reference=cfg.algorithm.kl_loss_coef > 0,
        seed=cfg.seed,
        pad_id=pad_id,
        adapt=functools.partial(apply_lora, lora=cfg.lora) if cfg.lora.r else None,
    )


def score_rollouts(
    cfg: GRPOConfig, tokenizer, reward_fn, prompts: list[Prompt], rollouts: list[Rollout]
) -> Batch:
    """This rank's rollouts scored: each response's reward against its prompt's label (with
    DAPO's overlong penalty when ``algorithm.overlong_buffer``), the group advantages
    (``algorithm.advantage_estimator``), and which samples are kept (the groups whose rewards
    differ, when ``algorithm.filter_no_signal_groups``)."""
    texts = [decode(tokenizer, r.response_ids) for r in rollouts]
    asked = [prompts[r.prompt_index] for r in rollouts]
    scored = reward_fn(texts, [p.label for p in asked], prompts=[p.text for p in asked])
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    a = cfg.algorithm
    if a.overlong_buffer:
        lengths = torch.tensor([len(r.response_ids) for r in rollouts])
        rewards = rewards + algo.overlong_penalty(
            lengths, cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty_factor
        )
    groups = torch.tensor([r.prompt_index for r in rollouts])
    advantages = algo.get_advantage_estimator(cfg.algorithm.advantage_estimator)(rewards, groups)
    stats = algo.group_stats(rewards, groups)
    no_signal = stats.all_equal[stats.index]
    keep = (
        (~no_signal).float() if cfg.algorithm.filter_no_signal_groups else torch.ones_like(rewards)
    )
    return Batch(prompts, rollouts, rewards, advantages, keep, scored.results)


def policy_update(
    cfg: GRPOConfig,
    backend: TrainingBackend,
    batch: Batch,
    pad_id: int,
    step: int,
    stale: bool = False,
) -> dict:
    """PPO epochs over mini-batches of this step's rollouts; returns averaged statistics.

    The backend runs each mini-batch's forward and backward (``forward_backward``), calling
    the ``_loss_fn`` loss of each micro-batch with its log-probs; normalizers are summed over
    the data-parallel replicas, so every replica's loss is its share of the global one.
    When the engine recorded its log-probs (the behaviour policy), the loss is
    ``algorithm.decoupled_policy_loss`` with the step's rollout correction
    (``_correction``; ``stale``: the rollouts were sampled by an older policy,
    ``rollout.async_steps``) and the statistics hold the correction's and the mismatch's
    (``trainer.grpo.mismatch``: the engine's log-probs against the trainer's before the
    update, every response token).
    """
    a = cfg.algorithm
    dp = backend.data_parallel
    n = len(batch.rollouts)
    local_mini = cfg.mini_batch_size // dp.size
    device = dp.device
    correction = _correction(cfg, stale)
    recorded = _recorded(batch, correction)
    meter = MismatchMeter(a.seq_mask_low, a.seq_mask_high) if recorded else None
    counts = RouterCounts()
    # one on-policy update: the old log-probs equal the current ones, so reuse them (detached)
    single_update = a.ppo_epochs == 1 and local_mini >= n
    old_log_probs: list[torch.Tensor] = []
    if not single_update:
        old_log_probs = _proximal_log_probs(cfg, backend, batch, pad_id, counts, meter)
    summed = ("loss", "grad_norm", "clip_fraction", "entropy", "kl", "learning_rate")
    sums = dict.fromkeys(summed + (CORRECTION_MEANS if recorded else ()), 0.0)
    ratio_max, updates = 0.0, 0
    order = list(range(n))
    for epoch in range(a.ppo_epochs):
        if a.ppo_epochs > 1:
            random.Random(f"{cfg.seed}:{step}:{epoch}").shuffle(order)
        for mini_start in range(0, n, local_mini):
            mini = order[mini_start : mini_start + local_mini]
            micros = [
                mini[s : s + cfg.micro_batch_size]
                for s in range(0, len(mini), cfg.micro_batch_size)
            ]
            measuring = counts if single_update else None  # the forward before the update
            layouts, masks, normalizer = _mini_batch_rows(cfg, batch, micros, pad_id, dp, measuring)
            ref_log_probs = backend.log_probs(layouts, reference=True) if a.kl_loss_coef else None
            behaviour = _behaviour_blocks(batch, micros, layouts, device) if recorded else None
            measured = None  # the mismatch, measured here on the only forward before the update
            if meter is not None and single_update:
                measured = [layout.mask for layout in layouts]
            loss = _loss_fn(
                cfg,
                batch,
                micros,
                masks,
                normalizer,
                old_log_probs,
                ref_log_probs,
                device,
                behaviour,
                correction,
                measured,
            )
            micro_stats = backend.forward_backward(layouts, loss)
            for stats in micro_stats:  # on every rank, whichever stage measured it
                if "mismatch" in stats:
                    meter.merge(stats.pop("mismatch"))
            sums["learning_rate"] += backend.learning_rate()
            sums["grad_norm"] += backend.step()
            ratio_max = max(ratio_max, _add_mini_batch(sums, micro_stats, masks, dp, recorded))
            updates += 1
    out = {k: v / max(1, updates) for k, v in sums.items()}
    if recorded:  # the largest over every mini-batch and replica: one reduce for the step
        out["importance_ratio_max"] = dp.all_reduce_max(ratio_max)
    return out | _measured_metrics(meter, counts, dp)


def _mini_batch_rows(
    cfg: GRPOConfig,
    batch: Batch,
    micros: list[list[int]],
    pad_id: int,
    dp: DataParallel,
    measuring: RouterCounts | None,
) -> tuple[list, list[torch.Tensor], float]:
    """A mini-batch's micro-batches laid out as the backend takes them, their loss masks (the
    response tokens of the groups that carry signal) and the loss's normalizer: the masks'
    count (``algorithm.loss_agg_mode``) summed over the data-parallel replicas."""
    device = dp.device
    layouts = [_laid_out(cfg, batch, micro, pad_id, device, measuring) for micro in micros]
    masks = [
        layout.mask * batch.keep[micro].to(device)[:, None]
        for layout, micro in zip(layouts, micros, strict=True)
    ]
    agg = algo.get_loss_agg_mode(cfg.algorithm.loss_agg_mode)
    local_count = sum(float(agg.count(m)) for m in masks)
    return layouts, masks, max(dp.all_reduce_sum(local_count), 1e-8)


def _recorded(batch: Batch, correction: str) -> bool:
    """Whether the engine recorded every rollout's behaviour log-probs.

    Raises:
        ValueError: a rollout without them when ``correction`` (or an off-policy update)
            needs them, naming the rollout."""
    recorded = all(r.log_probs is not None for r in batch.rollouts)
    if correction != "none" and not recorded:
        missing = next(i for i, r in enumerate(batch.rollouts) if r.log_probs is None)
        raise ValueError(
            f"rollout {missing} of the batch has no behaviour log-probs: the engine must record "
            f"them for algorithm.rollout_correction {correction!r} (and for an off-policy "
            "update, rollout.async_steps)"
        )
    return recorded


def _behaviour_blocks(batch: Batch, micros: list[list[int]], layouts: list, device) -> list:
    """The engine's recorded log-probs of each micro-batch's rollouts, laid out as its
    log-probs are (``_behaviour_block``), on ``device``."""
    return [
        _behaviour_block(batch, micro, layout.width).to(device)
        for micro, layout in zip(micros, layouts, strict=True)
    ]


def _measured_metrics(meter: MismatchMeter | None, counts: RouterCounts, dp) -> dict:
    """The step's mismatch metrics (engine against trainer log-probs, when recorded) and its
    router mismatch rate (when the engine recorded its routing and the model routes)."""
    out = dict(meter.metrics(dp.group, dp.size)) if meter is not None else {}
    compared = dp.all_reduce_sum(counts.compared)
    if compared:
        out["router_mismatch_rate"] = dp.all_reduce_sum(counts.differ) / compared
    return out


def _proximal_log_probs(
    cfg: GRPOConfig,
    backend: TrainingBackend,
    batch: Batch,
    pad_id: int,
    counts: RouterCounts,
    meter: MismatchMeter | None,
) -> list[torch.Tensor]:
    """The policy's log-probs of every rollout before the update (the proximal policy), one
    tensor a micro-batch in rollout order; the mismatch against the engine's recorded
    log-probs is measured on them (``meter``) and the routing compared (``counts``)."""
    n = len(batch.rollouts)
    chunks = [
        list(range(start, min(start + cfg.micro_batch_size, n)))
        for start in range(0, n, cfg.micro_batch_size)
    ]
    device = backend.data_parallel.device
    layouts = [_laid_out(cfg, batch, chunk, pad_id, device, counts) for chunk in chunks]
    old_log_probs = backend.log_probs(layouts)
    if meter is not None:
        for chunk, layout, old in zip(chunks, layouts, old_log_probs, strict=True):
            meter.add(old, _behaviour_block(batch, chunk, layout.width), layout.mask)
    return old_log_probs


def _add_mini_batch(
    sums: dict[str, float], micro_stats: list[dict], masks: list, dp, recorded: bool
) -> float:
    """Add one mini-batch's statistics, summed over its micro-batches and the data-parallel
    replicas, to ``sums`` (the clip fraction and the correction's means per masked token);
    the largest importance ratio of its micro-batches on this rank (0 without recorded
    log-probs)."""
    for key in ("loss", "entropy", "kl"):
        sums[key] += dp.all_reduce_sum(sum((stats[key] for stats in micro_stats), 0.0))
    masked_tokens = max(dp.all_reduce_sum(sum(float(m.sum()) for m in masks)), 1e-8)
    clipped = sum((stats["clipped_tokens"] for stats in micro_stats), 0.0)
    sums["clip_fraction"] += dp.all_reduce_sum(clipped) / masked_tokens
    if not recorded:
        return 0.0
    for key in CORRECTION_MEANS:
        total = sum(stats[key] for stats in micro_stats)
        sums[key] += dp.all_reduce_sum(total) / masked_tokens
    return max(stats["importance_ratio_max"] for stats in micro_stats)


def _laid_out(
    cfg: GRPOConfig,
    batch: Batch,
    rows: list[int],
    pad_id: int,
    device,
    counts: RouterCounts | None = None,
) -> Micro:
    """The rollouts ``rows`` as a micro-batch (``micro_batch.sequences``) scored at the
    temperature the engine sampled them at (``rollout.temperature``: the policy, the
    reference and the behaviour log-probs are all of ``softmax(logits / T)``), with the engine's
    expert routing when it is replayed (``algorithm.router_replay: rollout``) or, in the
    forward before the update (``counts``), compared with the trainer's own.

    Raises:
        ValueError: routing replay on, and a rollout without its engine's routing.
    """
    rollouts = [batch.rollouts[i] for i in rows]
    layout = sequences(batch.prompts, rollouts, pad_id, device, cfg.rollout.temperature)
    replay = cfg.algorithm.router_replay == "rollout"
    records = [r.routed_experts for r in rollouts]
    if replay and any(record is None for record in records):
        missing = rows[records.index(None)]
        raise ValueError(
            f"rollout {missing} of the batch carries no expert routing, which "
            "algorithm.router_replay=rollout replays: the engine must record it (the HF "
            "engine does for MoE models; vLLM with enable_return_routed_experts) and the "
            "model must be a GPT-OSS MoE"
        )
    if replay or (counts is not None and all(record is not None for record in records)):
        with_routing(layout, batch.prompts, rollouts, replay, counts)
    return layout


CORRECTION_MEANS = (
    "importance_ratio_mean",
    "tis_clipped_fraction",
    "seq_masked_fraction",
)
"""The rollout correction's token means logged each step (with ``importance_ratio_max``)."""


def _correction(cfg: GRPOConfig, stale: bool) -> str:
    """The rollout correction of a step: ``algorithm.rollout_correction``, or when unset
    ``token_tis`` for stale rollouts and ``none`` for on-policy ones."""
    chosen = cfg.algorithm.rollout_correction
    if chosen is not None:
        return chosen
    return "token_tis" if stale else "none"


def _policy_loss_settings(
    cfg: GRPOConfig, normalizer: float, correction: str
) -> algo.PolicyLossSettings:
    """``algorithm``'s clipping, aggregation and rollout-correction settings of the policy
    loss, normalized by ``normalizer`` (the mini-batch's, summed over the replicas)."""
    a = cfg.algorithm
    return algo.PolicyLossSettings(
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        norm_length=cfg.rollout.max_new_tokens,
        global_normalizer=normalizer,
        correction=correction,
        tis_cap=a.tis_cap,
        seq_mask_low=a.seq_mask_low,
        seq_mask_high=a.seq_mask_high,
    )


def _loss_fn(
    cfg: GRPOConfig,
    batch: Batch,
    micros: list[list[int]],
    masks: list[torch.Tensor],
    normalizer: float,
    old_log_probs: list[torch.Tensor],
    ref_log_probs: list[torch.Tensor] | None,
    device,
    behaviour: list[torch.Tensor] | None = None,
    correction: str = "none",
    measured: list[torch.Tensor] | None = None,
) -> LossFn:
    """The loss of micro-batch ``k`` of a mini-batch (its share of the global loss) and its
    statistics, from its log-probs and entropies; ``old_log_probs`` empty: the proximal
    policy is the current one; ``behaviour``: each micro-batch's sampling log-probs, for the
    decoupled loss with ``correction``; ``measured``: each micro-batch's response mask, when
    this forward is the one before the update: the micro-batch's mismatch is measured here and
    returned with its statistics (``"mismatch"``, a ``MismatchMeter``), which every backend
    brings back to every rank (Megatron runs the loss on the last pipeline stage only)."""
    a = cfg.algorithm
    # algorithm.policy_loss; with the engine's log-probs recorded (behaviour), each loss
    # corrects for the engine's policy (ppo_clip: the decoupled loss)
    policy_loss = algo.get_policy_loss(a.policy_loss)
    settings = _policy_loss_settings(cfg, normalizer, correction)

    def loss(k: int, log_probs: torch.Tensor, entropy: torch.Tensor):
        micro, mask = micros[k], masks[k]
        if not old_log_probs:
            old = log_probs.detach()
        else:
            old = _gather_old(old_log_probs, micro, cfg.micro_batch_size, log_probs.shape[1])
        advantages = batch.advantages[micro].to(device)
        sampled = behaviour[k] if behaviour is not None else None
        inputs = algo.PolicyLossInputs(log_probs, old, sampled, advantages, mask)
        total, pstats = policy_loss(inputs, settings)
        if ref_log_probs is not None:
            kl = algo.kl_loss(
                log_probs,
                ref_log_probs[k],
                mask,
                a.kl_estimator,
                a.loss_agg_mode,
                norm_length=cfg.rollout.max_new_tokens,
                global_normalizer=normalizer,
            )
            total = total + a.kl_loss_coef * kl
            kl_value = float(kl.detach())
        else:  # KL to the rollout policy (k1), as a drift indicator
            kl_value = float(pstats["approx_kl"]) * float(mask.sum()) / normalizer
        ent = algo.aggregate_loss(
            entropy,
            mask,
            a.loss_agg_mode,
            norm_length=cfg.rollout.max_new_tokens,
            global_normalizer=normalizer,
        )
        if a.entropy_coeff:
            total = total - a.entropy_coeff * ent
        out = {
            "loss": float(total.detach()),
            "entropy": float(ent.detach()),
            "kl": kl_value,
            "clipped_tokens": float(pstats["clip_fraction"]) * float(mask.sum()),
        }
        if behaviour is not None:  # token sums and the max, over the micro-batch's mask
            tokens = float(mask.sum())
            for key in CORRECTION_MEANS:
                out[key] = float(pstats[key]) * tokens
            out["importance_ratio_max"] = float(pstats["importance_ratio_max"])
        if measured is not None:
            meter = MismatchMeter(a.seq_mask_low, a.seq_mask_high)
            meter.add(old, behaviour[k], measured[k])
            out["mismatch"] = meter
        return total, out

    return loss


def _behaviour_block(batch: Batch, micro: list[int], width: int) -> torch.Tensor:
    """The engine's log-probs of the samples ``micro`` as a [len(micro), width] block,
    right-aligned as their layout (``micro_batch.sequences``)."""
    rows = []
    for i in micro:
        if batch.rollouts[i].log_probs is None:
            raise ValueError(
                f"rollout {i} of the batch has no behaviour log-probs: the engine must record "
                "them for a rollout correction or an off-policy update (rollout.async_steps)"
            )
        rows.append(torch.tensor(batch.rollouts[i].log_probs, dtype=torch.float32))
    return _right_aligned(rows, width)


def _gather_old(
    old_log_probs: list[torch.Tensor], micro: list[int], size: int, width: int
) -> torch.Tensor:
    """Old log-probs of the samples ``micro`` as a [len(micro), width] right-aligned block."""
    return _right_aligned([old_log_probs[i // size][i % size] for i in micro], width)


def _right_aligned(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """``rows`` as a [len(rows), width] block with each row's last value in the last column:
    a longer row keeps its last ``width`` values, a shorter one is padded with 0 before."""
    return torch.stack(
        [torch.nn.functional.pad(row[-width:], (width - min(len(row), width), 0)) for row in rows]
    )


def reward_metrics(batch: Batch, dp: DataParallel) -> dict:
    """The step's reward and language metrics, means over every replica's samples."""
    n = dp.all_reduce_sum(float(len(batch.results)))

    def mean(values) -> float:
        return dp.all_reduce_sum(float(sum(values))) / max(1.0, n)

    return {
        "mean_reward": mean(batch.rewards.tolist()),
        "answer_language_accuracy": mean(r.answer_verdict == Verdict.MATCH for r in batch.results),
        "reasoning_language_accuracy": mean(
            r.reasoning_verdict == Verdict.MATCH for r in batch.results
        ),
        # both languages right: the share the ODH SDK shows for GRPO as full_match_rate
        "full_match_rate": mean(both_languages_match(r) for r in batch.results),
        "response_length_mean": mean(len(r.response_ids) for r in batch.rollouts),
        "finished_fraction": mean(r.finished for r in batch.rollouts),
        "no_signal_fraction": mean((1.0 - batch.keep).tolist()),
    }
