"""A training step as the pipeline runs it, for SFT and GRPO alike: as a cluster job, in this
process, or on N local processes under torchrun; then rank 0's result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

from pydantic import BaseModel

from cluster.config import JobLaunch
from cluster.torchrun import run_step_processes
from trainer.metrics import METRICS_FILE

Result = TypeVar("Result")


@dataclass(frozen=True)
class TrainingStep(Generic[Result]):
    """What differs between the training steps when the pipeline runs one.

    Attributes:
        name: ``sft`` or ``grpo`` (job names, ``<name>_config.json``).
        module: the entry point, ``trainer.sft`` or ``trainer.grpo``.
        model_flag: the entry point's flag for the input model (``base-model``, ``sft-model``).
        run: the recipe, ``run(cfg, model, train, eval, model_output, work_dir)``: the result
            on rank 0, None elsewhere.
        read_result: rank 0's result from the summary it wrote in a work directory.
    """

    name: str
    module: str
    model_flag: str
    run: Callable[..., Result | None]
    read_result: Callable[[Path], Result]


class RecipePaths(NamedTuple):
    """The paths a recipe (``run_sft``, ``run_grpo``) takes after its config."""

    model: str | Path
    train: str | Path
    eval: str | Path | None
    model_output: str | Path
    work_dir: str | Path


def run_training_step(
    step: TrainingStep[Result],
    cfg: BaseModel,
    paths: RecipePaths,
    launch: JobLaunch | None = None,
    staged: tuple[str, ...] = (),
) -> Result:
    """Run ``step`` with ``cfg.nproc`` processes (plus GRPO's rollout-only ones): as a
    TrainJob or PyTorchJob when ``launch`` says so, else here; return rank 0's result.

    ``staged``: config fields (dotted) naming further inputs the job stages.
    """
    work_dir = Path(paths.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if launch is not None and launch.as_job:
        from cluster.step_job import StepJob, run_step_job

        job = StepJob(
            step.name, step.module, cfg, step.model_flag, paths.model, paths.train, paths.eval,
            staged, metrics_file=METRICS_FILE,
        )  # fmt: skip
        run_step_job(
            job, launch.execution, launch.run_id, paths.model_output, work_dir,
            launch.manifest_path, launch.image, rollout_image=launch.rollout_image,
        )  # fmt: skip
        return step.read_result(work_dir)
    if cfg.nproc == 1 and not getattr(cfg, "rollout_processes", 0):
        result = step.run(cfg, *paths)
        assert result is not None  # a single process is rank 0
        return result
    args = [
        f"--{step.model_flag}", str(paths.model), "--train", str(paths.train),
        "--model-output", str(paths.model_output), "--work-dir", str(work_dir),
    ]  # fmt: skip
    if paths.eval:
        args += ["--eval", str(paths.eval)]
    run_step_processes(step.module, cfg, args, work_dir / f"{step.name}_config.json")
    return step.read_result(work_dir)
