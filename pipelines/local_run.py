"""Run the whole pipeline on this machine with ``kfp.local`` (no cluster, no GPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pipelines.local_console import QuietConsole
from pipelines.presets import Preset, pipeline_arguments

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalRunResult:
    """Where a local run put its outputs, and how long it took."""

    pipeline_root: Path
    outputs: dict[str, Path]
    seconds: float
    log_path: Path | None = None
    """kfp.local's own output and every step's output (quiet runs)."""


def run_local(
    preset: Preset,
    output_dir: Path,
    enable_caching: bool = False,
    quiet: bool = True,
    on_log: Callable[[Path], None] | None = None,
) -> LocalRunResult:
    """Run the pipeline with ``preset``'s arguments under ``kfp.local``.

    Components run as subprocesses of this Python (``SubprocessRunner(use_venv=False)``),
    so they import the installed lingo-rl, exactly as they do inside the project's image.
    Task outputs land under ``output_dir``. ``quiet`` (the default) prints one line per step
    and the training bars, and keeps kfp.local's output in
    ``output_dir/logs/run-<timestamp>.log`` (``on_log`` gets its path first); otherwise
    kfp.local prints everything.

    Raises:
        RunInputError: an input or the output directory would fail a step
            (``pipelines.preflight``); nothing has run.
        LocalStepFailedError: a step failed (quiet runs; otherwise kfp.local's RuntimeError).
        OutputDirBusyError: another run writes into ``output_dir``.
    """
    from kfp import local

    from pipelines.pipeline import lingo_pipeline
    from pipelines.preflight import check_run_inputs

    check_run_inputs(preset, output_dir, local=True)

    # kfp.local warns that it ignores display names and that our image is not a stock Python
    # image; both are expected here (components import the installed project).
    warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
    warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
    output_dir = output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    with output_dir_lock(output_dir):
        if not quiet:
            return _run_locked(local, lingo_pipeline, preset, output_dir, enable_caching)
        log_path = output_dir / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log"
        if on_log is not None:
            on_log(log_path)
        with QuietConsole(log_path):  # a failed step: LocalStepFailedError
            result = _run_locked(local, lingo_pipeline, preset, output_dir, enable_caching)
        return dataclasses.replace(result, log_path=log_path)


class OutputDirBusyError(RuntimeError):
    """Another local run is writing into the same output directory."""


LOCK_FILE = ".lingo-run.lock"


@contextlib.contextmanager
def output_dir_lock(output_dir: Path) -> Iterator[None]:
    """Hold ``output_dir``'s run lock (released when the process ends, even killed).

    Raises:
        OutputDirBusyError: another run holds it.
    """
    path = output_dir / LOCK_FILE
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise OutputDirBusyError(
                f"{output_dir} is in use by another local run (pid {holder}; lock {path}); "
                "wait for it to end or pass another --output-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield


def _run_locked(local, lingo_pipeline, preset, output_dir, enable_caching) -> LocalRunResult:
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(output_dir),
        enable_caching=enable_caching,
    )
    before = {p.name for p in output_dir.iterdir()}
    start = time.monotonic()
    arguments = pipeline_arguments(preset)
    arguments |= tracking_arguments()
    lingo_pipeline(**arguments)
    seconds = time.monotonic() - start
    return LocalRunResult(
        pipeline_root=output_dir, outputs=_main_outputs(output_dir, before), seconds=seconds
    )


def tracking_arguments() -> dict[str, str]:
    """The pipeline's MLflow arguments for a local run, from this process's environment.

    A URI holding a password is not an argument (kfp.local prints every task's executor
    input, arguments included): the components, subprocesses of this one, read it from the
    inherited ``MLFLOW_TRACKING_URI``.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri and urlsplit(uri).password is not None:
        log.info("MLFLOW_TRACKING_URI holds a password: the steps read it from the environment")
        uri = ""
    return {
        "mlflow_tracking_uri": uri,
        "mlflow_experiment": os.environ.get("MLFLOW_EXPERIMENT_NAME", ""),
    }


def _main_outputs(output_dir: Path, before: set[str]) -> dict[str, Path]:
    """``MAIN_OUTPUTS`` of the run that just ended: kfp.local writes each task's outputs to
    ``<pipeline_root>/<pipeline>-<timestamp>/<task>/<output>``."""
    from pipelines.pipeline import MAIN_OUTPUTS, PIPELINE_NAME

    runs = sorted(
        p for p in output_dir.glob(f"{PIPELINE_NAME}-*") if p.is_dir() and p.name not in before
    )
    if not runs:
        raise RuntimeError(f"the local run left no run directory under {output_dir}")
    run = runs[-1]
    outputs = {
        name: run / task / output
        for name, (task, output) in MAIN_OUTPUTS.items()
        if (run / task / output).exists()
    }
    _link_reports(run / "reports", outputs)
    return outputs


REPORT_LINKS = {
    "eval.html": "eval_report_html",
    "eval.md": "eval_report",
    "sft.html": "sft_report",
    "grpo.html": "grpo_report",
}
"""``<run>/reports/<name>`` → the output it links to (kfp.local names files after outputs,
without an extension; a browser opens these links)."""


def _link_reports(reports: Path, outputs: dict[str, Path]) -> None:
    for name, output in REPORT_LINKS.items():
        if output in outputs:
            reports.mkdir(exist_ok=True)
            link = reports / name
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(outputs[output], reports))
            outputs.setdefault("reports", reports)
