"""Run the whole pipeline on this machine with ``kfp.local`` (no cluster, no GPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from core.atomic import atomic_writer, open_no_follow
from core.redact import redact
from core.tracking import local_store_uri, mlflow_ui_command
from eval.gate import GateConfig
from pipelines.local_console import QuietConsole
from pipelines.presets import Preset
from pipelines.run_form import form_arguments
from pipelines.step_processes import local_steps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalRunResult:
    """Where a local run put its outputs, and how long it took."""

    pipeline_root: Path
    outputs: dict[str, Path]
    seconds: float
    log_path: Path | None = None
    """kfp.local's own output and every step's output (quiet runs)."""
    run_dir: Path | None = None
    """The run's directory: ``<pipeline_root>/lingo-rl-<timestamp>``."""
    tracking_uri: str = ""
    """Where the steps tracked to (``MLFLOW_TRACKING_URI``, or the local SQLite store)."""


def run_local(
    preset: Preset,
    output_dir: Path,
    enable_caching: bool = False,
    quiet: bool = True,
    on_log: Callable[[Path], None] | None = None,
) -> LocalRunResult:
    """Run ``preset``'s pipeline under ``kfp.local``, its form as the preset fills it.

    Components run as subprocesses of this Python (``SubprocessRunner(use_venv=False)``),
    so they import the installed lingo-rl, exactly as they do inside the project's image.
    Task outputs land under ``output_dir``. ``quiet`` (the default) prints one line per step
    and the training bars, and keeps kfp.local's output in
    ``output_dir/logs/run-<timestamp>.log`` (``on_log`` gets its path first); otherwise
    kfp.local prints everything.

    Every step runs in a process group of its own; when this process is interrupted (SIGINT,
    SIGTERM: ``SystemExit(143)``) or the run fails, the running step's group is stopped
    (``pipelines.step_processes``), and a step dies with this process even when it is killed.

    Raises:
        RunInputError: an input or the output directory would fail a step
            (``pipelines.preflight``); nothing has run.
        LocalStepFailedError: a step failed (quiet runs; otherwise kfp.local's RuntimeError).
        OutputDirBusyError: another run writes into ``output_dir``.
    """
    from kfp import local

    from pipelines.preflight import check_run_inputs

    check_run_inputs(preset, output_dir, local=True)

    # kfp.local warns that it ignores display names and that our image is not a stock Python
    # image; both are expected here (components import the installed project).
    warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
    warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
    output_dir = output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    with output_dir_lock(output_dir):
        # holding the lock, no other local run writes this folder's store: a run still
        # RUNNING there was left by a run killed with SIGKILL
        close_abandoned_runs(output_dir)
        try:
            return _run_steps(local, preset, output_dir, enable_caching, quiet, on_log)
        except (KeyboardInterrupt, SystemExit):  # SIGINT, SIGTERM: no exit handler ran
            close_abandoned_runs(output_dir, interrupted=True)
            raise


def _run_steps(local, preset, output_dir, enable_caching, quiet, on_log) -> LocalRunResult:
    from pipelines.pipeline import build_pipeline

    fingerprints = input_fingerprints(preset) if enable_caching else None
    lingo_pipeline = build_pipeline(preset, input_fingerprints=fingerprints)
    with local_steps() as steps:  # steps stop with the run
        if not quiet:
            return _run_locked(local, lingo_pipeline, preset, output_dir, enable_caching)
        log_path = output_dir / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log"
        if on_log is not None:
            on_log(log_path)
        with QuietConsole(log_path, steps=steps):  # a failed step: LocalStepFailedError
            result = _run_locked(local, lingo_pipeline, preset, output_dir, enable_caching)
        return dataclasses.replace(result, log_path=log_path)


WHOLE_HASH_MAX = 256 << 20
"""Files up to this size are fingerprinted by their content (SHA-256); larger ones (model
weights: 13 GB for gpt-oss-20b) by size, inode, modification and change time."""


def input_fingerprints(preset: Preset) -> dict[str, str]:
    """Step name → a fingerprint of the local files the step reads, for ``--cache``: the model
    directory ``model.source`` (base-model), ``data_prep.source`` and the question sets'
    sources (data-prep), ``eval.questions`` (evaluate). A hub id or an ``s3://`` URI is keyed
    by its name only (kfp.local's own rule for remote artifacts), as is ``tiny`` (built from
    the config, which is an argument)."""
    paths = {
        "base-model": [preset.model.source],
        "data-prep": [preset.data_prep.source, *(s.source for s in preset.data_prep.question_sets)],
        "evaluate": [preset.eval.questions or ""],
    }
    fingerprints = {}
    for step, sources in paths.items():
        local = [Path(s) for s in sources if s and "://" not in s and Path(s).exists()]
        if local:
            fingerprints[step] = _fingerprint(local)
    return fingerprints


def _fingerprint(paths: list[Path]) -> str:
    """SHA-256 over every file under ``paths``: its name and, up to ``WHOLE_HASH_MAX``, its
    content; beyond, its size, inode and modification and change times (the change time is set
    by the kernel on every write, rename or replace, and no user can set it back)."""
    import hashlib

    digest = hashlib.sha256()
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            info = path.stat()
            digest.update(f"{path}\0{info.st_size}\0".encode())
            if info.st_size <= WHOLE_HASH_MAX:
                with path.open("rb") as handle:
                    for block in iter(lambda handle=handle: handle.read(1 << 20), b""):
                        digest.update(block)
            else:
                stamp = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns)
                digest.update(repr(stamp).encode())
    return digest.hexdigest()


def close_abandoned_runs(output_dir: Path, interrupted: bool = False) -> list[str]:
    """Mark the MLflow runs an interrupted or killed local run left RUNNING ``KILLED``, and
    return their ids.

    Called holding the folder's lock: when a run is interrupted (SIGINT, SIGTERM: kfp.local
    runs no exit handler; ``interrupted``), and when the next run into the folder starts (a
    run killed with SIGKILL closed nothing). In the folder's own store (``mlflow.db``, no
    ``MLFLOW_TRACKING_URI``) that is every RUNNING run. A store the user named may be shared:
    there only the runs a local run's steps tagged ``lingo.local_run = <this host>:<pid>``
    are closed, when that process is this one (``interrupted``) or is gone; anyone else's runs,
    and a live local run's, are left alone.
    """
    named = os.environ.get("MLFLOW_TRACKING_URI")
    if not named and not (output_dir / "mlflow.db").is_file():
        return []
    from mlflow import MlflowClient

    from core import tracking

    if named:
        client = MlflowClient()
        experiment = client.get_experiment_by_name(
            os.environ.get("MLFLOW_EXPERIMENT_NAME") or tracking.DEFAULT_EXPERIMENT
        )
        experiments = [experiment.experiment_id] if experiment is not None else []
    else:
        client = MlflowClient(tracking_uri=local_store_uri(output_dir))
        experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    running = client.search_runs(experiments, filter_string="attributes.status = 'RUNNING'")
    if named:
        running = [r for r in running if _left_by_a_gone_local_run(r.data.tags, interrupted)]
    for run in running:
        client.set_terminated(run.info.run_id, "KILLED")
    if running:
        log.warning(
            "marked %d MLflow run(s) of an interrupted local run KILLED in %s",
            len(running),
            redact(named) if named else output_dir / "mlflow.db",
        )
    return [run.info.run_id for run in running]


def _left_by_a_gone_local_run(tags: dict[str, str], interrupted: bool) -> bool:
    """Whether a RUNNING run's ``lingo.local_run`` tag names a local run on this host that is
    this interrupted process or no longer exists."""
    from core.tracking import local_run_pid

    pid = local_run_pid(tags)
    if pid is None:
        return False
    if pid == os.getpid():
        return interrupted
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


class OutputDirBusyError(RuntimeError):
    """Another local run is writing into the same output directory."""


LOCK_FILE = ".lingo-run.lock"


@contextlib.contextmanager
def output_dir_lock(output_dir: Path) -> Iterator[None]:
    """Hold ``output_dir``'s run lock (released when the process ends, even killed).

    Raises:
        OutputDirBusyError: another run holds it.
        LinkRefusedError: the lock file is a symbolic link (writing the PID through it would
            overwrite its target).
    """
    path = output_dir / LOCK_FILE
    with open_no_follow(path, "r+") as handle:  # a link planted there is refused
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


def _redact_task_outputs(output_dir: Path, before: set[str]) -> None:
    """Redact the task outputs kfp.local kept of this run (``executor_output.json``): the
    ``configure`` step's outputs carry the run's values as given, a source URL's credential
    included, and a local run's files hold no secret (``core.redact``)."""
    for run in (p for p in output_dir.iterdir() if p.name not in before and p.is_dir()):
        for path in run.rglob("executor_output.json"):
            text = path.read_text(errors="replace")
            clean = redact(text)
            if clean != text:
                with atomic_writer(path) as handle:
                    handle.write(clean)


def _run_locked(local, lingo_pipeline, preset, output_dir, enable_caching) -> LocalRunResult:
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(output_dir),
        enable_caching=enable_caching,
    )
    before = {p.name for p in output_dir.iterdir()}
    start = time.monotonic()
    arguments = form_arguments(preset) | tracking_arguments(output_dir)
    try:
        lingo_pipeline(**arguments)
    finally:
        _redact_task_outputs(output_dir, before)
    seconds = time.monotonic() - start
    run_dir, outputs = _main_outputs(output_dir, before)
    return LocalRunResult(
        pipeline_root=output_dir,
        outputs=outputs,
        seconds=seconds,
        run_dir=run_dir,
        tracking_uri=redact(
            os.environ.get("MLFLOW_TRACKING_URI") or arguments["mlflow_tracking_uri"]
        ),
    )


def tracking_arguments(output_dir: Path | None = None) -> dict[str, str]:
    """The pipeline's MLflow arguments for a local run, from this process's environment.

    No ``MLFLOW_TRACKING_URI``: the run tracks to the SQLite store ``output_dir/mlflow.db``
    (no server; every run into ``output_dir`` shares it, so the registry's champion carries
    over from one run to the next). A URI holding a password is not an argument (kfp.local
    prints every task's executor input, arguments included): the components, subprocesses of
    this one, read it from the inherited ``MLFLOW_TRACKING_URI``.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri and urlsplit(uri).password is not None:
        log.info("MLFLOW_TRACKING_URI holds a password: the steps read it from the environment")
        uri = ""
    elif not uri and output_dir is not None:
        uri = local_store_uri(output_dir)
    return {
        "mlflow_tracking_uri": uri,
        "mlflow_experiment": os.environ.get("MLFLOW_EXPERIMENT_NAME", ""),
    }


def _main_outputs(output_dir: Path, before: set[str]) -> tuple[Path, dict[str, Path]]:
    """The directory and ``MAIN_OUTPUTS`` of the run that just ended: kfp.local writes each
    task's outputs to ``<pipeline_root>/<pipeline>-<timestamp>/<task>/<output>``."""
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
    _copy_reports(run / "reports", outputs)
    return run, outputs


REPORT_FILES = {
    "eval.html": "eval_report_html",
    "eval.md": "eval_report",
    "sft.html": "sft_report",
    "grpo.html": "grpo_report",
}
"""``<run>/reports/<name>`` ← the output copied there. kfp.local names files after outputs,
without an extension; a browser decides how to show a file by its name (through a symlink,
by the target's name: an extensionless page shows as its source text), so these are copies."""


def _copy_reports(reports: Path, outputs: dict[str, Path]) -> None:
    for name, output in REPORT_FILES.items():
        if output in outputs:
            with atomic_writer(reports / name, "wb") as copy:
                copy.write(outputs[output].read_bytes())
            outputs.setdefault("reports", reports)


def tracking_summary(result: LocalRunResult, gate: GateConfig) -> list[str]:
    """What the run left in its local MLflow store, read back from it, and how to open it.

    For the SQLite store of ``tracking_arguments`` only (a server the user named is theirs to
    open): the pipeline's run and its step runs, the gate's decision and the registered model
    the ``register`` step made champion.
    """
    uri = result.tracking_uri
    if not uri.startswith("sqlite:///") or result.run_dir is None:
        return [f"MLflow: tracked to {uri}"] if uri else []
    from mlflow import MlflowClient

    from core.tracking import STEP_TAG

    outputs = json.loads((result.run_dir / "start-tracking" / "executor_output.json").read_text())
    parent_id = outputs["parameterValues"]["Output"]
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    parent = client.get_run(parent_id)
    experiment = client.get_experiment(parent.info.experiment_id)
    steps = {
        run.data.tags.get(STEP_TAG): run
        for run in client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'"
        )
    }
    lines = [
        f"MLflow: run '{parent.info.run_name}' ({parent.info.status}) with {len(steps)} step "
        f"runs ({', '.join(sorted(steps))}) in experiment '{experiment.name}' of {uri}"
    ]
    decision = steps["gate"].data.params.get("decision") if "gate" in steps else "not run"
    registered = (
        steps["register"].data.params.get("registered_version") if "register" in steps else ""
    )
    if registered:
        aliases = client.get_registered_model(gate.registered_model).aliases
        lines.append(
            f"gate: {decision}: registered model '{gate.registered_model}' version {registered}"
            f" ({gate.alias} → version {aliases.get(gate.alias, '-')})"
        )
    elif _data_check(result.run_dir) == "unchanged data":
        lines.append("data: unchanged data (the champion's fingerprint): nothing trained")
    else:
        lines.append(f"gate: {decision}, nothing registered (why: {result.run_dir / 'gate'})")
    lines.append(f"open it: {mlflow_ui_command(uri)} (then http://127.0.0.1:5000)")
    return lines


def _data_check(run_dir: Path) -> str | None:
    """The data check's verdict in a local run (``retrain``, ``unchanged data``), if it ran."""
    path = run_dir / "data-check" / "executor_output.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())["parameterValues"]["Output"]
