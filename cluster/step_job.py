"""Run one training step (SFT, GRPO) as a TrainJob or a PyTorchJob from inside its pipeline step.

The pipeline step's pod is the launcher: it copies its input artifacts onto the shared volume,
writes the step config there, launches ``python -m trainer.sft|trainer.grpo`` as a job over
the cluster layout (the job API ``cluster.job_api`` names, or for ``auto`` the one the API
server serves, TrainJob first), follows it (conditions, Kueue's queueing, rank 0's log,
``training_metrics.jsonl`` for progress), and copies the exported model and the work directory
back into its own output artifacts. Jobs carry the labels ``lingo-rl/pipeline-run`` and
``lingo-rl/step`` so that the pipeline's exit handler can find and delete what a cancelled run
left behind (``delete_run_jobs``); a SIGTERM to the step (cancellation) deletes its job at once.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from cluster.access import check_access, step_access
from cluster.config import QUEUE_LABEL, ClusterJobConfig, ExecutionConfig
from cluster.jobs import JOB_KINDS, JobKind, job_state
from cluster.launcher import JobLauncher, metrics_progress
from cluster.pytorchjob import manifest_yaml
from core.atomic import atomic_write_text
from core.processes import on_sigterm
from core.tracking import tracking_env

log = logging.getLogger(__name__)

RUN_LABEL = "lingo-rl/pipeline-run"
STEP_LABEL = "lingo-rl/step"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
FINISHED = ("succeeded", "failed")


class RuntimeNotInstalled(RuntimeError):
    """The ClusterTrainingRuntime a TrainJob would reference is not on the cluster."""


@dataclass(frozen=True)
class StepJob:
    """One training step to run as a job.

    Attributes:
        step: ``sft`` or ``grpo`` (job names and labels).
        module: the entry point, ``trainer.sft`` or ``trainer.grpo``.
        config: the step's pydantic config (``nproc`` must equal the job's world size).
        model_flag: the entry point's flag for the input model (``base-model``, ``sft-model``).
        model: the input model directory.
        train: the train split.
        eval: the eval split, or None.
        config_paths: further inputs named by a config field (dotted, e.g.
            ``optim.megatron.checkpoint``): staged too, and the field set to the staged copy.
        metrics_file: the file in the job's work directory that the training appends its
            progress to (``trainer.metrics.METRICS_FILE``), followed while the job runs;
            empty: not followed.
    """

    step: str
    module: str
    config: BaseModel
    model_flag: str
    model: str | Path
    train: str | Path
    eval: str | Path | None
    config_paths: tuple[str, ...] = ()
    metrics_file: str = ""


def label_value(text: str) -> str:
    """``text`` as a Kubernetes label value (63 chars of ``[A-Za-z0-9._-]``, alnum at the ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-._")
    return value or "none"


def job_name(step: str, run_id: str) -> str:
    """``lingo-<step>-<run>``: an RFC 1035 label (a TrainJob's rule), short enough for the
    controllers' pod names."""
    run = re.sub(r"[^a-z0-9-]", "-", run_id.lower()).strip("-")[:36] or "run"
    return f"lingo-{step}-{run}".rstrip("-")[:52]


def current_namespace(default: str = "default") -> str:
    """The namespace of this pod (from its service account), else ``default``."""
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return default


def stage_inputs(job: StepJob, shared: Path) -> list[str]:
    """Copy the inputs and the config under ``shared``; returns the entry point's arguments.

    A retried step restages its inputs and clears the exported model, but keeps ``work/``: the
    recipes resume from the newest checkpoint they find there.
    """
    inputs = shared / "inputs"
    for stale in (inputs, shared / "model"):
        if stale.exists():
            shutil.rmtree(stale)
    inputs.mkdir(parents=True)
    staged: dict[str, Path] = {}
    for flag, source in (
        (job.model_flag, job.model),
        ("train", job.train),
        ("eval", job.eval),
    ):
        if source is None:
            continue
        target = inputs / flag
        _copy(Path(source), target)
        staged[flag] = target
    config = job.config.model_dump(mode="json")
    for field in job.config_paths:
        *parents, leaf = field.split(".")
        node = config
        for key in parents:
            node = node[key]
        target = inputs / field
        _copy(Path(node[leaf]), target)
        node[leaf] = str(target)
    config_file = shared / f"{job.step}_config.json"
    atomic_write_text(config_file, json.dumps(config, indent=2))
    args = ["--config", str(config_file)]
    for flag, path in staged.items():
        args += [f"--{flag}", str(path)]
    return [*args, "--model-output", str(shared / "model"), "--work-dir", str(shared / "work")]


def _copy(source: Path, target: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy2(source, target)


def step_cluster(
    execution: ExecutionConfig,
    default_image: str,
    default_namespace: str,
    rollout_image: str | None = None,
) -> ClusterJobConfig:
    """The step's job config: the execution's (``rollout_image``: the default image of GRPO's
    rollout-only nodes), with the MLflow settings this step runs with
    (``core.tracking.tracking_env``) as plain env, so the job's rank 0 logs into the
    pipeline's MLflow run. A variable the job also takes from a Secret (``secret_env``, e.g.
    ``MLFLOW_TRACKING_URI`` from ``lingo-mlflow``) keeps the Secret (``job_env``)."""
    cluster = execution.cluster_job(default_image, default_namespace, rollout_image)
    return cluster.model_copy(update={"env": {**tracking_env(), **cluster.env}})


def job_layout(job: StepJob, cluster: ClusterJobConfig, kind: JobKind) -> ClusterJobConfig:
    """``cluster`` with its rollout-only nodes (``rollout_nodes``): the nodes GRPO's
    rollout-only processes (dedicated engines, the job's last ranks) fill.

    Raises:
        ValueError: the config's processes (``nproc``, plus the rollout-only ones) differ from
            the job's world size, or two images (``two_images``) would share a node.
    """
    nproc = getattr(job.config, "nproc", 1)
    engines = getattr(job.config, "rollout_processes", 0)
    if nproc + engines != cluster.world_size:
        with_engines = f" + {engines} rollout-only processes" if engines else ""
        raise ValueError(
            f"{job.step}: config nproc={nproc}{with_engines} but the {kind.kind} runs "
            f"{cluster.world_size} processes ({cluster.nodes} nodes x "
            f"{cluster.procs_per_node}); set {job.step}.nproc"
            f"{' or rollout.num_engines' if engines else ''} or the execution's job.nodes / "
            "job.nproc_per_node so they agree"
        )
    per_node = cluster.procs_per_node
    layout = cluster.model_copy(update={"rollout_nodes": engines // per_node})
    if layout.rollout_image not in (None, layout.image) and engines % per_node:
        raise ValueError(
            f"{job.step}: {engines} rollout-only processes leave a node shared with training "
            f"({per_node} processes a node), which cannot run two images ({layout.image}, "
            f"{layout.rollout_image}): set rollout.num_engines / tensor_parallel_size so the "
            "engines fill whole nodes"
        )
    return layout


def _labelled(manifest: dict, job: StepJob, run_id: str) -> dict:
    labels = manifest["metadata"].setdefault("labels", {})
    labels.update({RUN_LABEL: label_value(run_id), STEP_LABEL: job.step})
    return manifest


def build_step_manifest(
    job: StepJob,
    cluster: ClusterJobConfig,
    run_id: str,
    args: list[str],
    kind: JobKind,
) -> dict:
    """The job of API ``kind`` for ``job``, labelled with the pipeline run and the step.

    Raises:
        ValueError: the config's processes (``nproc``, plus GRPO's rollout-only processes of
            dedicated engines) differ from the job's world size, a TrainJob is asked for
            what only a PyTorchJob carries, or a PyTorchJob for two images it cannot hold.
    """
    layout = job_layout(job, cluster, kind)
    manifest = kind.build(job_name(job.step, run_id), layout, job.module, args)
    return _labelled(manifest, job, run_id)


def build_step_runtime(
    job: StepJob,
    cluster: ClusterJobConfig,
    run_id: str,
    args: list[str],
    kind: JobKind,
) -> dict | None:
    """The job's own runtime, labelled like the job: for a job whose rollout-only nodes run
    another image, where its API has such runtimes (``JobKind.own_runtime_builder``: a TrainJob's
    TrainingRuntime); else ``None`` (the job references the cluster's runtime, or none)."""
    layout = job_layout(job, cluster, kind)
    if not own_runtime(kind, layout):
        return None
    runtime = kind.build_own_runtime(job_name(job.step, run_id), layout, job.module, args)
    return _labelled(runtime, job, run_id)


def own_runtime(kind: JobKind, layout: ClusterJobConfig) -> bool:
    """The job gets a runtime of its own (``JobKind.own_runtime_builder``): its nodes run two
    images and its API has such runtimes."""
    return bool(kind.own_runtime_builder) and layout.two_images


def require_runtime(launcher: JobLauncher, runtime: str) -> None:
    """Fail early, with the fix, when the cluster-scoped runtime a job references
    (``JobKind.cluster_runtime_plural``: a TrainJob's ClusterTrainingRuntime) is missing (a
    service account that may not read cluster-scoped runtimes: warn and go on).

    Raises:
        RuntimeNotInstalled: the API server has no ClusterTrainingRuntime ``runtime``.
    """
    from kubernetes import client as k8s

    kind = launcher.kind
    try:
        launcher.jobs.get_cluster_custom_object(
            kind.group, kind.version, kind.cluster_runtime_plural, runtime
        )
    except k8s.ApiException as error:
        if error.status == 404:
            raise RuntimeNotInstalled(
                f"ClusterTrainingRuntime {runtime!r} is not installed: run `lingo cluster "
                "install-runtime` (or `kubectl apply -f deploy/cluster-training-runtime.yaml`), "
                "or set cluster.runtime, or cluster.job_api=pytorchjob"
            ) from None
        if error.status == 403:
            log.warning("cannot check ClusterTrainingRuntime %s (403): creating anyway", runtime)
            return
        raise


@contextmanager
def delete_on_sigterm(launcher: JobLauncher, name: str) -> Iterator[None]:
    """While inside, SIGTERM (the pipeline cancelling the step) deletes the job, then exits."""

    def handler(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
        log.warning("step cancelled: deleting %s %s", launcher.kind.kind, name)
        launcher.delete(name)
        raise SystemExit(128 + signum)

    with on_sigterm(handler):
        yield


def run_step_job(
    job: StepJob,
    execution: ExecutionConfig,
    run_id: str,
    model_output: str | Path,
    work_dir: str | Path,
    manifest_path: str | Path,
    default_image: str,
    launcher: JobLauncher | None = None,
    rollout_image: str | None = None,
) -> Path:
    """Run ``job`` as a TrainJob or PyTorchJob and copy its results into ``model_output`` and
    ``work_dir``.

    The job API is ``launcher``'s, else the execution's ``job.job_api`` (``auto``: asked of
    the API server). A job of the same name that is still running or queued (the step was
    retried meanwhile) is followed rather than started again; a finished one is replaced.
    GRPO's rollout-only nodes run ``rollout_image`` (default: the training image); a TrainJob
    with two images gets its own TrainingRuntime, created before it and deleted with it
    (``JobLauncher.run``, ``JobLauncher.delete``).

    Returns:
        ``work_dir``, holding the job's work directory (summary, metrics, plots).

    Raises:
        JobFailed, TimeoutError: from the launcher; the job is kept for inspection.
        JobApiNotServed, RuntimeNotInstalled: the cluster lacks what the job needs.
        AccessDenied: the step's service account may not do what the job needs (checked
            with SelfSubjectAccessReviews before anything is staged or created).
        ValueError: the layout and the config disagree.
    """
    cluster = step_cluster(execution, default_image, current_namespace(), rollout_image)
    name = job_name(job.step, run_id)
    shared = Path(execution.shared_dir(cluster)) / name
    launcher = launcher or JobLauncher.connect(cluster.namespace, cluster.job_api)
    log.info("%s: runs as a %s", job.step, launcher.kind.kind)
    has_own_runtime = own_runtime(launcher.kind, job_layout(job, cluster, launcher.kind))
    check_access(
        launcher.api_client, cluster.namespace, step_access(launcher.kind, has_own_runtime)
    )
    existing = _existing(launcher, name)
    runtime = None
    if existing is not None and job_state(launcher.kind, existing) not in FINISHED:
        log.info("%s %s is still active: following it", launcher.kind.kind, name)
        manifest = existing
    else:
        if existing is not None:
            launcher.delete(name)
            _wait_gone(launcher, name, execution.poll_s)
        if launcher.kind.cluster_runtime_plural and not has_own_runtime:
            require_runtime(launcher, cluster.runtime)
        args = stage_inputs(job, shared)
        manifest = build_step_manifest(job, cluster, run_id, args, launcher.kind)
        runtime = build_step_runtime(job, cluster, run_id, args, launcher.kind)
    documents = [manifest] if runtime is None else [runtime, manifest]
    atomic_write_text(manifest_path, "---\n".join(manifest_yaml(d) for d in documents))
    progress = metrics_progress(shared / "work" / job.metrics_file) if job.metrics_file else None
    with delete_on_sigterm(launcher, name):
        if manifest is existing:
            launcher.wait(name, execution.timeout_s, execution.poll_s, progress)
        else:
            launcher.run(manifest, execution.timeout_s, execution.poll_s, progress, runtime=runtime)
    _copy_back(shared, Path(model_output), Path(work_dir))
    if execution.delete_on_success:
        launcher.delete(name)
    return Path(work_dir)


def run_jobs(namespace: str, api_client, run_id: str) -> Iterator[tuple[JobLauncher, dict]]:
    """The pipeline run's jobs in ``namespace``, TrainJobs and PyTorchJobs alike, each with a
    launcher of its kind. A job API the server does not serve is skipped, and so (with a
    warning) is one this service account may not list: the other's jobs are still found."""
    from kubernetes import client as k8s

    selector = f"{RUN_LABEL}={label_value(run_id)}"
    for kind in JOB_KINDS.values():
        launcher = JobLauncher(namespace, api_client, kind)
        try:
            items = launcher.list(selector)
        except k8s.ApiException as error:
            if error.status == 404:  # this job API is not served here
                continue
            if error.status == 403:
                log.warning("may not list %ss in %s: skipped", kind.kind, namespace)
                continue
            raise
        yield from ((launcher, item) for item in items)


def delete_run_jobs(
    launcher: JobLauncher, run_id: str, include_finished: bool = False
) -> list[str]:
    """Delete the run's jobs (``run_jobs``, in ``launcher``'s namespace) that are still active
    or queued (all of them with ``include_finished``); returns their names. The pipeline's
    exit handler calls this."""
    deleted = []
    for jobs, item in run_jobs(launcher.namespace, launcher.api_client, run_id):
        if job_state(jobs.kind, item) in FINISHED and not include_finished:
            continue
        if jobs.delete(item["metadata"]["name"]):
            deleted.append(item["metadata"]["name"])
    return deleted


def describe_run_jobs(namespace: str, api_client, run_id: str) -> list[str]:
    """One line per job of the run: step, kind, name, state (``queued`` with its Kueue
    queue: a job Kueue has not admitted yet is waiting, not failing)."""
    lines = []
    for launcher, item in run_jobs(namespace, api_client, run_id):
        labels = item["metadata"].get("labels") or {}
        state = job_state(launcher.kind, item)
        if state == "queued" and labels.get(QUEUE_LABEL):
            state += f" (Kueue queue {labels[QUEUE_LABEL]})"
        step = labels.get(STEP_LABEL, "?")
        lines.append(f"{step:<5} {launcher.kind.kind:<10} {item['metadata']['name']}  {state}")
    return lines


def _existing(launcher: JobLauncher, name: str) -> dict | None:
    from kubernetes import client as k8s

    try:
        return launcher.get(name)
    except k8s.ApiException as error:
        if error.status == 404:
            return None
        raise


def _wait_gone(launcher: JobLauncher, name: str, poll_s: float) -> None:
    import time

    deadline = time.monotonic() + 300
    while _existing(launcher, name) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{launcher.kind.kind} {name} was deleted but is still there after 300 s"
            )
        time.sleep(min(poll_s, 2.0))


def _copy_back(shared: Path, model_output: Path, work_dir: Path) -> None:
    """The model, and the work directory's files (metrics, plots, summary; not checkpoints or
    policy copies, which stay on the shared volume), with the summary's paths rewritten."""
    model = shared / "model"
    if not model.is_dir():
        raise FileNotFoundError(
            f"the job succeeded but wrote no model to {model}: check rank 0's log"
        )
    shutil.copytree(model, model_output, dirs_exist_ok=True)
    work = shared / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(work.iterdir()) if work.is_dir() else []:
        if not path.is_file():
            continue
        if path.suffix == ".json":
            text = path.read_text().replace(str(work), str(work_dir))
            (work_dir / path.name).write_text(text.replace(str(model), str(model_output)))
        else:
            shutil.copy2(path, work_dir / path.name)
