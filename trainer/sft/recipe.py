"""The SFT recipe: load → (LoRA) → train with eval and checkpoints → merge → save.

Reads top to bottom; every moving part (backend, data, metrics writer) is built here from the
config and passed along. Runs as one process or as every rank of a ``torchrun`` job.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from core.atomic import check_output_dir, check_writable
from core.modeling import load_causal_lm, load_tokenizer, resolve_dtype
from core.tracking import log_artifact, mlflow_run
from trainer.backends import TorchBackend, TrainingBackend, make_backend
from trainer.backends.loading import load_training_model
from trainer.checkpoint import resume, run_fingerprint, save_checkpoint
from trainer.distributed import DistInfo, all_reduce_sum, init_distributed, seed_everything
from trainer.divergence import DivergenceGuard
from trainer.metrics import METRICS_FILE, MetricsWriter, plot_metrics, read_metrics
from trainer.progress import serve_progress
from trainer.sft.config import SFTConfig
from trainer.sft.data import (
    Example,
    collate,
    load_examples,
    micro_batches,
    token_loss_sum,
)
from trainer.sft.lora import apply_lora
from trainer.sft.merge import merge_and_save

log = logging.getLogger(__name__)

SUMMARY_FILE = "sft_summary.json"


@dataclass
class SFTResult:
    """What an SFT run produced (rank 0)."""

    model_dir: str
    metrics_file: str
    loss_plot: str | None
    steps: int
    first_loss: float
    last_loss: float
    eval_loss: float | None
    examples: int
    dropped_overlong: int
    truncated: int
    merge: dict


@dataclass(frozen=True)
class SFTState:
    """Where an SFT run is: what a checkpoint's ``trainer_state.json`` keeps, and what a resume
    gives back (``from_json``). On disk ``{"epoch": ..., "step": ...}``, as always.

    Attributes:
        epoch: the epoch the step was in (the data order of ``micro_batches``).
        step: optimizer steps done.
    """

    epoch: int = 0
    step: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict | None) -> SFTState:
        """The state ``trainer.checkpoint.resume`` returned; the start when it found none.

        Raises:
            ValueError: a trainer state without an integer ``step``.
        """
        if data is None:
            return cls()
        if not isinstance(data.get("step"), int):
            raise ValueError(
                f"SFT checkpoint's trainer_state.json has no integer 'step' ({data!r}): "
                "move that checkpoint out of the work directory's checkpoints/ to start over"
            )
        return cls(epoch=int(data.get("epoch", 0)), step=data["step"])


def _target_count(example: Example) -> int:
    return sum(1 for t in example.labels[1:] if t != -100)


def evaluate(module, examples: list[Example], micro_batch_size: int, pad_id: int, device) -> float:
    """Mean token loss over ``examples`` (every rank evaluates all of them, same result)."""
    total, tokens = 0.0, 0
    module.eval()
    with torch.no_grad():
        for start in range(0, len(examples), micro_batch_size):
            batch = {
                k: v.to(device)
                for k, v in collate(examples[start : start + micro_batch_size], pad_id).items()
            }
            logits = module(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            total += float(token_loss_sum(logits, batch["labels"]))
            tokens += int((batch["labels"][:, 1:] != -100).sum())
    module.train()
    return total / max(1, tokens)


def run_sft(
    cfg: SFTConfig,
    base_model: str | Path,
    train_path: str | Path,
    eval_path: str | Path | None,
    model_output: str | Path,
    work_dir: str | Path,
) -> SFTResult | None:
    """Train, merge and save; returns the result on rank 0 (None on other ranks).

    ``work_dir`` holds ``training_metrics.jsonl``, ``loss.png``, checkpoints and the adapter;
    a run finding checkpoints there resumes from the newest one.
    """
    work_dir, model_output = Path(work_dir), Path(model_output)
    check_output_dir(model_output, "--model-output", work_dir=work_dir)
    check_writable(model_output.parent)  # a read-only or full disk, found before training
    info = init_distributed(cfg.device, cfg.cpu_threads, timeout=cfg.collective_timeout)
    seed_everything(cfg.seed)

    tokenizer = load_tokenizer(base_model)
    dtype = resolve_dtype(cfg.dtype, info.device)
    model, ds_config = _training_model(cfg, base_model, dtype, info)
    vocab_size = model.config.vocab_size  # the loss of a uniform guess is ln(vocab_size)

    train, stats = load_examples(train_path, tokenizer, cfg.max_seq_len, cfg.overlong)
    evals = (
        load_examples(eval_path, tokenizer, cfg.max_seq_len, cfg.overlong)[0] if eval_path else []
    )
    evals = evals[: cfg.eval_max_examples]
    steps_per_epoch = _steps_per_epoch(cfg, train, info.world_size, train_path)
    max_steps = cfg.max_steps or math.ceil(cfg.num_epochs * steps_per_epoch)

    backend = make_backend(
        model,
        cfg.optim,
        max_steps,
        info,
        cfg.micro_batch_size,
        cfg.gradient_accumulation_steps,
        bf16=dtype == torch.bfloat16,
        ds_config=ds_config,
    )
    checkpoints = work_dir / "checkpoints"
    run_config = run_fingerprint(cfg.model_dump(mode="json"), base_model, train_path, eval_path)
    guard = _divergence_guard(cfg, checkpoints, info, vocab_size)
    start_step = SFTState.from_json(resume(checkpoints, backend, info, run_config, guard)).step

    with (
        mlflow_run("sft", cfg.model_dump(), info.is_main) as run,
        serve_progress(info.is_main) as progress,
    ):
        # training by epochs, ``epoch`` counts them; by steps, the run is one planned epoch
        planned_epochs = cfg.num_epochs if not cfg.max_steps else 1.0
        writer = MetricsWriter(
            work_dir / METRICS_FILE,
            max_steps,
            planned_epochs,
            info.is_main,
            start_step,
            run,
            progress,
        )
        sft_run = _SFTRun(
            cfg, info, backend, train, evals, tokenizer.pad_token_id, checkpoints, run_config, guard
        )
        _train_loop(sft_run, writer, start_step, max_steps, steps_per_epoch)
        final = _final_model(cfg, backend, base_model, dtype, info)  # every rank takes part
        if not info.is_main:
            return None
        if cfg.lora.r:
            final.save_pretrained(work_dir / "adapter")
        prompts = [e.input_ids[: len(e.input_ids) - _target_count(e)] for e in (evals or train)]
        merge = merge_and_save(
            final.cpu(), tokenizer, prompts[: cfg.merge_check_prompts], model_output
        )
        return _write_result(work_dir, model_output, max_steps, stats, merge, run is not None)


def _divergence_guard(cfg: SFTConfig, checkpoints: Path, info, vocab_size: int):
    """SFT's divergence guard: stops after ``max_zero_grad_steps`` steps with a zero gradient
    or on a loss spike (a uniform guess's loss, ln(vocab_size), is its scale)."""
    return DivergenceGuard(
        "SFT",
        checkpoints,
        info,
        cfg.optim.max_zero_grad_steps,
        uniform_loss=math.log(vocab_size),
        max_loss_spike=cfg.optim.max_loss_spike,
    )


def _training_model(cfg: SFTConfig, base_model: str | Path, dtype: torch.dtype, info):
    """The model SFT trains and its DeepSpeed config: under ZeRO-3 built partitioned (no rank
    ever holds the whole model; GRPO loads the same), gradient checkpointing as configured,
    the LoRA adapter on it when ``cfg.lora`` asks."""
    model, ds_config = load_training_model(
        base_model, dtype, cfg.optim, info, cfg.micro_batch_size, cfg.gradient_accumulation_steps
    )
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return apply_lora(model, cfg.lora), ds_config


def _steps_per_epoch(cfg: SFTConfig, train: list, world_size: int, train_path) -> int:
    """Optimizer steps in one pass over ``train`` (its micro-batches over the processes and
    the accumulation).

    Raises:
        ValueError: fewer examples than one global batch (named with its sizes)."""
    lengths = [len(e.input_ids) for e in train]
    per_step = cfg.gradient_accumulation_steps * world_size
    steps = len(micro_batches(lengths, cfg.micro_batch_size, cfg.seed, 0)) // per_step
    if steps == 0:
        raise ValueError(
            f"{train_path}: {len(train)} examples are fewer than one global batch "
            f"(micro_batch_size {cfg.micro_batch_size} × gradient_accumulation_steps "
            f"{cfg.gradient_accumulation_steps} × {world_size} processes)"
        )
    return steps


def _write_result(
    work_dir: Path, model_output: Path, max_steps: int, stats, merge, tracked: bool
) -> SFTResult:
    """Rank 0 after the merge: the loss plot, the run's summary file (and the plot in the
    MLflow run when ``tracked``)."""
    lines = read_metrics(work_dir / METRICS_FILE)
    plot = plot_metrics(
        work_dir / METRICS_FILE,
        work_dir / "loss.png",
        ["loss", "eval_loss", "learning_rate", "grad_norm"],
        "SFT",
    )
    losses = [m["loss"] for m in lines if m.get("loss") is not None]
    eval_losses = [m["eval_loss"] for m in lines if m.get("eval_loss") is not None]
    result = SFTResult(
        model_dir=str(model_output),
        metrics_file=str(work_dir / METRICS_FILE),
        loss_plot=str(plot) if plot else None,
        steps=max_steps,
        first_loss=losses[0] if losses else float("nan"),
        last_loss=losses[-1] if losses else float("nan"),
        eval_loss=eval_losses[-1] if eval_losses else None,
        examples=stats.kept,
        dropped_overlong=stats.dropped_overlong + stats.dropped_prompt_too_long,
        truncated=stats.truncated,
        merge=merge,
    )
    (work_dir / SUMMARY_FILE).write_text(json.dumps(asdict(result), indent=2))
    if tracked and plot:
        log_artifact(plot)
    return result


@dataclass
class _SFTRun:
    """What ``run_sft`` built for the loop: the config, the processes, the backend, the data
    and where checkpoints go (with what they record)."""

    cfg: SFTConfig
    info: DistInfo
    backend: TrainingBackend
    train: list[Example]
    evals: list[Example]
    pad_id: int
    checkpoints: Path
    run_config: dict
    """The step's config, model and data as a checkpoint records them (``resume`` compares)."""
    guard: DivergenceGuard


def _train_loop(
    run: _SFTRun, writer: MetricsWriter, start_step: int, max_steps: int, steps_per_epoch: int
) -> None:
    cfg, info, backend, train, evals, pad_id = (
        run.cfg, run.info, run.backend, run.train, run.evals, run.pad_id
    )  # fmt: skip
    lengths = [len(e.input_ids) for e in train]
    targets = [_target_count(e) for e in train]
    gas = cfg.gradient_accumulation_steps
    orders: dict[int, list[list[int]]] = {}
    backend.module.train()
    progress = tqdm(
        total=max_steps, initial=start_step, desc="sft", mininterval=2.0, disable=not info.is_main
    )
    for step in range(start_step, max_steps):
        epoch, position = divmod(step, steps_per_epoch)
        if epoch not in orders:
            orders = {epoch: micro_batches(lengths, cfg.micro_batch_size, cfg.seed, epoch)}
        step_batches = orders[epoch][
            position * gas * info.world_size : (position + 1) * gas * info.world_size
        ]
        global_tokens = sum(targets[i] for batch in step_batches for i in batch)
        mine = step_batches[info.rank * gas : (info.rank + 1) * gas]
        step_loss = 0.0
        for indices in mine:
            batch = {
                k: v.to(info.device)
                for k, v in collate([train[i] for i in indices], pad_id).items()
            }
            logits = backend.module(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            loss = token_loss_sum(logits, batch["labels"]) / global_tokens
            backend.backward(loss)
            step_loss += float(loss.detach())
        learning_rate = backend.learning_rate()
        grad_norm = backend.step()
        step_loss = all_reduce_sum(step_loss, info)
        done = step + 1
        # before this step's state can reach a checkpoint, the merge or the export
        run.guard.check(done, step_loss, grad_norm, backend.module)
        writer.log(
            done,
            data_passes=round(done / steps_per_epoch, 4),
            loss=step_loss,
            learning_rate=learning_rate,
            grad_norm=grad_norm,
            tokens=global_tokens,
        )
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.3f}")
        if evals and ((cfg.eval_every and done % cfg.eval_every == 0) or done == max_steps):
            eval_loss = evaluate(backend.module, evals, cfg.micro_batch_size, pad_id, info.device)
            writer.log(done, eval_loss=eval_loss)  # merged onto this step's line
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < max_steps:
            save_checkpoint(
                run.checkpoints,
                done,
                backend,
                SFTState(epoch, done).to_json(),
                info,
                cfg.keep_checkpoints,
                run.run_config,
                run.guard.state_dict(),
            )
    progress.close()


def _final_model(cfg: SFTConfig, backend, base_model, dtype, info: DistInfo):
    """The trained model on rank 0, on CPU, still carrying its adapter (if any); None on the
    other ranks. Collective.

    Under DeepSpeed rank 0 builds the model on its host and the trained weights are copied
    into it one at a time as the backend streams them (under ZeRO-3 each gathered over the
    ranks, then released): one whole copy on rank 0, for the merge, and none elsewhere.
    """
    if isinstance(backend, TorchBackend):
        return backend.unwrapped()  # plain PyTorch: the model itself
    model = apply_lora(load_causal_lm(base_model, dtype), cfg.lora) if info.is_main else None
    target = dict(model.named_parameters()) if model is not None else {}
    streamed = []
    with torch.no_grad():
        for name, tensor in backend.hf_weights():
            if name in target:
                target[name].copy_(tensor)
            streamed.append(name)
    if model is not None and set(streamed) != set(target):
        raise RuntimeError(
            f"the trained weights do not fit {base_model} with the adapter: missing "
            f"{sorted(set(target) - set(streamed))[:5]}, unexpected "
            f"{sorted(set(streamed) - set(target))[:5]}"
        )
    return model
