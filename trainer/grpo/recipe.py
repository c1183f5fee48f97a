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
import math
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
from reward.degeneracy import measure_degeneracy
from reward.outcome import HeldOutResult, Outcome
from reward.scoring import ComplianceScorer, RewardWeights
from trainer.backends import DataParallel, TrainingBackend, build_backend
from trainer.checkpoint import (
    export_policy,
    file_fingerprint,
    model_fingerprint,
    resume,
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
from trainer.grpo.mismatch import MismatchGate
from trainer.grpo.producer import RolloutProducer, StepRollouts
from trainer.grpo.prompts import Prompt, load_prompt_sets, resample_prompts, step_prompts
from trainer.grpo.rollout import RolloutEngine, keep_share, share_request
from trainer.grpo.sync_check import SyncBudget, SyncCheck, SyncGap, sync_metrics, sync_probe
from trainer.grpo.update import (
    Batch,
    backend_request,
    decode,
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


def evaluate_policy(
    engine, tokenizer, prompts: list[Prompt], scorer, samples: int, seed: int
) -> HeldOutResult:
    """Held-out metrics: mean reward, language accuracies, and text degeneracy.

    Every evaluation draws the same seeds (common random numbers: policies are compared on
    the same draws), one per (held-out prompt, sample).
    """
    seeds = group_seeds(seed, "held-out", range(len(prompts)), samples)
    rollouts = engine.generate([p.ids for p in prompts], seeds)
    texts = [decode(tokenizer, r.response_ids) for r in rollouts]
    asked = [prompts[r.prompt_index] for r in rollouts]
    results = scorer.score_batch(texts, [p.label for p in asked], prompts=[p.text for p in asked])
    outcomes = []
    for result in results:  # per language of the prompt: its reasoning label
        language = result.labels.answer if result.labels else "en"
        measured = measure_degeneracy(result.parsed.reasoning, result.parsed.final, language)
        reasoning = result.labels.reasoning if result.labels else None
        outcomes.append(Outcome.scored(reasoning, result, measured))
    return HeldOutResult.from_outcomes(outcomes, [r.finished for r in rollouts])


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
        site = engines.EngineSite(cfg, sft_model, load_tokenizer(sft_model), plan, job)
        engines.serve_rollouts(site, store, channel, weights, start)
        return None
    info = init_distributed(cfg.device, cfg.cpu_threads, plan.training_ranks, store, timeout)
    remote = engines.remote_engines(cfg, plan, channel, weights, info)

    def engines_ready() -> None:
        dedicated.announce_ready(store, job.rank)
        dedicated.wait_until_ready(store, plan.rollout_only_ranks, start, "rollout processes")

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
    tokenizer = load_tokenizer(sft_model)
    dtype = resolve_dtype(cfg.dtype, info.device)
    request = backend_request(cfg, sft_model, dtype, info, tokenizer.pad_token_id)
    backend, policy = build_backend(request)
    train_prompts, eval_prompts = load_prompt_sets(cfg, tokenizer, train_path, eval_path)
    scorer = ComplianceScorer(weights=RewardWeights(**cfg.reward_weights))
    site = engines.EngineSite(cfg, sft_model, tokenizer, plan, info)
    # colocated, the engine samples with the policy (the HF engine: the trained module itself)
    engine = remote or engines.colocated_engine(site, policy, backend)
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
        site,
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
        {
            k: v
            for k, v in ((0, state.mismatch_floor), (1, state.stale_mismatch_floor))
            if v is not None
        },
    )
    if engines_ready is not None:  # no process enters a collective while an engine loads
        engines_ready()
    producer = _producer(run, state, check)  # on-policy, it syncs the engine here
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
            writer.log(
                0, **{f"eval_{k}": v for k, v in state.baseline.metrics().items()}, **first_sync
            )
            save_policy_dir(backend, tokenizer, work_dir / BEST_DIR, dtype, sft_model, info)
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
            made = producer.take(step)  # async: step + 1 starts on the engine here …
            batch = score_rollouts(
                cfg, tokenizer, run.reward_fn, run.my_prompts(step), made.rollouts
            )
            batch, sampling = fill_signal_groups(
                cfg.algorithm.dynamic_sampling, batch, _resampler(run, producer, step), run.dp
            )
            producer.start_next(step)  # … or here, after dynamic sampling's rounds
            scored = time.monotonic()
            run.engine.sleep()  # colocated vLLM frees the GPU for the update
            stats = policy_update(
                cfg, backend, batch, tokenizer.pad_token_id, step, made.staleness > 0
            )
            train_time = time.monotonic() - scored
            # before anything from this step is saved (checkpoint, best policy, export)
            signal = run.dp.all_reduce_sum(float(batch.keep.sum())) > 0
            guard.check(done, stats["loss"], stats["grad_norm"], backend.module, signal)
            producer.updated(done)  # an idle engine takes the new weights now
            step_time = time.monotonic() - started
            tokens = run.dp.all_reduce_sum(float(sum(len(r.response_ids) for r in batch.rollouts)))
            writer.log(
                done,
                data_passes=round(done * cfg.prompts_per_step / len(train_prompts), 4),
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
            progress.update(1)
            progress.set_postfix(reward=f"{float(batch.rewards.mean()):.2f}")
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.max_steps):
                held_out = _evaluate(run, producer.ready_engine())
                ratios = held_out.reasoning_length_ratios(state.baseline)
                collapsed, loops = reasoning_collapsed(cfg, ratios), looping(cfg, held_out)
                # merged onto this step's line: the last line always carries the train loss
                writer.log(
                    done,
                    **{f"eval_{k}": v for k, v in (held_out.metrics() | ratios).items()},
                    eval_reasoning_collapsed=float(collapsed),
                    eval_looping=float(bool(loops)),
                    **sync_metrics(producer.sync_reports()),
                )
                if collapsed:
                    _on_collapse(cfg, ratios, done)
                if loops:
                    log.warning(
                        "step %d: the held-out loop rate is above guard.max_loop_rate=%s: %s; "
                        "this policy is not kept as the best",
                        done,
                        cfg.guard.max_loop_rate,
                        loops,
                    )
                state.last_eval = held_out.at_step(done)
                # rank 0 decides for all: every rank must take part in the save (ZeRO-3 gathers)
                if broadcast_object(_better(cfg, held_out, state.baseline, state.best), info):
                    state.best = held_out.at_step(done)
                    save_policy_dir(backend, tokenizer, work_dir / BEST_DIR, dtype, sft_model, info)
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


def _producer(run: _Run, state: RunState, check: SyncCheck) -> RolloutProducer:
    """The producer of each step's rollouts on this rank: its requests (the prompts its engine
    generates, one seed per response), its sync (with ``check``), what was in flight at the
    checkpoint."""
    cfg, info = run.cfg, run.info
    per_rank = cfg.prompts_per_step // run.dp.size
    share = engines.engine_share(run.site, run.dp)
    probe_from = run.eval_prompts or run.train_prompts
    probe = sync_probe([p.ids for p in probe_from], cfg.rollout.sync_check_tokens)
    pad_id = run.tokenizer.pad_token_id

    def requests(step: int, round_: int):
        # one seed per (step, slot of the step's batch, sample): the same on every rank and
        # every layout, never shared by two responses; dynamic sampling's rounds their own
        key = f"{step}/resample{round_}" if round_ else step
        seeds = group_seeds(cfg.seed, key, range(cfg.prompts_per_step), cfg.rollout.n_samples)
        prompts = [p.ids for p in run.step_prompts(step, round_)]
        return share_request(prompts, seeds, share, per_rank)

    budget = SyncBudget(cfg.rollout.sync_budget_s)
    producer = RolloutProducer(
        run.engine,
        requests,
        lambda version: sync_engine(
            run.engine, run.backend, probe, check, pad_id, info, version, budget, cfg.lora.r > 0
        ),
        cfg.rollout.async_steps,
        cfg.max_steps,
        select=lambda out: keep_share(out, share, run.dp.rank, per_rank),
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


def _better(
    cfg: GRPOConfig, held_out: HeldOutResult, baseline: HeldOutResult, best: HeldOutResult
) -> bool:
    """A held-out result beats the best so far without its text degenerating or its reasoning
    collapsing (the guard)."""
    floor = (1.0 - cfg.guard.max_real_word_drop) * baseline.real_word_share
    collapsed = reasoning_collapsed(cfg, held_out.reasoning_length_ratios(baseline))
    return (
        held_out.real_word_share >= floor
        and not collapsed
        and not looping(cfg, held_out)
        and held_out.mean_reward > best.mean_reward
    )


def looping(cfg: GRPOConfig, held_out: HeldOutResult) -> dict[str, float]:
    """The held-out loop rates above ``guard.max_loop_rate`` (``loop_rate`` overall,
    ``loop_rate_<language>`` per language); empty when none is."""
    rates = {"loop_rate": held_out.loop_rate} | {
        f"loop_rate_{language}": result.loop_rate
        for language, result in held_out.per_language.items()
    }
    return {k: round(v, 3) for k, v in rates.items() if v > cfg.guard.max_loop_rate}


class ReasoningCollapsedError(RuntimeError):
    """The held-out reasoning shrank below ``guard.min_reasoning_length_ratio`` of the SFT
    model's, and ``guard.reasoning_collapse`` is ``stop``."""


def reasoning_collapsed(cfg: GRPOConfig, ratios: dict[str, float]) -> bool:
    """Whether the held-out reasoning collapsed: overall or in a language, the median
    reasoning length fell below ``guard.min_reasoning_length_ratio`` of the SFT model's
    (``HeldOutResult.reasoning_length_ratios``; NaN ratios, where the SFT model did not
    reason, are not judged)."""
    floor = cfg.guard.min_reasoning_length_ratio
    return any(ratio < floor for ratio in ratios.values() if not math.isnan(ratio))


def _on_collapse(cfg: GRPOConfig, ratios: dict[str, float], step: int) -> None:
    """Flag (a warning; the policy is not kept as the best) or stop the run."""
    low = {k: round(v, 3) for k, v in ratios.items() if v < cfg.guard.min_reasoning_length_ratio}
    message = (
        f"step {step}: the held-out reasoning collapsed below "
        f"guard.min_reasoning_length_ratio={cfg.guard.min_reasoning_length_ratio} of the SFT "
        f"model's median length: {low}"
    )
    if cfg.guard.stops_on_collapse:
        raise ReasoningCollapsedError(message + " (guard.reasoning_collapse=stop)")
    log.warning("%s; this policy is not kept as the best", message)


def read_summary(work_dir: str | Path) -> GRPOResult:
    """The result a (possibly torchrun) GRPO run left in ``work_dir``."""
    return GRPOResult.from_json(json.loads((Path(work_dir) / SUMMARY_FILE).read_text()))
