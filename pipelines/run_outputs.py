"""A pipeline run's tasks and output artifacts, read where KFP puts them.

A KFP v2 run's outputs are artifacts in the pipeline server's object storage (the pipeline
root, e.g. ``s3://<bucket>/<pipeline>/<run id>/<task>/<output>``). The API names them:
``GET /runs/{id}`` lists the run's tasks (``run_details.task_details``) with their output
artifact ids (``outputs``), and ``GET /artifacts/{id}`` (the v2beta1 ArtifactService) gives an
artifact's ``uri``. The files are then read from object storage with ``core.storage`` (boto3,
credentials from the environment: a workbench's data connection, ``pipelines.workbench``).

SFT and GRPO put their work directory, ``training_metrics.jsonl`` included, in their
``training_log`` output (a training job's files are copied there from the shared volume when
the job ends); ``evaluate`` writes the base/SFT/GRPO report as ``report`` (Markdown).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

from pipelines.kfp_client import (
    FAILED_STATES,
    TERMINAL_STATES,
    KfpConnection,
    RunFailedError,
    run_url,
)

logger = logging.getLogger(__name__)


class RunOutputError(RuntimeError):
    """A task or output artifact the run does not have (names the run, task and output)."""


@dataclass(frozen=True)
class TaskState:
    """One task of a run as ``run_details.task_details`` gives it."""

    name: str
    state: str
    task_id: str
    error: str | None
    outputs: dict[str, list[str]]
    """Output name -> artifact ids."""


def get_run_detail(conn: KfpConnection, run_id: str) -> dict[str, Any]:
    """The run as ``GET /runs/{id}`` returns it (``state``, ``run_details``, …)."""
    return conn.request("GET", f"/runs/{quote(run_id, safe='')}")


def task_states(run: dict[str, Any]) -> list[TaskState]:
    """The run's tasks, in the order the server lists them."""
    tasks = []
    for task in (run.get("run_details") or {}).get("task_details") or []:
        outputs = {
            name: [str(i) for i in (artifacts or {}).get("artifact_ids") or []]
            for name, artifacts in (task.get("outputs") or {}).items()
        }
        tasks.append(
            TaskState(
                name=task.get("display_name") or task.get("task_id", "?"),
                state=task.get("state") or "RUNTIME_STATE_UNSPECIFIED",
                task_id=task.get("task_id", ""),
                error=(task.get("error") or {}).get("message") or None,
                outputs=outputs,
            )
        )
    return tasks


class JobLogs:
    """The log lines of a pipeline run's training jobs that were not shown yet.

    SFT and GRPO train as TrainJobs or PyTorchJobs labelled with the KFP run id
    (``cluster.step_job.RUN_LABEL``); this reads the primary pod's log of each through the
    Kubernetes API. A job API that is not served, or that the service account may not list,
    is skipped (``cluster.step_job.run_jobs``).

    Args:
        run_id: the KFP run id.
        namespace: where the jobs run (the pipeline server's project).
        api_client: a ``kubernetes`` ``ApiClient``.
    """

    def __init__(self, run_id: str, namespace: str, api_client) -> None:
        self.run_id, self.namespace, self.api_client = run_id, namespace, api_client
        self._shown: dict[str, int] = {}

    @classmethod
    def in_workbench(cls, run_id: str) -> tuple[JobLogs | None, str]:
        """Job logs through the workbench's service account (else the local kubeconfig), and
        a line that says which, or why there are none."""
        from cluster.launcher import NoKubernetesAccess, default_api_client
        from cluster.step_job import current_namespace

        try:
            api_client = default_api_client()
        except NoKubernetesAccess as exc:
            return None, f"job logs: not followed (no Kubernetes configuration: {exc})"
        namespace = current_namespace()
        return cls(run_id, namespace, api_client), f"job logs: followed in namespace {namespace}"

    def new_lines(self) -> list[str]:
        """``[job] line`` for each log line written since the last call."""
        from cluster.step_job import run_jobs

        out = []
        for launcher, item in run_jobs(self.namespace, self.api_client, self.run_id):
            name = item["metadata"]["name"]
            lines = launcher.primary_logs(name).splitlines()
            shown = self._shown.get(name, 0)
            out += [f"[{name}] {line}" for line in lines[shown:]]
            self._shown[name] = len(lines)
        return out


def follow_run(
    conn: KfpConnection,
    run_id: str,
    timeout_s: float,
    poll_s: float = 30.0,
    echo: Callable[[str], None] = logger.info,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    job_logs: JobLogs | None = None,
) -> dict[str, Any]:
    """Poll run ``run_id`` until it ends, echoing each change of the run's and its tasks' states
    and, with ``job_logs``, the training jobs' new log lines.

    Returns:
        The run (``get_run_detail``) once SUCCEEDED or SKIPPED.

    Raises:
        RunFailedError: the run ended FAILED or CANCELED; the message names the failed tasks
            and their errors.
        TimeoutError: ``timeout_s`` passed first (the run goes on; call again to keep waiting).
    """
    start = clock()
    seen: dict[str, str] = {}
    while True:
        run = get_run_detail(conn, run_id)
        state = run.get("state") or "RUNTIME_STATE_UNSPECIFIED"
        tasks = task_states(run)
        for task in tasks:
            if seen.get(task.task_id) != task.state:
                seen[task.task_id] = task.state
                echo(f"  {task.name}: {task.state}" + (f" ({task.error})" if task.error else ""))
        if seen.get("") != state:
            seen[""] = state
            echo(f"run {run_id}: {state}")
        for line in job_logs.new_lines() if job_logs is not None else []:
            echo(line)
        if state in FAILED_STATES:
            failed = [f"{t.name}: {t.error or t.state}" for t in tasks if t.state in FAILED_STATES]
            error = (run.get("error") or {}).get("message") or "no error message"
            raise RunFailedError(
                f"run {run_id} {state}: {error}"
                + (f"; failed tasks: {'; '.join(failed)}" if failed else "")
                + f" ({run_url(conn, run_id)})"
            )
        if state in TERMINAL_STATES:
            return run
        waited = clock() - start
        if waited >= timeout_s:
            raise TimeoutError(
                f"run {run_id} still {state} after {waited:.0f} s (timeout {timeout_s:.0f} s); "
                f"it goes on: follow it again or see {run_url(conn, run_id)}"
            )
        sleep(min(poll_s, max(timeout_s - waited, 0.0)))


def find_task(run: dict[str, Any], component: str) -> TaskState:
    """The task of ``component`` that ran: named ``component`` or, in a second branch,
    ``component-2``… (the compiler's names), and not skipped.

    Raises:
        RunOutputError: no such task ran.
    """
    pattern = re.compile(rf"{re.escape(component)}(-\d+)?")
    tasks = [t for t in task_states(run) if pattern.fullmatch(t.name)]
    ran = [t for t in tasks if t.state not in ("SKIPPED", "RUNTIME_STATE_UNSPECIFIED")]
    if not ran:
        names = ", ".join(sorted({t.name for t in task_states(run)})) or "none listed"
        raise RunOutputError(f"run {run.get('run_id')}: no task {component!r} ran (tasks: {names})")
    return ran[-1]


def output_uri(
    conn: KfpConnection,
    run: dict[str, Any],
    component: str,
    output: str,
    pipeline_root: str | None = None,
    client=None,
) -> str:
    """The object-storage URI of output ``output`` of the task of ``component`` in ``run``.

    The task's listed artifact ids first (``GET /artifacts/{id}`` gives the ``uri``). A server
    may list none (KFP 2.x keeps artifacts in ML Metadata and can leave ``outputs`` empty);
    then, given ``pipeline_root`` (e.g. ``s3://<bucket>``, the pipeline server's), the output
    is looked up where the KFP launcher writes it: under
    ``<pipeline root>/<pipeline name>/<run id>/``, the first key with the task's name and,
    after it, the output's name as path parts.

    Raises:
        RunOutputError: the output is neither listed nor (with ``pipeline_root``) stored.
    """
    task = find_task(run, component)
    ids = task.outputs.get(output) or []
    run_id = run.get("run_id", "")
    if ids:
        artifact = conn.request("GET", f"/artifacts/{quote(ids[-1], safe='')}")
        uri = artifact.get("uri")
        if not uri:
            raise RunOutputError(f"artifact {ids[-1]} ({task.name}.{output}) has no uri")
        return uri
    listed = (
        f"task {task.name!r} ({task.state}) lists no output {output!r} (outputs: "
        + (", ".join(sorted(task.outputs)) or "none")
        + ")"
    )
    if not pipeline_root:
        raise RunOutputError(f"run {run_id}: {listed}; give pipeline_root to look it up there")
    from core.storage import list_objects

    prefix = f"{_s3_uri(pipeline_root).rstrip('/')}/{_pipeline_name(conn, run)}/{run_id}/"
    for key in list_objects(prefix, client=client):
        parts = PurePosixPath(key.split(f"/{run_id}/", 1)[1]).parts
        if task.name in parts:
            after = parts.index(task.name) + 1
            if output in parts[after:]:
                return prefix + "/".join(parts[: after + parts[after:].index(output) + 1])
    raise RunOutputError(
        f"run {run_id}: {listed}, and nothing under {prefix} is {task.name}/{output}"
    )


def _pipeline_name(conn: KfpConnection, run: dict[str, Any]) -> str:
    """The name in the run's pipeline spec (``pipelineInfo.name``), as the launcher uses it."""
    spec = run.get("pipeline_spec")
    if not spec:
        ref = run.get("pipeline_version_reference") or {}
        version = conn.request(
            "GET",
            f"/pipelines/{quote(ref.get('pipeline_id', ''), safe='')}/versions/"
            f"{quote(ref.get('pipeline_version_id', ''), safe='')}",
        )
        spec = version.get("pipeline_spec") or {}
    spec = spec.get("pipeline_spec", spec)  # a {pipeline_spec, platform_spec} document
    name = (spec.get("pipelineInfo") or {}).get("name")
    if not name:
        raise RunOutputError(f"run {run.get('run_id')}: its pipeline spec has no pipelineInfo.name")
    return name


def _s3_uri(uri: str) -> str:
    """``minio://bucket/key`` (KFP's name for its bundled MinIO) as ``s3://bucket/key``."""
    for scheme in ("minio://", "s3://"):
        if uri.startswith(scheme):
            return "s3://" + uri.removeprefix(scheme)
    raise RunOutputError(f"artifact {uri}: only S3 (s3://, minio://) object storage is read here")


def fetch_artifact(uri: str, destination: str | Path, client=None) -> Path:
    """Download artifact ``uri``: a file to ``destination``, a directory (every object under
    ``uri/``) into ``destination/``.

    Raises:
        RunOutputError: nothing is stored at ``uri``.
        core.storage.StorageError: the download failed.
    """
    from core.storage import download_file, list_objects, parse_s3_uri, s3_client

    s3 = _s3_uri(uri.rstrip("/"))
    client = client or s3_client()
    bucket, key = parse_s3_uri(s3)
    keys = list_objects(s3, client=client)
    destination = Path(destination)
    if key in keys:
        return download_file(s3, destination, client=client)
    inside = [k for k in keys if k.startswith(key + "/")]
    if not inside:
        raise RunOutputError(f"artifact {uri}: no object at s3://{bucket}/{key} or under it")
    for item in inside:
        relative = PurePosixPath(item).relative_to(key)
        download_file(f"s3://{bucket}/{item}", destination.joinpath(*relative.parts), client=client)
    return destination
