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
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm

from core.atomic import check_output_dir, check_writable, discard_staging, publish_dir, staging_dir
from core.errors import names_write_failures
from core.modeling import (
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
)
from core.seeds import group_seeds
from core.tracking import log_artifact, mlflow_run
from reward.adapters import LanguageComplianceReward
from reward.degeneracy import measure_degeneracy
from reward.outcome import HeldOutResult, Outcome
from reward.scoring import ComplianceScorer, RewardWeights, Verdict
from trainer.backends import (
    DataParallel,
    LossFn,
    TrainingBackend,
    make_backend,
)
from trainer.backends.loading import load_training_model
from trainer.checkpoint import file_fingerprint, model_fingerprint, resume, save_checkpoint
from trainer.distributed import (
    DistInfo,
    all_reduce_max,
    barrier,
    broadcast_object,
    init_distributed,
    process_info,
    seed_everything,
)
from trainer.divergence import DivergenceGuard
from trainer.grpo import algorithm as algo
from trainer.grpo.config import GRPOConfig
from trainer.grpo.micro_batch import Micro, sequences, with_routing
from trainer.grpo.mismatch import MismatchGate, MismatchMeter
from trainer.grpo.producer import RolloutProducer, StepRollouts
from trainer.grpo.prompts import Prompt, load_prompts, step_prompts
from trainer.grpo.rollout import HFRolloutEngine, Rollout, keep_share, share_request
from trainer.grpo.routing import RouterCounts
from trainer.grpo.sync_check import (
    SyncCheck,
    SyncGap,
    SyncProbe,
    SyncReport,
    sync_gap,
    sync_metrics,
    sync_probe,
    worst,
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
from trainer.progress import serve_progress

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
    baseline: HeldOutResult
    final: HeldOutResult
    exported: HeldOutResult
    """The held-out metrics of the exported policy (best under the guard, or the last)."""
    exported_step: int

    def to_json(self) -> dict:
        """The summary file's form (the held-out results flat, as ``HeldOutResult.to_json``)."""
        held_out = {k: getattr(self, k).to_json() for k in ("baseline", "final", "exported")}
        return asdict(self) | held_out

    @classmethod
    def from_json(cls, data: dict) -> GRPOResult:
        held_out = ("baseline", "final", "exported")
        return cls(
            **{k: HeldOutResult.from_json(v) if k in held_out else v for k, v in data.items()}
        )


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
) -> HeldOutResult:
    """Held-out metrics: mean reward, language accuracies, and text degeneracy.

    Every evaluation draws the same seeds (common random numbers: policies are compared on
    the same draws), one per (held-out prompt, sample).
    """
    seeds = group_seeds(seed, "held-out", range(len(prompts)), samples)
    rollouts = engine.generate([p.ids for p in prompts], seeds)
    texts = [_decode(tokenizer, r.response_ids) for r in rollouts]
    results = scorer.score_batch(texts, [prompts[r.prompt_index].label for r in rollouts])
    outcomes = []
    for result in results:  # per language of the prompt: its reasoning label
        language = result.labels.answer if result.labels else "en"
        measured = measure_degeneracy(result.parsed.reasoning, result.parsed.final, language)
        reasoning = result.labels.reasoning if result.labels else None
        outcomes.append(Outcome.scored(reasoning, result, measured))
    return HeldOutResult.from_outcomes(outcomes, [r.finished for r in rollouts])


def _both_ok(result) -> bool:
    """Reasoning and answer both in their requested languages."""
    return result.answer_verdict == Verdict.MATCH and result.reasoning_verdict == Verdict.MATCH


def run_grpo(
    cfg: GRPOConfig,
    sft_model: str | Path,
    train_path: str | Path,
    eval_path: str | Path,
    model_output: str | Path,
    work_dir: str | Path,
) -> GRPOResult | None:
    """Train the policy from the SFT model; returns the result on rank 0 (None elsewhere).

    With dedicated engines the job is split: the training processes' default group holds
    only them, and the coordinator (training rank 0) and the rollout-only processes talk
    over a ``Channel`` of their own (``trainer.grpo.remote``).
    """
    work_dir, model_output = Path(work_dir), Path(model_output)
    check_output_dir(model_output, "--model-output", work_dir=work_dir)
    check_writable(model_output.parent)  # a read-only or full disk, found before training
    job = process_info(cfg.device, cfg.cpu_threads)
    plan = run_placement(cfg, job)
    timeout = cfg.collective_timeout
    if not plan.rollout_only_ranks:
        info = init_distributed(cfg.device, cfg.cpu_threads, timeout=timeout)
        seed_everything(cfg.seed)
        return _train(cfg, sft_model, train_path, eval_path, model_output, work_dir, info, plan)
    from trainer.grpo import remote as dedicated

    store = dedicated.job_store(timeout)
    leads = [engine.ranks[0] for engine in plan.engines]
    channel, weights = dedicated.open_channels(
        store, plan.rollout_only_ranks, leads, job.rank, timeout
    )
    seed_everything(cfg.seed)
    start = timedelta(seconds=cfg.rollout.start_timeout_s)
    if job.rank in plan.rollout_only_ranks:
        engine = _rollout_only_engine(cfg, sft_model, plan, job)
        dedicated.announce_ready(store, job.rank)
        dedicated.wait_until_ready(store, [0], start, "the training coordinator")
        dedicated.serve(engine, plan.engine_of(job.rank).index, len(plan.engines), channel, weights)
        return None
    info = init_distributed(cfg.device, cfg.cpu_threads, plan.training_ranks, store, timeout)
    remote = None
    if channel is not None:
        bucket = cfg.rollout.sync_bucket_mb << 20
        remote = dedicated.RemoteRolloutEngine(leads, channel, bucket, weights)
    engines = dedicated.SharedRemote(remote, info) if info.world_size > 1 else remote

    def engines_ready() -> None:
        dedicated.announce_ready(store, job.rank)
        dedicated.wait_until_ready(store, plan.rollout_only_ranks, start, "rollout processes")

    with contextlib.closing(engines):
        return _train(
            cfg,
            sft_model,
            train_path,
            eval_path,
            model_output,
            work_dir,
            info,
            plan,
            engines,
            engines_ready,
        )


@dataclass
class RunState:
    """What the loop carries from step to step; a checkpoint keeps it (as JSON)."""

    step: int = 0
    baseline: HeldOutResult | None = None
    """Held-out metrics of the SFT model."""
    best: HeldOutResult | None = None
    """The best held-out result under the guard so far (with its ``step``)."""
    last_eval: HeldOutResult | None = None
    in_flight: list[StepRollouts] = field(default_factory=list)
    """Rollouts made ahead of their step (``rollout.async_steps``), kept so that a resumed
    run trains on the same ones (``RolloutProducer.pending``)."""
    sync_floor: dict | None = None
    """The sync check's noise floor, learned before the first sync (``SyncGap`` as JSON): a
    resumed run's engine holds other weights than its policy and cannot learn it again."""
    mismatch_floor: float | None = None
    """``rollout_kl`` of the run's first step, the floor of the mismatch gate
    (``trainer.grpo.mismatch.MismatchGate``), kept for a resumed run."""

    def to_json(self) -> dict:
        """The checkpoint's form: the held-out results and the batches as their JSON."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("baseline", "best", "last_eval"):
            data[key] = data[key].to_json() if data[key] is not None else None
        return data | {"in_flight": [batch.to_json() for batch in self.in_flight]}

    @classmethod
    def from_json(cls, data: dict | None) -> RunState:
        """A state from ``to_json``'s form (checkpoints of earlier versions have it too)."""
        if not data:
            return cls()
        data = dict(data)
        for key in ("baseline", "best", "last_eval"):
            if data.get(key) is not None:
                data[key] = HeldOutResult.from_json(data[key])
        data["in_flight"] = [StepRollouts.from_json(d) for d in data.get("in_flight", [])]
        return cls(**data)


@dataclass
class _Run:
    """What the builders made for one run, passed to the loop."""

    cfg: GRPOConfig
    info: DistInfo
    tokenizer: object
    dtype: torch.dtype
    backend: TrainingBackend
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    scorer: ComplianceScorer
    reward_fn: LanguageComplianceReward
    engine: object

    @property
    def dp(self) -> DataParallel:
        return self.backend.data_parallel

    def step_prompts(self, step: int) -> list[Prompt]:
        """The whole step's prompts (every data-parallel rank's), in slot order."""
        chosen = step_prompts(self.train_prompts, step, self.cfg.prompts_per_step, self.cfg.seed)
        return [self.train_prompts[i] for i in chosen]

    def my_prompts(self, step: int) -> list[Prompt]:
        """This rank's share of the step's prompts."""
        per_rank = self.cfg.prompts_per_step // self.dp.size
        return self.step_prompts(step)[self.dp.rank * per_rank : (self.dp.rank + 1) * per_rank]


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
    engines_ready: Callable[[], None] | None = None,
) -> GRPOResult | None:
    """The training processes' part of ``run_grpo`` (``remote``: the dedicated engines;
    ``engines_ready`` says this process is ready and waits, outside every collective, until
    they are)."""
    tokenizer = load_tokenizer(sft_model)
    dtype = resolve_dtype(cfg.dtype, info.device)
    backend, policy = _build_backend(cfg, sft_model, info, dtype, tokenizer.pad_token_id)
    train_prompts, eval_prompts = _load_prompt_sets(cfg, tokenizer, train_path, eval_path)
    scorer = ComplianceScorer(weights=RewardWeights(**cfg.reward_weights))
    # the HF engine samples with the trained module itself (under ZeRO-3 partitioned, every
    # rank stepping in lockstep); Megatron trains its own model, so the HF policy is a copy
    rollout_model = backend.unwrapped() if cfg.optim.backend == "deepspeed" else policy
    engine = remote or _rollout_engine(cfg, rollout_model, tokenizer, sft_model, plan, info)
    run = _Run(
        cfg,
        info,
        tokenizer,
        dtype,
        backend,
        train_prompts,
        eval_prompts,
        scorer,
        LanguageComplianceReward(scorer),
        engine,
    )
    checkpoints = work_dir / "checkpoints"
    run_config = {
        **cfg.model_dump(mode="json"),
        "model": model_fingerprint(sft_model),
        "train_data": file_fingerprint(train_path),
        "eval_data": file_fingerprint(eval_path),
    }
    guard = DivergenceGuard("GRPO", checkpoints, info, cfg.optim.max_zero_grad_steps)
    state = RunState.from_json(resume(checkpoints, backend, info, run_config, guard))
    check = SyncCheck(
        dtype,
        cfg.rollout.sync_check_factor,
        cfg.rollout.sync_check_tolerance,
        SyncGap.from_json(state.sync_floor),
    )
    gate = MismatchGate(
        cfg.rollout.max_mismatch_kl,
        cfg.rollout.mismatch_floor_factor,
        cfg.rollout.mismatch_action,
        state.mismatch_floor,
    )
    if engines_ready is not None:  # no process enters a collective while an engine loads
        engines_ready()
    producer = _producer(run, plan, state, check)  # on-policy, it syncs the engine here
    with (
        mlflow_run("grpo", cfg.model_dump(), info.is_main) as tracking,
        contextlib.closing(backend),
        serve_progress(info.is_main) as progress,
    ):
        # GRPO plans steps, not epochs: the run is one planned epoch (``epoch`` 0 … 1)
        writer = MetricsWriter(
            work_dir / METRICS_FILE,
            cfg.max_steps,
            1.0,
            info.is_main,
            state.step,
            tracking,
            progress,
        )
        engine = producer.ready_engine()  # the engine takes the (resumed) policy's weights
        first_sync = sync_metrics(producer.sync_reports())
        if first_sync:
            log.info("weight sync check at step %d: %s", state.step, first_sync)
        state.sync_floor = check.floor.to_json() if check.floor else None
        if state.baseline is None:
            state.baseline = _evaluate(run, engine)
            state.best = state.baseline.at_step(0)
            writer.log(
                0, **{f"eval_{k}": v for k, v in state.baseline.metrics().items()}, **first_sync
            )
            _save_policy(backend, tokenizer, work_dir / BEST_DIR, dtype, sft_model, info)
        progress = tqdm(
            total=cfg.max_steps,
            initial=state.step,
            desc="grpo",
            mininterval=2.0,
            disable=not info.is_main,
        )
        for step in range(state.step, cfg.max_steps):
            done = step + 1
            started = time.monotonic()
            made = producer.take(step)  # async: step + 1 starts on the engine here
            batch = _score(cfg, tokenizer, run.reward_fn, run.my_prompts(step), made.rollouts)
            scored = time.monotonic()
            if hasattr(run.engine, "sleep"):
                run.engine.sleep()  # colocated vLLM frees the GPU for the update
            stats = _update(cfg, backend, batch, tokenizer.pad_token_id, step, made.staleness > 0)
            train_time = time.monotonic() - scored
            # before anything from this step is saved (checkpoint, best policy, export)
            signal = run.dp.all_reduce_sum(float(batch.keep.sum())) > 0
            guard.check(done, stats["loss"], stats["grad_norm"], backend.module, signal)
            producer.updated(done)  # an idle engine takes the new weights now
            step_time = time.monotonic() - started
            writer.log(
                done,
                data_passes=round(done * cfg.prompts_per_step / len(train_prompts), 4),
                **stats,
                **_reward_metrics(batch, run.dp),
                **_timing_metrics(run, made, batch, train_time, step_time),
                **sync_metrics(producer.sync_reports()),
            )
            if "rollout_kl" in stats:  # after the line: a stopped run shows the step's value
                gate.check(stats["rollout_kl"], done, made.staleness == 0)
                state.mismatch_floor = gate.floor
            progress.update(1)
            progress.set_postfix(reward=f"{float(batch.rewards.mean()):.2f}")
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.max_steps):
                held_out = _evaluate(run, producer.ready_engine())
                # merged onto this step's line: the last line always carries the train loss
                writer.log(
                    done,
                    **{f"eval_{k}": v for k, v in held_out.metrics().items()},
                    **sync_metrics(producer.sync_reports()),
                )
                state.last_eval = held_out.at_step(done)
                # rank 0 decides for all: every rank must take part in the save (ZeRO-3 gathers)
                if broadcast_object(_better(cfg, held_out, state.baseline, state.best), info):
                    state.best = held_out.at_step(done)
                    _save_policy(backend, tokenizer, work_dir / BEST_DIR, dtype, sft_model, info)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                producer.drain()  # what is in flight is saved with the step, not lost
                state.step, state.in_flight = done, producer.pending()
                save_checkpoint(
                    checkpoints,
                    done,
                    backend,
                    state.to_json(),
                    info,
                    cfg.max_ckpt_num,
                    run_config,
                    guard.state_dict(),
                )
        progress.close()
        return _finish(run, state, work_dir, model_output, sft_model, tracking)


def _build_backend(
    cfg: GRPOConfig, sft_model, info: DistInfo, dtype: torch.dtype, pad_id: int
) -> tuple[TrainingBackend, torch.nn.Module]:
    """The training backend and the HF policy it was built from (under ZeRO-3 built
    partitioned: no rank ever holds the whole model; ``trainer.backends.loading``)."""
    policy, ds_config = load_training_model(
        sft_model, dtype, cfg.optim, info, cfg.micro_batch_size, _micro_per_mini(cfg, info)
    )
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
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
        pad_id=pad_id,
    )
    if cfg.optim.backend == "megatron":
        policy.requires_grad_(False)
    return backend, policy


def _load_prompt_sets(
    cfg: GRPOConfig, tokenizer, train_path, eval_path
) -> tuple[list[Prompt], list[Prompt]]:
    limit, kept = cfg.rollout.max_prompt_tokens, cfg.prompt_filter
    train_prompts = load_prompts(train_path, tokenizer, limit, kept)
    eval_prompts = load_prompts(eval_path, tokenizer, limit, kept)[: cfg.eval_prompts]
    if len(train_prompts) < cfg.prompts_per_step:
        raise ValueError(
            f"{train_path}: {len(train_prompts)} unique prompts, fewer than prompts_per_step "
            f"{cfg.prompts_per_step}"
        )
    return train_prompts, eval_prompts


def _producer(run: _Run, plan: PlacementPlan, state: RunState, check: SyncCheck) -> RolloutProducer:
    """The producer of each step's rollouts on this rank: its requests (the prompts its engine
    generates, one seed per response), its sync (with ``check``), what was in flight at the
    checkpoint."""
    cfg, info = run.cfg, run.info
    per_rank = cfg.prompts_per_step // run.dp.size
    # the ranks whose prompts this rank's engine generates: every training rank's (dedicated
    # engines), all of a colocated vLLM engine's workers, or this rank's own
    if plan.rollout_only_ranks:
        share = tuple(range(run.dp.size))
    elif cfg.rollout.engine == "vllm":
        share = plan.engine_of(info.rank).ranks
    else:
        share = (run.dp.rank,)
    probe_from = run.eval_prompts or run.train_prompts
    probe = sync_probe([p.ids for p in probe_from], cfg.rollout.sync_check_tokens)
    pad_id = run.tokenizer.pad_token_id

    def requests(step: int):
        # one seed per (step, slot of the step's batch, sample): the same on every rank and
        # every layout, never shared by two responses
        seeds = group_seeds(cfg.seed, step, range(cfg.prompts_per_step), cfg.rollout.n_samples)
        prompts = [p.ids for p in run.step_prompts(step)]
        return share_request(prompts, seeds, share, per_rank)

    producer = RolloutProducer(
        run.engine,
        requests,
        lambda version: _sync(run.engine, run.backend, probe, check, pad_id, info, version),
        cfg.rollout.async_steps,
        cfg.max_steps,
        select=lambda out: keep_share(out, share, run.dp.rank, per_rank),
    )

    producer.updated(state.step)
    producer.restore(state.in_flight)
    return producer


def _evaluate(run: _Run, engine) -> dict:
    cfg = run.cfg
    return evaluate_policy(
        engine, run.tokenizer, run.eval_prompts, run.scorer, cfg.eval_samples, cfg.seed
    )


def _timing_metrics(
    run: _Run, made: StepRollouts, batch: _Batch, train_time: float, step_time: float
) -> dict:
    """Where the step's time went, on each side. ``rollout_time_s``: the engine generating
    this step's batch; ``rollout_wait_s``: the trainer blocked waiting for it (the whole
    generation when on-policy, what the overlap did not hide when async);
    ``rollout_idle_s``: the engine waiting for work before it (engines in other
    processes)."""
    tokens = run.dp.all_reduce_sum(float(sum(len(r.response_ids) for r in batch.rollouts)))
    out = {
        "staleness": made.staleness,
        "rollout_time_s": made.generate_s,
        "rollout_wait_s": made.wait_s,
        "train_time_s": train_time,
        "step_time_s": step_time,
        "tokens_per_s": tokens / max(1e-9, step_time),
    }
    if made.engine_idle_s is not None:
        out["rollout_idle_s"] = made.engine_idle_s
    return out


def _finish(
    run: _Run, state: RunState, work_dir: Path, model_output: Path, sft_model, tracking
) -> GRPOResult | None:
    """Save the final policy, export the best (or last) one, write the summary (rank 0)."""
    final_dir = work_dir / "final_policy"
    _save_policy(run.backend, run.tokenizer, final_dir, run.dtype, sft_model, run.info)
    if not run.info.is_main:
        return None
    use_best = run.cfg.guard.keep_best and (work_dir / BEST_DIR).exists()
    last = state.last_eval or state.baseline
    exported = state.best if use_best else last
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
        steps=run.cfg.max_steps,
        baseline=state.baseline,
        final=last,
        exported=exported,
        exported_step=exported.step or 0,
    )
    (work_dir / SUMMARY_FILE).write_text(json.dumps(result.to_json(), indent=2))
    if tracking is not None and plot:
        log_artifact(plot)
    return result


def run_placement(cfg: GRPOConfig, info) -> PlacementPlan:
    """This run's placement plan, from torchrun's world (``LOCAL_WORLD_SIZE`` processes a
    node), checked against where this process actually is.

    Colocated: every process trains (and runs or shares an engine). Dedicated
    (``rollout.colocate=false``): the last ``num_engines × tensor_parallel_size`` processes
    of the job are rollout-only, the rest train.

    Raises:
        PlacementError: dedicated engines that this recipe cannot run yet (the Megatron
            backend), a job whose processes are not ``nproc`` training processes plus the
            engines', Megatron with multi-process vLLM, or a plan that puts this process on
            another device than torchrun did.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    rollout = cfg.rollout
    vllm = rollout.engine == "vllm"
    if not rollout.colocate:
        engine_processes = rollout.num_engines * (rollout.tensor_parallel_size if vllm else 1)
        training = info.world_size - engine_processes
        problems = []
        if cfg.optim.backend == "megatron":
            problems.append(
                "optim.backend=megatron with dedicated engines is not built yet (its "
                "data-parallel ranks are not the training processes); use deepspeed or torch"
            )
        if training != cfg.nproc:
            problems.append(
                f"{info.world_size} processes for {engine_processes} rollout-only processes "
                f"leave {training} training processes, not nproc={cfg.nproc}: start "
                f"nproc + {engine_processes} processes (torchrun --nproc-per-node)"
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


def _rollout_only_engine(cfg: GRPOConfig, sft_model, plan: PlacementPlan, info: DistInfo):
    """A rollout-only process's engine, loaded from the SFT model (it then answers the
    coordinator, ``trainer.grpo.remote.serve``, until the run ends). A vLLM engine runs in
    processes of its own, started by the engine's first rank
    (``trainer.grpo.vllm_dedicated``); its other ranks only follow."""
    from trainer.grpo.remote import EngineFollower

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
            record_routing=cfg.algorithm.router_replay == "rollout",
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
    return engine


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
            dtype=str(resolve_dtype(cfg.dtype, info.device)).removeprefix("torch."),
            sleep_mode=cfg.rollout.colocate and info.device.type == "cuda",
            record_routing=cfg.algorithm.router_replay == "rollout",
        )
    lockstep = _zero3(cfg) and info.world_size > 1
    return HFRolloutEngine(model, tokenizer, cfg.rollout, lockstep=lockstep)


def _zero3(cfg: GRPOConfig) -> bool:
    return cfg.optim.backend == "deepspeed" and cfg.optim.zero_stage == 3


def _sync(
    engine,
    backend: TrainingBackend,
    probe: SyncProbe,
    check: SyncCheck,
    pad_id: int,
    info: DistInfo,
    step: int,
) -> SyncReport | None:
    """Push the policy's weights (version ``step``) to an engine that does not share them
    (streamed by name), then check that it took them: the engine's and the policy's
    log-probs of ``probe``, compared over all processes and engines (None: the engine is the
    policy, nothing to sync).

    Before the first sync of a run that starts from the SFT model (``step`` 0) the engine
    holds the weights the policy loaded: that difference is the check's noise floor. A
    resumed run brings its floor back from the checkpoint (``RunState.sync_floor``).

    Raises:
        WeightSyncError: the floor, or the difference after the sync, is past its bound.
    """
    if isinstance(engine, HFRolloutEngine) and engine.model is backend.unwrapped():
        return None
    name = type(engine).__name__
    if check.floor is None and step == 0:
        check.learn_floor(_probe_gap(engine, backend, probe, pad_id, info), name)
    started = time.monotonic()
    sent = engine.sync_weights(backend.hf_weights())
    seconds = time.monotonic() - started
    gap = _probe_gap(engine, backend, probe, pad_id, info)
    if check.floor is None:  # resumed from a checkpoint written before floors were kept
        log.warning(
            "no sync-check noise floor in the checkpoint: taking the difference after this "
            "sync (step %d) as the floor, so this sync is checked only against its ceiling",
            step,
        )
        check.learn_floor(gap, name)
    check.check(gap, step, name)
    return SyncReport(gap, check.floor, sent, seconds)


def _probe_gap(engine, backend: TrainingBackend, probe: SyncProbe, pad_id: int, info) -> SyncGap:
    """The engine's and the policy's log-probs of ``probe``, compared token by token: each
    statistic's worst over the copies of the weights the engine serves and the processes."""
    policy: list[float] = []
    served: list[list[float]] | None = None
    for text in probe.texts:
        micro = sequences(
            [Prompt(text.prompt, "", "")],
            [Rollout(0, text.response, True)],
            pad_id,
            backend.data_parallel.device,
        )
        policy += backend.log_probs([micro])[0][0, -len(text.response) :].float().tolist()
        scores = engine.token_log_probs_per_engine(text.prompt, text.response)
        served = scores if served is None else [a + b for a, b in zip(served, scores, strict=True)]
    local = worst(sync_gap(s, policy) for s in served)
    return SyncGap(
        all_reduce_max(local.mean, info),
        all_reduce_max(local.p95, info),
        all_reduce_max(local.max, info),
        local.tokens,
    )


def _mini_batches(cfg: GRPOConfig) -> int:
    return cfg.prompts_per_step * cfg.rollout.n_samples // cfg.mini_batch_size


def _micro_per_mini(cfg: GRPOConfig, info: DistInfo) -> int:
    """DeepSpeed's gradient accumulation steps (every process a data-parallel replica)."""
    return cfg.mini_batch_size // (cfg.micro_batch_size * info.world_size)


def _better(
    cfg: GRPOConfig, held_out: HeldOutResult, baseline: HeldOutResult, best: HeldOutResult
) -> bool:
    """A held-out result beats the best so far without its text degenerating (the guard)."""
    floor = (1.0 - cfg.guard.max_real_word_drop) * baseline.real_word_share
    return held_out.real_word_share >= floor and held_out.mean_reward > best.mean_reward


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
    cfg: GRPOConfig,
    backend: TrainingBackend,
    batch: _Batch,
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
    agg = algo.get_loss_agg_mode(a.loss_agg_mode)
    dp = backend.data_parallel
    n = len(batch.rollouts)
    local_mini = cfg.mini_batch_size // dp.size
    device = dp.device
    correction = _correction(cfg, stale)
    recorded = all(r.log_probs is not None for r in batch.rollouts)
    if correction != "none" and not recorded:
        missing = next(i for i, r in enumerate(batch.rollouts) if r.log_probs is None)
        raise ValueError(
            f"rollout {missing} of the batch has no behaviour log-probs: the engine must record "
            f"them for algorithm.rollout_correction {correction!r} (and for an off-policy "
            "update, rollout.async_steps)"
        )
    meter = MismatchMeter(a.seq_mask_low, a.seq_mask_high) if recorded else None
    counts = RouterCounts()
    # one on-policy update: the old log-probs equal the current ones, so reuse them (detached)
    single_update = a.ppo_epochs == 1 and local_mini >= n
    old_log_probs: list[torch.Tensor] = []
    if not single_update:
        chunks = [
            list(range(start, min(start + cfg.micro_batch_size, n)))
            for start in range(0, n, cfg.micro_batch_size)
        ]
        chunk_layouts = [_laid_out(cfg, batch, chunk, pad_id, device, counts) for chunk in chunks]
        old_log_probs = backend.log_probs(chunk_layouts)
        if meter is not None:
            for chunk, layout, old in zip(chunks, chunk_layouts, old_log_probs, strict=True):
                meter.add(old, _behaviour_block(batch, chunk, layout.width), layout.mask)
    sums = {
        "loss": 0.0,
        "grad_norm": 0.0,
        "clip_fraction": 0.0,
        "entropy": 0.0,
        "kl": 0.0,
        "learning_rate": 0.0,
    }
    if recorded:
        sums |= {key: 0.0 for key in CORRECTION_MEANS}
    ratio_max = 0.0
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
            measuring = counts if single_update else None  # the forward before the update
            layouts = [_laid_out(cfg, batch, micro, pad_id, device, measuring) for micro in micros]
            masks = [
                layout.mask * batch.keep[micro].to(device)[:, None]
                for layout, micro in zip(layouts, micros, strict=True)
            ]
            local_count = sum(float(agg.count(m)) for m in masks)
            normalizer = max(dp.all_reduce_sum(local_count), 1e-8)
            ref_log_probs = backend.log_probs(layouts, reference=True) if a.kl_loss_coef else None
            behaviour = None
            if recorded:
                behaviour = [
                    _behaviour_block(batch, micro, layout.width).to(device)
                    for micro, layout in zip(micros, layouts, strict=True)
                ]
            measured = None
            if meter is not None and single_update:  # the only forward before the update
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
            if recorded:
                for key in CORRECTION_MEANS:
                    total = sum(stats[key] for stats in micro_stats)
                    sums[key] += dp.all_reduce_sum(total) / masked_tokens
                ratio_max = max(
                    ratio_max, *(stats["importance_ratio_max"] for stats in micro_stats)
                )
            updates += 1
    out = {k: v / max(1, updates) for k, v in sums.items()}
    if recorded:  # the largest over every mini-batch and replica: one reduce for the step
        out["importance_ratio_max"] = dp.all_reduce_max(ratio_max)
    if meter is not None:
        out |= meter.metrics(dp.group, dp.size)
    compared = dp.all_reduce_sum(counts.compared)
    if compared:  # the engine recorded its routing and the model routes (MoE)
        out["router_mismatch_rate"] = dp.all_reduce_sum(counts.differ) / compared
    return out


def _laid_out(
    cfg: GRPOConfig,
    batch: _Batch,
    rows: list[int],
    pad_id: int,
    device,
    counts: RouterCounts | None = None,
) -> Micro:
    """The rollouts ``rows`` as a micro-batch (``micro_batch.sequences``), with the engine's
    expert routing when it is replayed (``algorithm.router_replay: rollout``) or, in the
    forward before the update (``counts``), compared with the trainer's own.

    Raises:
        ValueError: routing replay on, and a rollout without its engine's routing.
    """
    rollouts = [batch.rollouts[i] for i in rows]
    layout = sequences(batch.prompts, rollouts, pad_id, device)
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


def _loss_fn(
    cfg: GRPOConfig,
    batch: _Batch,
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

    def loss(k: int, log_probs: torch.Tensor, entropy: torch.Tensor):
        micro, mask = micros[k], masks[k]
        if not old_log_probs:
            old = log_probs.detach()
        else:
            old = _gather_old(old_log_probs, micro, cfg.micro_batch_size, log_probs.shape[1])
        clipping = {
            "clip_ratio_low": a.clip_ratio_low,
            "clip_ratio_high": a.clip_ratio_high,
            "clip_ratio_c": a.clip_ratio_c,
            "loss_agg_mode": a.loss_agg_mode,
            "norm_length": cfg.rollout.max_new_tokens,
            "global_normalizer": normalizer,
        }
        advantages = batch.advantages[micro].to(device)
        if behaviour is None:
            total, pstats = algo.policy_loss(log_probs, old, advantages, mask, **clipping)
        else:
            total, pstats = algo.decoupled_policy_loss(
                log_probs,
                old,
                behaviour[k],
                advantages,
                mask,
                correction=correction,
                tis_cap=a.tis_cap,
                seq_mask_low=a.seq_mask_low,
                seq_mask_high=a.seq_mask_high,
                **clipping,
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


def _behaviour_block(batch: _Batch, micro: list[int], width: int) -> torch.Tensor:
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
        # both languages right: the share the ODH SDK shows for GRPO as full_match_rate
        "full_match_rate": mean(_both_ok(r) for r in batch.results),
        "response_length_mean": mean(len(r.response_ids) for r in batch.rollouts),
        "finished_fraction": mean(r.finished for r in batch.rollouts),
        "no_signal_fraction": mean((1.0 - batch.keep).tolist()),
    }


@names_write_failures("directory")
def _save_policy(
    backend: TrainingBackend, tokenizer, directory: Path, dtype, base_model, info: DistInfo
) -> None:
    """The current policy as a HF directory (every rank takes part: ZeRO-3 gathers; rank 0
    writes), renamed into place when complete. The Megatron backend saves its own
    ``torch_dist`` checkpoint instead (``save_policy``), which the pipeline's ``export_hf``
    step turns into a HF directory."""
    tmp = directory.with_name(f".{directory.name}.partial")
    if info.is_main:
        tmp = staging_dir(directory)
    barrier(info)
    if hasattr(backend, "save_policy"):
        backend.save_policy(tmp)
    else:
        backend.save_hf_pretrained(tmp, base_model, dtype)
    if info.is_main:
        tokenizer.save_pretrained(tmp)
        publish_dir(tmp, directory)
    barrier(info)


@names_write_failures("model_output")
def _export(source: Path, model_output: Path) -> None:
    tmp = staging_dir(model_output)
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
    except BaseException:
        discard_staging(tmp)
        raise
    publish_dir(tmp, model_output, "--model-output")


def read_summary(work_dir: str | Path) -> GRPOResult:
    """The result a (possibly torchrun) GRPO run left in ``work_dir``."""
    return GRPOResult.from_json(json.loads((Path(work_dir) / SUMMARY_FILE).read_text()))
