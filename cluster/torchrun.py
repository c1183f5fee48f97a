"""Run a training entry point as N local processes under ``torchrun``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from cluster.nodes import OMP_THREADS_ENV, omp_threads
from core.atomic import atomic_write_text

log = logging.getLogger(__name__)

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2: ``<quota> <period>`` in microseconds, or ``max <period>`` (no limit)."""


class TrainingProcessError(RuntimeError):
    """A torchrun training job exited with an error."""


def torchrun_command(module: str, args: list[str], nproc: int) -> list[str]:
    """``torchrun --standalone --nproc_per_node N -m module args…`` with this Python."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    return [*torchrun, "--standalone", f"--nproc_per_node={nproc}", "-m", module, *args]


def entry_point_command(module: str, args: list[str], nnodes: int | None = None) -> list[str]:
    """A job container's command: torchrun on ``module``, its rendezvous settings from the
    ``PET_*`` variables the Training Operator (PyTorchJob) or the Trainer controller
    (TrainJob) sets; the image's ``python``. ``nnodes`` overrides ``PET_NNODES`` (a
    two-image TrainJob's training pods: the Trainer counts only them; torchrun takes ``PET_*``
    as the default of its arguments, ``torch/distributed/argparse_util.py``, ``env``)."""
    torchrun = ["python", "-m", "torch.distributed.run"]
    if nnodes is not None:
        torchrun.append(f"--nnodes={nnodes}")
    return [*torchrun, "-m", module, *args]


def processes_problem(cfg) -> str | None:
    """Why a step config's processes cannot run (``nproc`` > 1 with the single-process
    ``torch`` backend: ``OptimConfig.multi_process``), else None; checked when the pipeline
    is compiled and at launch."""
    if not cfg.optim.multi_process and cfg.nproc > 1:
        return (
            f"nproc={cfg.nproc} needs optim.backend=deepspeed (or megatron for GRPO); "
            f"got {cfg.optim.backend!r}, which runs one process"
        )
    return None


def run_step_processes(module: str, cfg, args: list[str], config_file) -> None:
    """Write ``cfg`` (a pydantic step config) to ``config_file`` and run ``module`` on
    ``cfg.nproc`` training processes (plus GRPO's rollout-only ones) with ``--config
    config_file`` plus ``args``.

    Raises:
        ValueError: several processes with the single-process ``torch`` backend.
    """
    if (problem := processes_problem(cfg)) is not None:
        raise ValueError(problem)
    atomic_write_text(config_file, cfg.model_dump_json(indent=2))
    # GRPO's dedicated rollout engines run in processes of their own, after the training ones
    processes = cfg.nproc + getattr(cfg, "rollout_processes", 0)
    run_torchrun(module, ["--config", str(config_file), *args], processes)


def available_cpus() -> float:
    """CPUs this process may use: its affinity mask, capped by the cgroup v2 CPU quota
    (``/sys/fs/cgroup/cpu.max``, a container's CPU limit) when there is one."""
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = CGROUP_CPU_MAX.read_text(encoding="ascii").split()[:2]
    except (OSError, ValueError):
        return cpus
    return cpus if quota == "max" else min(cpus, int(quota) / int(period))


def local_omp_threads(nproc: int) -> int:
    """``OMP_NUM_THREADS`` of each of ``nproc`` local processes: this process's CPU share
    divided among them (``cluster.nodes.omp_threads``). The share is ``OMP_NUM_THREADS``
    when set (a pipeline pod's CPU request: ``pipelines.platform``), else
    ``available_cpus()``."""
    share = os.environ.get(OMP_THREADS_ENV)
    if share:
        try:
            cpus = float(share)
        except ValueError:
            raise ValueError(f"{OMP_THREADS_ENV}={share!r}: expected a number of threads") from None
    else:
        cpus = available_cpus()
    return omp_threads(cpus, nproc)


def run_torchrun(module: str, args: list[str], nproc: int) -> None:
    """Launch ``module`` on ``nproc`` local processes and wait.

    Raises:
        TrainingProcessError: a process failed (its traceback is in the log).
    """
    command = torchrun_command(module, args, nproc)
    log.info("launching: %s", " ".join(command))
    env = {**os.environ, OMP_THREADS_ENV: str(local_omp_threads(nproc))}
    completed = subprocess.run(command, env=env, check=False)
    if completed.returncode != 0:
        raise TrainingProcessError(
            f"{module} with {nproc} processes exited with code {completed.returncode}; "
            "the first failing rank's traceback is in the log above"
        )
