"""The GRPO recipe: sample groups → reward → group advantages → clipped policy update → sync.

Reads top to bottom: it checks the placement (``trainer.placement.run_placement``), asks the
builders for the parts by the config's names (the training backend and its policy:
``trainer.backends.build_backend``; the rollout engine: ``trainer.grpo.engines``), builds the
reward and the metrics writer, and loops: take the step's rollouts from the producer, score
and update (``trainer.grpo.update``), sync, log, evaluate, checkpoint. Runs as one process or
as every rank of a ``torchrun`` job (each rank samples its share of the prompts; advantages
are per group, so they stay local; loss normalizers are summed over ranks so N processes
follow the single-process run).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm

from core.atomic import check_output_dir, check_writable
from core.modeling import load_tokenizer, resolve_dtype
from core.seeds import group_seeds
from core.tracking import log_artifact, mlflow_run
from reward.adapters import LanguageComplianceReward
from reward.outcome import HeldOutResult
from reward.scoring import ComplianceScorer, RewardWeights
from trainer.backends import DataParallel, TrainingBackend, build_backend
from trainer.checkpoint import (
    export_policy,
    resume,
    run_fingerprint,
    save_checkpoint,
    save_policy_dir,
)
from trainer.distributed import (
    DistInfo,
    broadcast_object,
    init_distributed,
    process_info,
    seed_everything,
)
from trainer.divergence import DivergenceGuard
from trainer.grpo import engines
from trainer.grpo.config import GRPOConfig
from trainer.grpo.dynamic_sampling import fill_signal_groups
from trainer.grpo.held_out import (
    better,
    evaluate_policy,
    held_out_line,
    judge,
    on_guard_flags,
)
from trainer.grpo.mismatch import MismatchGate
from trainer.grpo.producer import RolloutProducer, StepRollouts
from trainer.grpo.prompts import Prompt, load_prompt_sets, resample_prompts, step_prompts
from trainer.grpo.rollout import RolloutEngine, group_slots_request, rank_slots
from trainer.grpo.sync_check import SyncBudget, SyncCheck, SyncGap, sync_metrics, sync_probe
from trainer.grpo.update import (
    Batch,
    backend_request,
    policy_update,
    reward_metrics,
    score_rollouts,
)
from trainer.grpo.weight_sync import sync_engine
from trainer.metrics import METRICS_FILE, MetricsWriter, plot_metrics
from trainer.placement import PlacementPlan, run_placement
from trainer.progress import serve_progress
from trainer.sft.merge import load_adapter, merge_and_save

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
        held_out = {"baseline": self.baseline, "final": self.final, "exported": self.exported}
        return asdict(self) | {k: v.to_json() for k, v in held_out.items()}

    @classmethod
    def from_json(cls, data: dict) -> GRPOResult:
        held_out = ("baseline", "final", "exported")
        return cls(
            **{k: HeldOutResult.from_json(v) if k in held_out else v for k, v in data.items()}
        )


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
    over a ``Channel`` of their own (``trainer.grpo.channels``).
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
    from trainer.grpo import channels

    store = channels.job_store(timeout)
    leads = [engine.ranks[0] for engine in plan.engines]
    channel, weights = channels.open_channels(
        store, plan.rollout_only_ranks, leads, job.rank, timeout
    )
    seed_everything(cfg.seed)
    start = timedelta(seconds=cfg.rollout.start_timeout_s)
    if job.rank in plan.rollout_only_ranks:
        site = engines.EngineSite(cfg, sft_model, load_tokenizer(sft_model), plan, job)
        engines.serve_rollouts(site, store, channel, weights, start)
        return None
    info = init_distributed(cfg.device, cfg.cpu_threads, plan.training_ranks, store, timeout)
    remote = engines.remote_engines(cfg, plan, channel, weights, info)

    def engines_ready() -> None:
        channels.announce_ready(store, job.rank)
        channels.wait_until_ready(store, plan.rollout_only_ranks, start, "rollout processes")

    result = _train(
        cfg,
        sft_model,
        train_path,
        eval_path,
        model_output,
        work_dir,
        info,
        plan,
        remote,
        engines_ready,
    )
    # Only a run that ended well tells the engines to stop: stopping is a collective on the
    # channel, and after a failure the rollout processes may not be in one (still waiting in
    # the store for a coordinator that never said it was ready), so the trainer would wait
    # there forever with its error unreported. A failed trainer exits non-zero instead, and
    # torchrun ends the rollout processes.
    remote.close()
    return result


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
    """``rollout_kl`` of the run's first on-policy step, the mismatch gate's floor for
    on-policy steps (``trainer.grpo.mismatch.MismatchGate``), kept for a resumed run."""
    stale_mismatch_floor: float | None = None
    """``rollout_kl`` of the run's first step one update stale (``rollout.async_steps``), the
    gate's floor for stale steps."""

    def to_json(self) -> dict:
        """The checkpoint's form: the held-out results and the batches as their JSON."""
        held_out = {"baseline": self.baseline, "best": self.best, "last_eval": self.last_eval}
        return (
            vars(self)
            | {k: v.to_json() if v is not None else None for k, v in held_out.items()}
            | {"in_flight": [batch.to_json() for batch in self.in_flight]}
        )

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
    engine: RolloutEngine
    site: engines.EngineSite

    @property
    def dp(self) -> DataParallel:
        return self.backend.data_parallel

    def step_prompts(self, step: int, round_: int = 0) -> list[Prompt]:
        """The whole step's prompts (every data-parallel rank's), in slot order; round
        ``round_`` ≥ 1: those of that round of the step's dynamic sampling."""
        per_step, seed = self.cfg.prompts_per_step, self.cfg.seed
        if round_:
            chosen = resample_prompts(self.train_prompts, step, round_, per_step, seed)
        else:
            chosen = step_prompts(self.train_prompts, step, per_step, seed)
        return [self.train_prompts[i] for i in chosen]

    def my_prompts(self, step: int, round_: int = 0) -> list[Prompt]:
        """This rank's share of the step's prompts (or of its dynamic sampling's round)."""
        per_rank = self.cfg.prompts_per_step // self.dp.size
        chosen = self.step_prompts(step, round_)
        return chosen[self.dp.rank * per_rank : (self.dp.rank + 1) * per_rank]


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
    run = _build_run(cfg, sft_model, train_path, eval_path, info, plan, remote)
    checkpoints = work_dir / "checkpoints"
    run_config = run_fingerprint(cfg.model_dump(mode="json"), sft_model, train_path, eval_path)
    guard = DivergenceGuard("GRPO", checkpoints, info, cfg.optim.max_zero_grad_steps)
    state = RunState.from_json(resume(checkpoints, run.backend, info, run_config, guard))
    check, gate = _sync_check(cfg, run.dtype, state), _mismatch_gate(cfg, state)
    if engines_ready is not None:  # no process enters a collective while an engine loads
        engines_ready()
    producer = _producer(run, state, check)  # on-policy, it syncs the engine here
    with (
        mlflow_run("grpo", cfg.model_dump(), info.is_main) as tracking,
        contextlib.closing(run.backend),
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
        best_dir = work_dir / BEST_DIR
        _start(run, state, check, producer, writer, best_dir, sft_model)
        progress = tqdm(
            total=cfg.max_steps,
            initial=state.step,
            desc="grpo",
            mininterval=2.0,
            disable=not info.is_main,
        )
        for step in range(state.step, cfg.max_steps):
            done = step + 1
            batch = _step(run, state, producer, guard, gate, writer, step)
            progress.update(1)
            progress.set_postfix(reward=f"{float(batch.rewards.mean()):.2f}")
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.max_steps):
                _held_out_eval(run, state, producer, writer, done, best_dir, sft_model)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                producer.drain()  # what is in flight is saved with the step, not lost
                state.step, state.in_flight = done, producer.pending()
                save_checkpoint(
                    checkpoints,
                    done,
                    run.backend,
                    state.to_json(),
                    info,
                    cfg.max_ckpt_num,
                    run_config,
                    guard.state_dict(),
                )
        progress.close()
        return _finish(run, state, work_dir, model_output, sft_model, tracking)


def _build_run(
    cfg: GRPOConfig,
    sft_model: str | Path,
    train_path: str | Path,
    eval_path: str | Path,
    info: DistInfo,
    plan: PlacementPlan,
    remote,
) -> _Run:
    """The backend and its policy, the prompts, the scorer and the engine of one run."""
    tokenizer = load_tokenizer(sft_model)
    dtype = resolve_dtype(cfg.dtype, info.device)
    request = backend_request(cfg, sft_model, dtype, info, tokenizer.pad_token_id)
    backend, policy = build_backend(request)
    train_prompts, eval_prompts = load_prompt_sets(cfg, tokenizer, train_path, eval_path)
    scorer = ComplianceScorer(weights=RewardWeights(**cfg.reward_weights))
    site = engines.EngineSite(cfg, sft_model, tokenizer, plan, info)
    # colocated, the engine samples with the policy (the HF engine: the trained module itself)
    engine = remote or engines.colocated_engine(site, policy, backend)
    return _Run(
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
        site,
    )


def _sync_check(cfg: GRPOConfig, dtype: torch.dtype, state: RunState) -> SyncCheck:
    """The weight sync's check, with the noise floor a resumed run learned before."""
    rollout = cfg.rollout
    floor = SyncGap.from_json(state.sync_floor)
    return SyncCheck(dtype, rollout.sync_check_factor, rollout.sync_check_tolerance, floor)


def _mismatch_gate(cfg: GRPOConfig, state: RunState) -> MismatchGate:
    """The mismatch gate, with the floors (on-policy, one update stale) a resumed run kept."""
    floors = ((0, state.mismatch_floor), (1, state.stale_mismatch_floor))
    return MismatchGate(
        cfg.rollout.max_mismatch_kl,
        cfg.rollout.mismatch_floor_factor,
        cfg.rollout.mismatch_action,
        {k: v for k, v in floors if v is not None},
    )


def _start(
    run: _Run,
    state: RunState,
    check: SyncCheck,
    producer: RolloutProducer,
    writer: MetricsWriter,
    best_dir: Path,
    sft_model,
) -> None:
    """The engine takes the (resumed) policy's weights; a fresh run evaluates the SFT model
    (the baseline, step 0) and keeps it as the best so far."""
    engine = producer.ready_engine()
    # a fresh run logs this first sync's check on the baseline's line (step 0); a resumed
    # run on its first step's line, which shows that the engine (a new process, loaded
    # from the SFT model) took the checkpoint's weights
    first_sync = sync_metrics(producer.sync_reports()) if state.baseline is None else {}
    if first_sync:
        log.info("weight sync check at step %d: %s", state.step, first_sync)
    state.sync_floor = check.floor.to_json() if check.floor else None
    if state.baseline is None:
        state.baseline = _evaluate(run, engine)
        state.best = state.baseline.at_step(0)
        writer.log(0, **{f"eval_{k}": v for k, v in state.baseline.metrics().items()}, **first_sync)
        save_policy_dir(run.backend, run.tokenizer, best_dir, run.dtype, sft_model, run.info)


def _step(
    run: _Run,
    state: RunState,
    producer: RolloutProducer,
    guard: DivergenceGuard,
    gate: MismatchGate,
    writer: MetricsWriter,
    step: int,
) -> Batch:
    """One GRPO step: its rollouts scored (and refilled), the update, the divergence guard,
    the weights to the engine, the step's line, the mismatch gate. Returns the batch."""
    cfg, done = run.cfg, step + 1
    started = time.monotonic()
    made = producer.take(step)  # async: step + 1 starts on the engine here …
    batch = score_rollouts(cfg, run.tokenizer, run.reward_fn, run.my_prompts(step), made.rollouts)
    batch, sampling = fill_signal_groups(
        cfg.algorithm.dynamic_sampling, batch, _resampler(run, producer, step), run.dp
    )
    producer.start_next(step)  # … or here, after dynamic sampling's rounds
    scored = time.monotonic()
    run.engine.sleep()  # colocated vLLM frees the GPU for the update
    pad_id = run.tokenizer.pad_token_id
    stats = policy_update(cfg, run.backend, batch, pad_id, step, made.staleness > 0)
    train_time = time.monotonic() - scored
    # before anything from this step is saved (checkpoint, best policy, export)
    signal = run.dp.all_reduce_sum(float(batch.keep.sum())) > 0
    guard.check(done, stats["loss"], stats["grad_norm"], run.backend.module, signal)
    producer.updated(done)  # an idle engine takes the new weights now
    step_time = time.monotonic() - started
    tokens = run.dp.all_reduce_sum(float(sum(len(r.response_ids) for r in batch.rollouts)))
    writer.log(
        done,
        data_passes=round(done * cfg.prompts_per_step / len(run.train_prompts), 4),
        **stats,
        **reward_metrics(batch, run.dp),
        **made.timing_metrics(tokens, train_time, step_time),
        **sync_metrics(producer.sync_reports()),
        **sampling,
    )
    if "rollout_kl" in stats:  # after the line: a stopped run shows the step's value
        gate.check(stats["rollout_kl"], done, made.staleness)
        state.mismatch_floor = gate.floors.get(0)
        state.stale_mismatch_floor = gate.floors.get(1)
    return batch


def _held_out_eval(
    run: _Run,
    state: RunState,
    producer: RolloutProducer,
    writer: MetricsWriter,
    done: int,
    best_dir: Path,
    sft_model,
) -> None:
    """The held-out eval after step ``done``: merged onto the step's line (the last line
    always carries the train loss), the guard's flags, and the policy kept if it is the best
    under the guard."""
    held_out = _evaluate(run, producer.ready_engine())
    verdict = judge(run.cfg, held_out, state.baseline)
    line = held_out_line(held_out, verdict)
    writer.log(done, **line, **sync_metrics(producer.sync_reports()))
    on_guard_flags(run.cfg, verdict, done)
    state.last_eval = held_out.at_step(done)
    # rank 0 decides for all: every rank must take part in the save (ZeRO-3 gathers)
    if broadcast_object(better(held_out, state.best, verdict), run.info):
        state.best = held_out.at_step(done)
        save_policy_dir(run.backend, run.tokenizer, best_dir, run.dtype, sft_model, run.info)


def _producer(run: _Run, state: RunState, check: SyncCheck) -> RolloutProducer:
    """The producer of each step's rollouts on this rank: its requests (the prompts its engine
    generates, one seed per response), its sync (with ``check``), what was in flight at the
    checkpoint."""
    cfg, info = run.cfg, run.info
    per_rank = cfg.prompts_per_step // run.dp.size
    group = engines.engine_ranks(run.site, run.dp)
    probe_from = run.eval_prompts or run.train_prompts
    probe = sync_probe([p.ids for p in probe_from], cfg.rollout.sync_check_tokens)
    pad_id = run.tokenizer.pad_token_id

    def requests(step: int, round_: int):
        # one seed per (step, slot of the step's batch, sample): the same on every rank and
        # every layout, never shared by two responses; dynamic sampling's rounds their own
        key = f"{step}/resample{round_}" if round_ else step
        seeds = group_seeds(cfg.seed, key, range(cfg.prompts_per_step), cfg.rollout.n_samples)
        prompts = [p.ids for p in run.step_prompts(step, round_)]
        return group_slots_request(prompts, seeds, group, per_rank)

    budget = SyncBudget(cfg.rollout.sync_budget_s)
    producer = RolloutProducer(
        run.engine,
        requests,
        lambda version: sync_engine(
            run.engine, run.backend, probe, check, pad_id, info, version, budget, cfg.lora.r > 0
        ),
        cfg.rollout.async_steps,
        cfg.max_steps,
        select=lambda out: rank_slots(out, group, run.dp.rank, per_rank),
        resampling=cfg.algorithm.dynamic_sampling.enabled,
    )

    producer.updated(state.step)
    producer.restore(state.in_flight)
    return producer


def _resampler(run: _Run, producer: RolloutProducer, step: int) -> Callable[[int], Batch]:
    """Round ``k`` of ``step``'s dynamic sampling on this rank: its share of the round's fresh
    prompts, generated on the idle engine and scored."""

    def round_batch(k: int) -> Batch:
        made = producer.resample(step, k)
        prompts = run.my_prompts(step, k)
        return score_rollouts(run.cfg, run.tokenizer, run.reward_fn, prompts, made.rollouts)

    return round_batch


def _evaluate(run: _Run, engine) -> HeldOutResult:
    cfg = run.cfg
    return evaluate_policy(
        engine, run.tokenizer, run.eval_prompts, run.scorer, cfg.eval_samples, cfg.seed
    )


def _finish(
    run: _Run, state: RunState, work_dir: Path, model_output: Path, sft_model, tracking
) -> GRPOResult | None:
    """Save the final policy, export the best (or last) one, write the summary (rank 0)."""
    final_dir = work_dir / "final_policy"
    save_policy_dir(run.backend, run.tokenizer, final_dir, run.dtype, sft_model, run.info)
    if not run.info.is_main:
        return None
    use_best = run.cfg.guard.keep_best and (work_dir / BEST_DIR).exists()
    last = state.last_eval or state.baseline
    exported = state.best if use_best else last
    source = work_dir / BEST_DIR if use_best else final_dir
    _export(run, source, sft_model, model_output)
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


def _export(run: _Run, source: Path, sft_model, model_output: Path) -> None:
    """The policy directory ``source`` as the step's model output: copied, or (LoRA GRPO,
    where it holds the adapter) merged into the SFT model and checked (``merge_and_save``:
    the merged logits against base + adapter on ``merge_check_prompts`` held-out prompts)."""
    if not run.cfg.lora.r:
        export_policy(source, model_output)
        return
    prompts = [p.ids for p in (run.eval_prompts or run.train_prompts)]
    adapted = load_adapter(sft_model, source, run.dtype)
    report = merge_and_save(
        adapted, run.tokenizer, prompts[: run.cfg.merge_check_prompts], model_output
    )
    log.info("LoRA adapter merged into %s: %s", model_output, report)


def read_summary(work_dir: str | Path) -> GRPOResult:
    """The result a (possibly torchrun) GRPO run left in ``work_dir``."""
    return GRPOResult.from_json(json.loads((Path(work_dir) / SUMMARY_FILE).read_text()))
