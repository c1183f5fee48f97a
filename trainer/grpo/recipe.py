"""The GRPO recipe: sample groups → reward → group advantages → clipped policy update → sync.

Reads top to bottom; the rollout engine, training backend, reward and metrics writer are built
here and passed along. Runs as one process or as every rank of a ``torchrun`` job (each rank
samples its share of the prompts; advantages are per group, so they stay local; loss
normalizers are summed over ranks so N processes follow the single-process run).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from eval.adapters import LanguageComplianceReward
from eval.degeneracy import measure_degeneracy
from eval.modeling import (
    cache_keyword,
    load_causal_lm,
    load_tokenizer,
    output_cache,
    resolve_dtype,
)
from eval.scoring import ComplianceScorer, RewardWeights, Verdict
from eval.seeds import group_seeds
from eval.tracking import log_artifact, mlflow_run
from trainer.backends import (
    DataParallel,
    LossFn,
    TrainingBackend,
    deepspeed_config,
    make_backend,
)
from trainer.checkpoint import model_fingerprint, resume, save_checkpoint
from trainer.distributed import (
    DistInfo,
    all_reduce_max,
    barrier,
    broadcast_object,
    init_distributed,
    seed_everything,
)
from trainer.divergence import DivergenceGuard
from trainer.grpo import algorithm as algo
from trainer.grpo.config import GRPOConfig
from trainer.grpo.prompts import Prompt, load_prompts, step_prompts
from trainer.grpo.rollout import HFRolloutEngine, Rollout, generate_share
from trainer.grpo.sync_check import (
    SyncProbe,
    check_sync,
    max_abs_diff,
    sync_probe,
    sync_tolerance,
)
from trainer.metrics import METRICS_FILE, MetricsWriter, plot_metrics
from trainer.placement import (
    ParallelLayout,
    PlacementError,
    PlacementPlan,
    grpo_layout,
    grpo_placement,
    plan_placement,
)
from trainer.zero3 import gather_windows, load_partitioned

log = logging.getLogger(__name__)

SUMMARY_FILE = "grpo_summary.json"
BEST_DIR = "best_policy"


@dataclass
class GRPOResult:
    """What a GRPO run produced (rank 0)."""

    model_dir: str
    metrics_file: str
    plot: str | None
    steps: int
    baseline: dict
    final: dict
    exported: dict
    """The held-out metrics of the exported policy (best under the guard, or the last)."""
    exported_step: int


@dataclass
class _Batch:
    """The rollouts of one step on this rank, with everything the update needs."""

    prompts: list[Prompt]
    rollouts: list[Rollout]
    rewards: torch.Tensor
    advantages: torch.Tensor
    keep: torch.Tensor
    """1 for samples in groups with signal (or all, when filtering is off), else 0."""
    results: list


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def evaluate_policy(
    engine, tokenizer, prompts: list[Prompt], scorer, samples: int, seed: int
) -> dict:
    """Held-out metrics: mean reward, language accuracies, and text degeneracy.

    Every evaluation draws the same seeds (common random numbers: policies are compared on
    the same draws), one per (held-out prompt, sample).
    """
    seeds = group_seeds(seed, "held-out", range(len(prompts)), samples)
    rollouts = engine.generate([p.ids for p in prompts], seeds)
    texts = [_decode(tokenizer, r.response_ids) for r in rollouts]
    results = scorer.score_batch(texts, [prompts[r.prompt_index].label for r in rollouts])
    shares, repeats = [], []
    for result in results:
        language = result.labels.answer if result.labels else "en"
        measured = measure_degeneracy(result.parsed.reasoning, result.parsed.final, language)
        if not math.isnan(measured.real_word_share):
            shares.append(measured.real_word_share)
        if not math.isnan(measured.repeated_ngram_rate):
            repeats.append(measured.repeated_ngram_rate)
    out = {
        "mean_reward": float(np.mean([r.reward for r in results])),
        "answer_language_accuracy": float(
            np.mean([r.answer_verdict == Verdict.MATCH for r in results])
        ),
        "reasoning_language_accuracy": float(
            np.mean([r.reasoning_verdict == Verdict.MATCH for r in results])
        ),
        "both_language_accuracy": float(np.mean([_both_ok(r) for r in results])),
        "real_word_share": float(np.mean(shares)) if shares else 0.0,
        "repeated_ngram_rate": float(np.mean(repeats)) if repeats else 0.0,
        "finished_fraction": float(np.mean([r.finished for r in rollouts])),
    }
    # per language of the prompt (its reasoning label): where the policy gains or loses
    by_language: dict[str, list] = {}
    for result in results:
        if result.labels is not None:
            by_language.setdefault(result.labels.reasoning, []).append(result)
    for language in sorted(by_language):
        group = by_language[language]
        out[f"mean_reward_{language}"] = float(np.mean([r.reward for r in group]))
        out[f"both_language_accuracy_{language}"] = float(np.mean([_both_ok(r) for r in group]))
    return out


def _both_ok(result) -> bool:
    """Reasoning and answer both in their requested languages."""
    return result.answer_verdict == Verdict.MATCH and result.reasoning_verdict == Verdict.MATCH


@dataclass
class _Micro:
    """A micro-batch laid out for the update.

    Rows are right-aligned so that every response ends in the last column: the LM head only
    runs on the last ``width + 1`` positions. ``shared`` holds the same rows split into their
    distinct prompts and their responses, for ``_log_probs`` to run each prompt once per
    group (see ``_SharedPrefix``).
    """

    ids: torch.Tensor
    attention: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    """[B, width]: 1 on the response tokens (the targets of the kept logits)."""
    shared: _SharedPrefix | None = None

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def hf_log_probs(self, module, with_entropy: bool):
        """The ``ResponseBatch`` forward of the PyTorch and DeepSpeed backends."""
        return _log_probs(module, self, with_entropy)


@dataclass
class _SharedPrefix:
    """The micro-batch as U distinct prompts (left-padded) and B responses (left-aligned).

    The prompts run once, with their KV cache; the cache is indexed out to the B rows
    (``row_prompt``) and the responses run on top of it. Autograd flows through the indexing,
    so each prompt's activations get the summed gradient of its group: the same log-probs and
    gradients as the full rows, for a fraction of the prompt compute.
    """

    prompt_ids: torch.Tensor
    prompt_attention: torch.Tensor
    prompt_positions: torch.Tensor
    prompt_lengths: torch.Tensor
    row_prompt: torch.Tensor
    """[B]: each row's prompt, an index into the U prompts."""
    response_ids: torch.Tensor
    """[B, width], left-aligned, padded."""
    response_lengths: torch.Tensor


def _sequences(prompts: list[Prompt], rollouts: list[Rollout], pad_id: int, device) -> _Micro:
    rows = [prompts[r.prompt_index].ids + r.response_ids for r in rollouts]
    total = max(len(r) for r in rows)
    width = max(1, max(len(r.response_ids) for r in rollouts))
    ids = torch.full((len(rows), total), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), total), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (row, rollout) in enumerate(zip(rows, rollouts, strict=True)):
        ids[i, total - len(row) :] = torch.tensor(row)
        attention[i, total - len(row) :] = 1
        if rollout.response_ids:
            mask[i, width - len(rollout.response_ids) :] = 1.0
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    micro = _Micro(ids.to(device), attention.to(device), positions.to(device), mask.to(device))
    distinct = sorted({r.prompt_index for r in rollouts})
    if len(distinct) < len(rollouts):  # some rows share a prompt
        micro.shared = _shared_prefix(prompts, rollouts, distinct, width, pad_id, device)
    return micro


def _shared_prefix(prompts, rollouts, distinct, width, pad_id, device) -> _SharedPrefix:
    slot = {index: k for k, index in enumerate(distinct)}
    prompt_width = max(len(prompts[i].ids) for i in distinct)
    prompt_ids = torch.full((len(distinct), prompt_width), pad_id, dtype=torch.long)
    prompt_attention = torch.zeros((len(distinct), prompt_width), dtype=torch.long)
    for k, index in enumerate(distinct):  # left padding: every prompt ends in the last column
        row = prompts[index].ids
        prompt_ids[k, prompt_width - len(row) :] = torch.tensor(row)
        prompt_attention[k, prompt_width - len(row) :] = 1
    response_ids = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    for i, rollout in enumerate(rollouts):
        if rollout.response_ids:
            response_ids[i, : len(rollout.response_ids)] = torch.tensor(rollout.response_ids)
    return _SharedPrefix(
        prompt_ids=prompt_ids.to(device),
        prompt_attention=prompt_attention.to(device),
        prompt_positions=(prompt_attention.cumsum(-1) - 1).clamp(min=0).to(device),
        prompt_lengths=prompt_attention.sum(-1).to(device),
        row_prompt=torch.tensor([slot[r.prompt_index] for r in rollouts], device=device),
        response_ids=response_ids.to(device),
        response_lengths=torch.tensor([len(r.response_ids) for r in rollouts], device=device),
    )


def _log_probs(module, micro: _Micro, with_entropy: bool):
    """Log-probs (and entropies) of the last ``width`` tokens, from the last logits only.

    Rows that share a prompt run it once (``_shared_prefix_logits``) unless the model uses
    gradient checkpointing, which turns the KV cache off in training, or, with gradients, is
    partitioned by ZeRO-3: the prompt's backward comes after the responses' backward through
    every layer, so autograd holds each parameter's whole gradient (and DeepSpeed its gathered
    weights) until then, a whole model's worth on every rank.
    """
    shared = micro.shared is not None and not getattr(module, "is_gradient_checkpointing", False)
    if shared and torch.is_grad_enabled() and _zero3_partitioned(module):
        shared = False
    if shared:
        logits = _shared_prefix_logits(module, micro.shared)
        targets = micro.shared.response_ids
        log_probs = _right_align(algo.token_log_probs(logits, targets), micro.shared)
        entropy = None
        if with_entropy:
            entropy = _right_align(algo.entropy_from_logits(logits), micro.shared)
        return log_probs, entropy
    logits = module(
        input_ids=micro.ids,
        attention_mask=micro.attention,
        position_ids=micro.positions,
        logits_to_keep=micro.width + 1,
    ).logits[:, :-1, :]
    log_probs = algo.token_log_probs(logits, micro.ids[:, -micro.width :])
    entropy = algo.entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


def _zero3_partitioned(module) -> bool:
    """Whether ``module``'s parameters are partitioned by DeepSpeed ZeRO-3 (they carry a
    ``ds_id``)."""
    return hasattr(next(module.parameters()), "ds_id")


def _shared_prefix_logits(module, shared: _SharedPrefix) -> torch.Tensor:
    """[B, width, V]: the logits that predict each response token (left-aligned)."""
    prefill = module(
        input_ids=shared.prompt_ids,
        attention_mask=shared.prompt_attention,
        position_ids=shared.prompt_positions,
        use_cache=True,
        logits_to_keep=1,
    )
    first = prefill.logits[shared.row_prompt, -1:, :]  # predicts each response's first token
    width = shared.response_ids.shape[1]
    if width == 1:
        return first
    cache = output_cache(prefill)
    cache.batch_select_indices(shared.row_prompt)  # differentiable: gradients sum per prompt
    steps = torch.arange(width - 1, device=shared.response_ids.device)
    response_valid = (steps[None, :] < shared.response_lengths[:, None]).long()
    rest = module(
        input_ids=shared.response_ids[:, :-1],
        attention_mask=torch.cat(
            [shared.prompt_attention[shared.row_prompt], response_valid], dim=1
        ),
        position_ids=shared.prompt_lengths[shared.row_prompt, None] + steps[None, :],
        use_cache=True,
        **{cache_keyword(module): cache},
    ).logits
    return torch.cat([first, rest], dim=1)


def _right_align(values: torch.Tensor, shared: _SharedPrefix) -> torch.Tensor:
    """Left-aligned [B, width] values moved so that each row's last response token is in the
    last column (the layout of ``_Micro.mask``); columns before a row's response are 0."""
    width = values.shape[1]
    source = torch.arange(width, device=values.device)[None, :] - (
        width - shared.response_lengths[:, None]
    )
    valid = source >= 0
    return torch.gather(values, 1, source.clamp(min=0)) * valid


def run_grpo(
    cfg: GRPOConfig,
    sft_model: str | Path,
    train_path: str | Path,
    eval_path: str | Path,
    model_output: str | Path,
    work_dir: str | Path,
) -> GRPOResult | None:
    """Train the policy from the SFT model; returns the result on rank 0 (None elsewhere)."""
    info = init_distributed(cfg.device, cfg.cpu_threads)
    work_dir, model_output = Path(work_dir), Path(model_output)
    seed_everything(cfg.seed)
    plan = run_placement(cfg, info)
    if plan.rollout_only_ranks:  # dedicated engines: one training process drives them
        if info.rank in plan.rollout_only_ranks:
            _serve_rollouts(cfg, sft_model, plan, info)
            return None
        remote = _remote_engines(cfg, plan, info)
        info = DistInfo(0, 1, info.local_rank, info.device)  # the training side alone
        with contextlib.closing(remote):
            return _train(
                cfg, sft_model, train_path, eval_path, model_output, work_dir, info, plan, remote
            )
    return _train(cfg, sft_model, train_path, eval_path, model_output, work_dir, info, plan)


def _remote_engines(cfg: GRPOConfig, plan: PlacementPlan, info: DistInfo):
    from trainer.grpo.remote import RemoteRolloutEngine

    return RemoteRolloutEngine(
        [engine.ranks[0] for engine in plan.engines],
        None,
        info.device,
        cfg.rollout.sync_bucket_mb << 20,
    )


def _train(
    cfg: GRPOConfig,
    sft_model: str | Path,
    train_path: str | Path,
    eval_path: str | Path,
    model_output: Path,
    work_dir: Path,
    info: DistInfo,
    plan: PlacementPlan,
    remote=None,
) -> GRPOResult | None:
    """The training processes' part of ``run_grpo`` (``remote``: the dedicated engines)."""
    tokenizer = load_tokenizer(sft_model)
    dtype = resolve_dtype(cfg.dtype, info.device)
    ds_config = None
    if cfg.optim.backend == "deepspeed":
        # one configuration for the partitioned load and deepspeed.initialize
        ds_config = deepspeed_config(
            cfg.optim,
            info.device,
            cfg.micro_batch_size,
            _micro_per_mini(cfg, info),
            bf16=dtype == torch.bfloat16,
            zero_settings=gather_windows(sft_model, info.world_size) if _zero3(cfg) else None,
        )
    if _zero3(cfg):  # built partitioned: no rank ever holds the whole model
        policy = load_partitioned(sft_model, dtype, ds_config, info.device)
    else:
        policy = load_causal_lm(sft_model, dtype, info.device)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    limit, kept = cfg.rollout.max_prompt_tokens, cfg.prompt_filter
    train_prompts = load_prompts(train_path, tokenizer, limit, kept)
    eval_prompts = load_prompts(eval_path, tokenizer, limit, kept)[: cfg.eval_prompts]
    if len(train_prompts) < cfg.prompts_per_step:
        raise ValueError(
            f"{train_path}: {len(train_prompts)} unique prompts, fewer than prompts_per_step "
            f"{cfg.prompts_per_step}"
        )
    scorer = ComplianceScorer(weights=RewardWeights(**cfg.reward_weights))
    reward_fn = LanguageComplianceReward(scorer)

    backend = make_backend(
        policy,
        cfg.optim,
        cfg.max_steps * cfg.algorithm.ppo_epochs * _mini_batches(cfg),
        info,
        cfg.micro_batch_size,
        _micro_per_mini(cfg, info),
        bf16=dtype == torch.bfloat16,
        with_reference=cfg.algorithm.kl_loss_coef > 0,
        hf_dir=sft_model,
        ds_config=ds_config,
        seed=cfg.seed,
        pad_id=tokenizer.pad_token_id,
    )
    if cfg.optim.backend == "megatron":
        policy.requires_grad_(False)
    dp = backend.data_parallel
    per_rank = cfg.prompts_per_step // dp.size
    # the HF engine samples with the trained module itself (under ZeRO-3 partitioned, every
    # rank stepping in lockstep); Megatron trains its own model, so the HF policy is a copy
    rollout_model = backend.unwrapped() if cfg.optim.backend == "deepspeed" else policy
    engine = remote or _rollout_engine(cfg, rollout_model, tokenizer, sft_model, plan, info)
    # the ranks whose prompts this rank's engine generates (all of a vLLM engine's workers)
    vllm_group = plan.engine_of(info.rank) if cfg.rollout.engine == "vllm" else None
    share = vllm_group.ranks if vllm_group else (dp.rank,)

    checkpoints = work_dir / "checkpoints"
    run_config = {**cfg.model_dump(mode="json"), "model": model_fingerprint(sft_model)}
    state = resume(checkpoints, backend, info, run_config) or {"step": 0}
    start_step = state["step"]
    probe_from = eval_prompts or train_prompts
    probe = sync_probe([p.ids for p in probe_from], cfg.rollout.sync_check_tokens)
    tolerance = sync_tolerance(cfg.rollout.sync_check_tolerance, dtype)
    pad_id = tokenizer.pad_token_id
    diff = _sync(engine, backend, probe, tolerance, pad_id, info, start_step)
    if diff is not None:
        log.info("weight sync check at step %d: %.3g (tolerance %.3g)", start_step, diff, tolerance)

    with mlflow_run("grpo", cfg.model_dump(), info.is_main) as run, contextlib.closing(backend):
        # GRPO plans steps, not epochs: the run is one planned epoch (``epoch`` 0 … 1)
        writer = MetricsWriter(
            work_dir / METRICS_FILE, cfg.max_steps, 1.0, info.is_main, start_step, run
        )
        if "baseline" not in state:
            state["baseline"] = evaluate_policy(
                engine, tokenizer, eval_prompts, scorer, cfg.eval_samples, cfg.seed
            )
            state["best"] = {"step": 0, **state["baseline"]}
            writer.log(0, **{f"eval_{k}": v for k, v in state["baseline"].items()})
            _save_policy(backend, tokenizer, work_dir / BEST_DIR, dtype, sft_model, info)
        guard = DivergenceGuard("GRPO", checkpoints, info, cfg.optim.max_zero_grad_steps)
        progress = tqdm(
            total=cfg.max_steps,
            initial=start_step,
            desc="grpo",
            mininterval=2.0,
            disable=not info.is_main,
        )
        for step in range(start_step, cfg.max_steps):
            done = step + 1
            chosen = [
                train_prompts[i]
                for i in step_prompts(train_prompts, step, cfg.prompts_per_step, cfg.seed)
            ]
            mine = chosen[dp.rank * per_rank : (dp.rank + 1) * per_rank]

            started = time.monotonic()
            # one seed per (step, slot of the step's batch, sample): the same on every rank
            # and every layout, never shared by two responses
            seeds = group_seeds(cfg.seed, step, range(len(chosen)), cfg.rollout.n_samples)
            rollouts = generate_share(
                engine, [p.ids for p in chosen], seeds, share, dp.rank, per_rank
            )
            batch = _score(cfg, tokenizer, reward_fn, mine, rollouts)
            rollout_time = time.monotonic() - started
            started = time.monotonic()
            if hasattr(engine, "sleep"):
                engine.sleep()  # colocated vLLM frees the GPU for the update
            stats = _update(cfg, backend, batch, tokenizer.pad_token_id, step)
            train_time = time.monotonic() - started
            # before anything from this step is saved (checkpoint, best policy, export)
            signal = dp.all_reduce_sum(float(batch.keep.sum())) > 0
            guard.check(done, stats["loss"], stats["grad_norm"], backend.module, signal)
            diff = _sync(engine, backend, probe, tolerance, pad_id, info, done)
            sync = {} if diff is None else {"sync_logprob_max_diff": diff}

            tokens = dp.all_reduce_sum(float(sum(len(r.response_ids) for r in batch.rollouts)))
            writer.log(
                done,
                data_passes=round(done * cfg.prompts_per_step / len(train_prompts), 4),
                **stats,
                **_reward_metrics(batch, dp),
                rollout_time_s=rollout_time,
                train_time_s=train_time,
                tokens_per_s=tokens / max(1e-9, rollout_time + train_time),
                **sync,
            )
            progress.update(1)
            progress.set_postfix(reward=f"{float(batch.rewards.mean()):.2f}")
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.max_steps):
                held_out = evaluate_policy(
                    engine, tokenizer, eval_prompts, scorer, cfg.eval_samples, cfg.seed
                )
                # merged onto this step's line: the last line always carries the train loss
                writer.log(done, **{f"eval_{k}": v for k, v in held_out.items()})
                state["last_eval"] = {"step": done, **held_out}
                # rank 0 decides for all: every rank must take part in the save (ZeRO-3 gathers)
                if broadcast_object(_better(cfg, held_out, state["baseline"], state["best"]), info):
                    state["best"] = {"step": done, **held_out}
                    _save_policy(backend, tokenizer, work_dir / BEST_DIR, dtype, sft_model, info)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                save_checkpoint(
                    checkpoints, done, backend, state, info, cfg.max_ckpt_num, run_config
                )
        progress.close()

        final_dir = work_dir / "final_policy"
        _save_policy(backend, tokenizer, final_dir, dtype, sft_model, info)
        if not info.is_main:
            return None
        use_best = cfg.guard.keep_best and (work_dir / BEST_DIR).exists()
        exported = state["best"] if use_best else state.get("last_eval", state["baseline"])
        source = work_dir / BEST_DIR if use_best else final_dir
        _export(source, model_output)
        plot = plot_metrics(
            work_dir / METRICS_FILE,
            work_dir / "grpo.png",
            ["mean_reward", "eval_mean_reward", "eval_real_word_share", "loss", "kl", "entropy"],
            "GRPO",
        )
        result = GRPOResult(
            model_dir=str(model_output),
            metrics_file=str(work_dir / METRICS_FILE),
            plot=str(plot) if plot else None,
            steps=cfg.max_steps,
            baseline=state["baseline"],
            final=state.get("last_eval", state["baseline"]),
            exported=exported,
            exported_step=exported.get("step", 0),
        )
        (work_dir / SUMMARY_FILE).write_text(json.dumps(asdict(result), indent=2))
        if run is not None and plot:
            log_artifact(plot)
        return result


def run_placement(cfg: GRPOConfig, info) -> PlacementPlan:
    """This run's placement plan, from torchrun's world (``LOCAL_WORLD_SIZE`` processes a
    node), checked against where this process actually is.

    Colocated: every process trains (and runs or shares an engine). Dedicated
    (``rollout.colocate=false``): the last ``num_engines × tensor_parallel_size`` processes
    of the job are rollout-only, the rest train.

    Raises:
        PlacementError: dedicated engines that this recipe cannot run yet (more than one
            training process), a world too small for them, Megatron with
            multi-process vLLM, or a plan that puts this process on another device than
            torchrun did.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    rollout = cfg.rollout
    vllm = rollout.engine == "vllm"
    if not rollout.colocate:
        engine_processes = rollout.num_engines * (rollout.tensor_parallel_size if vllm else 1)
        training = info.world_size - engine_processes
        problems = []
        if cfg.optim.backend != "torch":
            problems.append(
                f"optim.backend={cfg.optim.backend} with dedicated engines is not built yet "
                "(its process group would take in the rollout-only processes); use "
                "optim.backend=torch (one training process)"
            )
        if training != 1:
            problems.append(
                f"{info.world_size} processes for {engine_processes} rollout-only processes "
                f"leave {training} training processes; dedicated engines run with exactly "
                f"one training process for now: start {engine_processes + 1} processes "
                "(torchrun --nproc-per-node), or set rollout.colocate=true"
            )
        if problems:
            raise PlacementError("; ".join(problems))
        return plan_placement(max(1, info.world_size // local), local, grpo_layout(cfg, training))
    if vllm and info.world_size > 1 and cfg.optim.backend == "megatron":
        raise PlacementError(
            "rollout.engine=vllm with backend=megatron on several processes: the engines' "
            "prompt shares follow data-parallel ranks, which Megatron numbers differently; "
            "use rollout.engine=hf"
        )
    if info.world_size == 1:
        # one process: vLLM starts its own tensor-parallel workers on the visible GPUs
        return plan_placement(1, 1, ParallelLayout())
    plan = grpo_placement(cfg, info.world_size // local, local)
    mine = plan.processes[info.rank]
    expected = (info.rank // local, info.local_rank)
    if (mine.device.node, mine.device.local_gpu) != expected:
        raise PlacementError(
            f"rank {info.rank}: the plan puts it on {mine.device}, torchrun on node "
            f"{expected[0]} gpu {expected[1]}"
        )
    return plan


def _serve_rollouts(cfg: GRPOConfig, sft_model, plan: PlacementPlan, info: DistInfo) -> None:
    """A rollout-only process: load the SFT model as its engine, answer the coordinator
    (``trainer.grpo.remote.serve``) until the run ends. A vLLM engine runs in processes of
    its own, started by the engine's first rank (``trainer.grpo.vllm_dedicated``); its other
    ranks only follow."""
    from trainer.grpo.remote import EngineFollower, serve

    engine_placement = plan.engine_of(info.rank)
    tokenizer = load_tokenizer(sft_model)
    dtype = resolve_dtype(cfg.dtype, info.device)
    if cfg.rollout.engine == "vllm" and info.rank != engine_placement.ranks[0]:
        engine = EngineFollower()
    elif cfg.rollout.engine == "vllm":
        from trainer.grpo.vllm_dedicated import DedicatedVLLMEngine

        engine = DedicatedVLLMEngine(
            str(sft_model),
            tokenizer,
            cfg.rollout,
            cfg.seed,
            engine_placement,
            dtype=str(dtype).removeprefix("torch."),
            bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
        )
    else:
        model = load_causal_lm(sft_model, dtype, info.device)
        engine = HFRolloutEngine(model.requires_grad_(False), tokenizer, cfg.rollout)
    log.info(
        "rank %d: rollout engine %d of %d on %s",
        info.rank,
        engine_placement.index,
        len(plan.engines),
        info.device,
    )
    serve(engine, engine_placement.index, len(plan.engines), None, info.device)


def _rollout_engine(cfg: GRPOConfig, model, tokenizer, sft_model, plan: PlacementPlan, info):
    """HF generate on ``model`` (the trained module itself: nothing to sync), or the
    vLLM engine this process is a worker of in ``plan`` (on its own GPU, with the other
    ranks of its engine), in the policy's dtype."""
    if cfg.rollout.engine == "vllm":
        from trainer.grpo.rollout import VLLMRolloutEngine

        engine = plan.engine_of(info.rank) if info.world_size > 1 else None
        return VLLMRolloutEngine(
            str(sft_model),
            tokenizer,
            cfg.rollout,
            cfg.seed,
            engine,
            info.world_size,
            rank=info.rank,
            dtype=str(resolve_dtype(cfg.dtype, info.device)).removeprefix("torch."),
            sleep_mode=cfg.rollout.colocate and info.device.type == "cuda",
        )
    lockstep = _zero3(cfg) and info.world_size > 1
    return HFRolloutEngine(model, tokenizer, cfg.rollout, lockstep=lockstep)


def _zero3(cfg: GRPOConfig) -> bool:
    return cfg.optim.backend == "deepspeed" and cfg.optim.zero_stage == 3


def _sync(
    engine,
    backend: TrainingBackend,
    probe: SyncProbe,
    tolerance: float,
    pad_id: int,
    info: DistInfo,
    step: int,
) -> float | None:
    """Push the policy's weights to an engine that does not share them (streamed by name),
    then check that it took them: the largest per-token difference between the engine's and
    the policy's log-probs of ``probe`` over all processes (None: the engine is the policy).

    Raises:
        WeightSyncError: the difference is past ``tolerance``.
    """
    if isinstance(engine, HFRolloutEngine) and engine.model is backend.unwrapped():
        return None
    engine.sync_weights(backend.hf_weights())
    micro = _sequences(
        [Prompt(probe.prompt, "", "")],
        [Rollout(0, probe.response, True)],
        pad_id,
        backend.data_parallel.device,
    )
    policy = backend.log_probs([micro])[0][0, -len(probe.response) :].float().tolist()
    if hasattr(engine, "token_log_probs_per_engine"):  # dedicated engines: each its own copy
        served = engine.token_log_probs_per_engine(probe.prompt, probe.response)
    else:
        served = [engine.token_log_probs(probe.prompt, probe.response)]
    diff = all_reduce_max(max(max_abs_diff(s, policy) for s in served), info)
    return check_sync(diff, tolerance, step, type(engine).__name__)


def _mini_batches(cfg: GRPOConfig) -> int:
    return cfg.prompts_per_step * cfg.rollout.n_samples // cfg.mini_batch_size


def _micro_per_mini(cfg: GRPOConfig, info: DistInfo) -> int:
    """DeepSpeed's gradient accumulation steps (every process a data-parallel replica)."""
    return cfg.mini_batch_size // (cfg.micro_batch_size * info.world_size)


def _better(cfg: GRPOConfig, held_out: dict, baseline: dict, best: dict) -> bool:
    """A held-out result beats the best so far without its text degenerating (the guard)."""
    floor = (1.0 - cfg.guard.max_real_word_drop) * baseline["real_word_share"]
    return held_out["real_word_share"] >= floor and held_out["mean_reward"] > best["mean_reward"]


def _score(cfg: GRPOConfig, tokenizer, reward_fn, prompts, rollouts) -> _Batch:
    texts = [_decode(tokenizer, r.response_ids) for r in rollouts]
    scored = reward_fn(texts, [prompts[r.prompt_index].label for r in rollouts])
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    groups = torch.tensor([r.prompt_index for r in rollouts])
    advantages = algo.get_advantage_estimator(cfg.algorithm.advantage_estimator)(rewards, groups)
    stats = algo.group_stats(rewards, groups)
    no_signal = stats.all_equal[stats.index]
    keep = (
        (~no_signal).float() if cfg.algorithm.filter_no_signal_groups else torch.ones_like(rewards)
    )
    return _Batch(prompts, rollouts, rewards, advantages, keep, scored.results)


def _update(
    cfg: GRPOConfig, backend: TrainingBackend, batch: _Batch, pad_id: int, step: int
) -> dict:
    """PPO epochs over mini-batches of this step's rollouts; returns averaged statistics.

    The backend runs each mini-batch's forward and backward (``forward_backward``), calling
    the ``_loss_fn`` loss of each micro-batch with its log-probs; normalizers are summed over
    the data-parallel replicas, so every replica's loss is its share of the global one.
    """
    a = cfg.algorithm
    agg = algo.get_loss_agg_mode(a.loss_agg_mode)
    dp = backend.data_parallel
    n = len(batch.rollouts)
    local_mini = cfg.mini_batch_size // dp.size
    device = dp.device
    # one on-policy update: the old log-probs equal the current ones, so reuse them (detached)
    single_update = a.ppo_epochs == 1 and local_mini >= n
    old_log_probs: list[torch.Tensor] = []
    if not single_update:
        old_log_probs = backend.log_probs(
            [
                _sequences(
                    batch.prompts,
                    batch.rollouts[start : start + cfg.micro_batch_size],
                    pad_id,
                    device,
                )
                for start in range(0, n, cfg.micro_batch_size)
            ]
        )
    sums = {
        "loss": 0.0,
        "grad_norm": 0.0,
        "clip_fraction": 0.0,
        "entropy": 0.0,
        "kl": 0.0,
        "learning_rate": 0.0,
    }
    updates = 0
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
            layouts = [
                _sequences(batch.prompts, [batch.rollouts[i] for i in micro], pad_id, device)
                for micro in micros
            ]
            masks = [
                layout.mask * batch.keep[micro].to(device)[:, None]
                for layout, micro in zip(layouts, micros, strict=True)
            ]
            local_count = sum(float(agg.count(m)) for m in masks)
            normalizer = max(dp.all_reduce_sum(local_count), 1e-8)
            ref_log_probs = backend.log_probs(layouts, reference=True) if a.kl_loss_coef else None
            loss = _loss_fn(
                cfg, batch, micros, masks, normalizer, old_log_probs, ref_log_probs, device
            )
            micro_stats = backend.forward_backward(layouts, loss)
            mini_loss = mini_clip = mini_entropy = mini_kl = 0.0
            for stats in micro_stats:
                mini_loss += stats["loss"]
                mini_entropy += stats["entropy"]
                mini_kl += stats["kl"]
                mini_clip += stats["clipped_tokens"]
            sums["learning_rate"] += backend.learning_rate()
            sums["grad_norm"] += backend.step()
            sums["loss"] += dp.all_reduce_sum(mini_loss)
            sums["entropy"] += dp.all_reduce_sum(mini_entropy)
            sums["kl"] += dp.all_reduce_sum(mini_kl)
            masked_tokens = max(dp.all_reduce_sum(sum(float(m.sum()) for m in masks)), 1e-8)
            sums["clip_fraction"] += dp.all_reduce_sum(mini_clip) / masked_tokens
            updates += 1
    return {k: v / max(1, updates) for k, v in sums.items()}


def _loss_fn(
    cfg: GRPOConfig,
    batch: _Batch,
    micros: list[list[int]],
    masks: list[torch.Tensor],
    normalizer: float,
    old_log_probs: list[torch.Tensor],
    ref_log_probs: list[torch.Tensor] | None,
    device,
) -> LossFn:
    """The loss of micro-batch ``k`` of a mini-batch (its share of the global loss) and its
    statistics, from its log-probs and entropies; ``old_log_probs`` empty: on-policy."""
    a = cfg.algorithm

    def loss(k: int, log_probs: torch.Tensor, entropy: torch.Tensor):
        micro, mask = micros[k], masks[k]
        if not old_log_probs:
            old = log_probs.detach()
        else:
            old = _gather_old(old_log_probs, micro, cfg.micro_batch_size, log_probs.shape[1])
        total, pstats = algo.policy_loss(
            log_probs,
            old,
            batch.advantages[micro].to(device),
            mask,
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c,
            loss_agg_mode=a.loss_agg_mode,
            norm_length=cfg.rollout.max_new_tokens,
            global_normalizer=normalizer,
        )
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
        return total, {
            "loss": float(total.detach()),
            "entropy": float(ent.detach()),
            "kl": kl_value,
            "clipped_tokens": float(pstats["clip_fraction"]) * float(mask.sum()),
        }

    return loss


def _gather_old(
    old_log_probs: list[torch.Tensor], micro: list[int], size: int, width: int
) -> torch.Tensor:
    """Old log-probs of the samples ``micro`` as a [len(micro), width] right-aligned block."""
    rows = []
    for i in micro:
        row = old_log_probs[i // size][i % size]
        row = (
            row[-width:]
            if row.shape[0] >= width
            else torch.nn.functional.pad(row, (width - row.shape[0], 0))
        )
        rows.append(row)
    return torch.stack(rows)


def _reward_metrics(batch: _Batch, dp: DataParallel) -> dict:
    n = dp.all_reduce_sum(float(len(batch.results)))

    def mean(values) -> float:
        return dp.all_reduce_sum(float(sum(values))) / max(1.0, n)

    return {
        "mean_reward": mean(batch.rewards.tolist()),
        "answer_language_accuracy": mean(r.answer_verdict == Verdict.MATCH for r in batch.results),
        "reasoning_language_accuracy": mean(
            r.reasoning_verdict == Verdict.MATCH for r in batch.results
        ),
        "response_length_mean": mean(len(r.response_ids) for r in batch.rollouts),
        "finished_fraction": mean(r.finished for r in batch.rollouts),
        "no_signal_fraction": mean((1.0 - batch.keep).tolist()),
    }


def _save_policy(
    backend: TrainingBackend, tokenizer, directory: Path, dtype, base_model, info: DistInfo
) -> None:
    """The current policy as a HF directory (every rank takes part: ZeRO-3 gathers; rank 0
    writes), renamed into place when complete. The Megatron backend saves its own
    ``torch_dist`` checkpoint instead (``save_policy``), which the pipeline's ``export_hf``
    step turns into a HF directory."""
    tmp = directory.with_name(f".{directory.name}.partial")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(info)
    if hasattr(backend, "save_policy"):
        backend.save_policy(tmp)
    else:
        backend.save_hf_pretrained(tmp, base_model, dtype)
    if info.is_main:
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
    barrier(info)


def _export(source: Path, model_output: Path) -> None:
    tmp = model_output.with_name(f".{model_output.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    shutil.rmtree(model_output, ignore_errors=True)
    tmp.rename(model_output)


def read_summary(work_dir: str | Path) -> GRPOResult:
    """The result a (possibly torchrun) GRPO run left in ``work_dir``."""
    return GRPOResult(**json.loads((Path(work_dir) / SUMMARY_FILE).read_text()))
