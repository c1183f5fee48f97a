"""Create a training job (TrainJob or PyTorchJob), wait for it while following its progress,
collect its logs, delete it.

Talks to the API server with the Kubernetes client's ``CustomObjectsApi`` (the job's group,
version and plural, ``cluster.jobs.JobKind``) and ``CoreV1Api`` for the pods.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from cluster.config import QUEUE_LABEL
from cluster.jobs import (
    PYTORCHJOB,
    RUNTIME_OF_LABEL,
    JobKind,
    job_conditions,
    job_state,
    resolve_job_api,
)

log = logging.getLogger(__name__)

Progress = Callable[[], tuple[int, int] | None]
"""Returns the latest ``(step, max_steps)``, or None before the first step."""


class NoKubernetesAccess(RuntimeError):
    """Neither an in-cluster service account nor a kubeconfig to reach an API server with."""


class JobFailed(RuntimeError):
    """The job reached the Failed condition; the message holds the reasons."""


def default_api_client() -> k8s.ApiClient:
    """A client of the cluster this runs in (its service account), else of the local
    kubeconfig's current context.

    Raises:
        NoKubernetesAccess: neither is there (one line: what was looked for, the fix).
    """
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config()
        except (k8s_config.ConfigException, OSError) as error:
            raise NoKubernetesAccess(
                "no Kubernetes access: not in a pod, and no usable kubeconfig "
                f"({' '.join(str(error).split())}): log in (oc login / kubectl config "
                "use-context) or set KUBECONFIG"
            ) from error
    return k8s.ApiClient()


def metrics_progress(path: str | Path) -> Progress:
    """A ``Progress`` that reads the last complete line of a metrics file such as
    ``training_metrics.jsonl`` (``trainer.metrics``: one JSON object per line with ``step``
    and ``max_steps``).

    Args:
        path: the metrics file (on the shared volume, as the job writes it).
    """
    path = Path(path)

    def latest() -> tuple[int, int] | None:
        if not path.exists():
            return None
        for line in reversed(path.read_text().splitlines()):
            try:
                metrics = json.loads(line)
            except json.JSONDecodeError:  # a line rank 0 is still writing
                continue
            return int(metrics["step"]), int(metrics["max_steps"])
        return None

    return latest


class JobLauncher:
    """Run training jobs of one kind in one namespace.

    Args:
        namespace: where the jobs live.
        api_client: a configured Kubernetes ``ApiClient``; default: ``default_api_client()``.
        kind: the job API (one of ``cluster.jobs.JOB_KINDS``).
    """

    def __init__(
        self,
        namespace: str,
        api_client: k8s.ApiClient | None = None,
        kind: JobKind = PYTORCHJOB,
    ) -> None:
        self.api_client = api_client or default_api_client()
        self.namespace = namespace
        self.kind = kind
        self.jobs = k8s.CustomObjectsApi(self.api_client)
        self.core = k8s.CoreV1Api(self.api_client)

    @classmethod
    def connect(
        cls, namespace: str, job_api: str, api_client: k8s.ApiClient | None = None
    ) -> JobLauncher:
        """A launcher of the job API ``job_api`` (``auto``: the one the server serves,
        TrainJob first; ``cluster.jobs.resolve_job_api``).

        Raises:
            cluster.jobs.JobApiNotServed: the server serves no job API that fits.
        """
        api_client = api_client or default_api_client()
        return cls(namespace, api_client, resolve_job_api(job_api, api_client))

    def _path(self) -> tuple[str, str, str, str]:
        return self.kind.group, self.kind.version, self.namespace, self.kind.plural

    def create(self, manifest: dict) -> str:
        """Submit the manifest (``build_trainjob``, ``build_pytorchjob``); returns its name."""
        name = manifest["metadata"]["name"]
        self.jobs.create_namespaced_custom_object(*self._path(), manifest)
        log.info("created %s %s/%s", self.kind.kind, self.namespace, name)
        return name

    def get(self, name: str) -> dict:
        """The job object as the API server has it."""
        return self.jobs.get_namespaced_custom_object(*self._path(), name)

    def list(self, label_selector: str) -> list[dict]:
        """The jobs whose labels match ``label_selector`` (``key=value,…``), checked here too
        (a server may ignore the selector)."""
        items = self.jobs.list_namespaced_custom_object(
            *self._path(), label_selector=label_selector
        )["items"]
        wanted = dict(pair.split("=", 1) for pair in label_selector.split(","))
        return [i for i in items if wanted.items() <= (i["metadata"].get("labels") or {}).items()]

    def pods(self, name: str, primary: bool = False) -> list[k8s.V1Pod]:
        """The job's pods (only the primary one, global rank 0: ``primary``), by name."""
        labels = self.kind.pod_labels(name, primary)
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        matching = [p for p in pods if labels.items() <= (p.metadata.labels or {}).items()]
        return sorted(matching, key=lambda p: p.metadata.name)

    def primary_logs(self, name: str, tail_lines: int | None = None) -> str:
        """The training container's log of the primary pod ('' when it has none yet)."""
        primaries = self.pods(name, primary=True)
        if not primaries:
            return ""
        return self.core.read_namespaced_pod_log(
            primaries[0].metadata.name,
            self.namespace,
            container=self.kind.container,
            tail_lines=tail_lines,
        )

    def stream_primary_logs(self, name: str) -> Iterator[str]:
        """Follow the primary pod's log line by line until the container ends."""
        primaries = self.pods(name, primary=True)
        if not primaries:
            return
        response = self.core.read_namespaced_pod_log(
            primaries[0].metadata.name,
            self.namespace,
            container=self.kind.container,
            follow=True,
            _preload_content=False,
        )
        pending = b""
        for chunk in response.stream():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            yield from (line.decode(errors="replace") for line in lines)
        if pending:
            yield pending.decode(errors="replace")

    def pod_failures(self, name: str) -> list[str]:
        """``pod: reason (exit code N): message`` for each terminated container that failed."""
        failures = []
        for pod in self.pods(name):
            for status in (pod.status and pod.status.container_statuses) or []:
                ended = status.state and status.state.terminated
                if ended and ended.exit_code != 0:
                    detail = f": {ended.message.strip()}" if ended.message else ""
                    failures.append(
                        f"{pod.metadata.name}: {ended.reason} (exit code {ended.exit_code}){detail}"
                    )
        return failures

    def wait(
        self,
        name: str,
        timeout_s: float,
        poll_s: float = 10.0,
        progress: Progress | None = None,
    ) -> dict:
        """Poll until the job succeeded; log its conditions, its progress and whether Kueue
        holds it (a suspended job is queued, not failed) on the way.

        Returns:
            The finished job object.

        Raises:
            JobFailed: the job Failed (message: the condition's reason and message, the
                failing pods' termination reasons, the primary pod's log tail).
            TimeoutError: it neither succeeded nor failed within ``timeout_s`` (queued time
                counts).
        """
        what = f"{self.kind.kind} {name}"
        deadline = time.monotonic() + timeout_s
        seen: set[str] = set()
        last_progress = last_state = None
        while True:
            job = self.get(name)
            conditions = job_conditions(job)
            for kind in conditions.keys() - seen:
                log.info("%s: %s", what, kind)
            seen |= conditions.keys()
            state = job_state(self.kind, job)
            if state == "queued" and last_state != "queued":
                queue = (job["metadata"].get("labels") or {}).get(QUEUE_LABEL)
                held = f"Kueue queue {queue}" if queue else "spec.suspend"
                log.info("%s: queued (suspended, %s)", what, held)
            last_state = state
            if progress and (now := progress()) and now != last_progress:
                last_progress = now
                log.info("%s: step %d/%d", what, *now)
            if state == "succeeded":
                return job
            if state == "failed":
                raise JobFailed(self._failure_message(name, conditions["Failed"]))
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.kind.kind} {self.namespace}/{name} did not finish in "
                    f"{timeout_s:.0f} s ({state}; conditions: {sorted(conditions) or 'none'}); "
                    f"raise the timeout or check `kubectl describe {self.kind.kind.lower()}`"
                )
            time.sleep(poll_s)

    def _failure_message(self, name: str, condition: dict) -> str:
        lines = [
            f"{self.kind.kind} {self.namespace}/{name} failed: "
            f"{condition.get('reason', 'unknown')}: {condition.get('message', '')}".rstrip(": ")
        ]
        lines += [f"  {failure}" for failure in self.pod_failures(name)]
        tail = self.primary_logs(name, tail_lines=20)
        if tail:
            lines += ["rank 0's log (last lines):", tail.rstrip()]
        return "\n".join(lines)

    def delete(self, name: str) -> bool:
        """Delete the job and its pods, and a TrainJob's own TrainingRuntime
        (``delete_runtime``); True if the job existed. Safe to call twice (exit handlers)."""
        try:
            self.jobs.delete_namespaced_custom_object(
                *self._path(), name, propagation_policy="Foreground"
            )
        except k8s.ApiException as error:
            if error.status != 404:
                raise
            existed = False
        else:
            log.info("deleted %s %s/%s", self.kind.kind, self.namespace, name)
            existed = True
        if self.kind.runtime_plural:
            self.delete_runtime(name)
        return existed

    def _runtime_path(self) -> tuple[str, str, str, str]:
        return self.kind.group, self.kind.version, self.namespace, self.kind.runtime_plural

    def create_runtime(self, runtime: dict) -> None:
        """Create a TrainJob's own TrainingRuntime ``runtime`` (``build_job_runtime``); one of
        the same name that the job's earlier run left (labelled for the same job) is
        updated to it.

        Raises:
            kubernetes.client.ApiException: the server refused it, or a runtime of that name
                exists that is not the job's (409).
        """
        name = runtime["metadata"]["name"]
        try:
            self.jobs.create_namespaced_custom_object(*self._runtime_path(), runtime)
        except k8s.ApiException as error:
            if error.status != 409 or not self._own_runtime(name):
                raise
            # a JSON merge patch: the same job's runtime differs at most in images and values
            self.jobs.patch_namespaced_custom_object(*self._runtime_path(), name, runtime)
        log.info("created TrainingRuntime %s/%s", self.namespace, name)

    def _own_runtime(self, name: str) -> bool:
        """True when TrainingRuntime ``name`` exists and was made for job ``name``."""
        try:
            runtime = self.jobs.get_namespaced_custom_object(*self._runtime_path(), name)
        except k8s.ApiException as error:
            if error.status in (403, 404):  # none, or not ours to read: not ours to delete
                return False
            raise
        return (runtime["metadata"].get("labels") or {}).get(RUNTIME_OF_LABEL) == name

    def delete_runtime(self, name: str) -> bool:
        """Delete TrainJob ``name``'s own TrainingRuntime, if there is one (a runtime of that
        name without the job's ``lingo-rl/runtime-of`` label is left alone); True if deleted."""
        if not self._own_runtime(name):
            return False
        try:
            self.jobs.delete_namespaced_custom_object(*self._runtime_path(), name)
        except k8s.ApiException as error:
            if error.status == 404:
                return False
            raise
        log.info("deleted TrainingRuntime %s/%s", self.namespace, name)
        return True

    def run(
        self,
        manifest: dict,
        timeout_s: float,
        poll_s: float = 10.0,
        progress: Progress | None = None,
        stream_logs: bool = True,
        runtime: dict | None = None,
    ) -> dict:
        """Create the job (after ``runtime``, the job's own TrainingRuntime, when given),
        stream its primary pod's log to this log, and wait until it ends.

        The job (and its runtime) is left in place (for inspection); call ``delete`` from the
        exit handler. A job the server refuses takes its runtime with it.

        Returns:
            The finished job object.

        Raises:
            JobFailed, TimeoutError: see ``wait``.
        """
        if runtime is not None:
            self.create_runtime(runtime)
        try:
            name = self.create(manifest)
        except k8s.ApiException:
            if runtime is not None:
                self.delete_runtime(runtime["metadata"]["name"])
            raise
        stop = threading.Event()
        if stream_logs:
            threading.Thread(
                target=self._log_primary, args=(name, timeout_s, poll_s, stop), daemon=True
            ).start()
        try:
            return self.wait(name, timeout_s, poll_s, progress)
        finally:
            stop.set()

    def _log_primary(
        self, name: str, timeout_s: float, poll_s: float, stop: threading.Event
    ) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while not any(
                p.status and p.status.phase in ("Running", "Succeeded", "Failed")
                for p in self.pods(name, primary=True)
            ):
                if time.monotonic() > deadline or stop.wait(poll_s):
                    return
            for line in self.stream_primary_logs(name):
                if stop.is_set():
                    return
                log.info("[%s rank 0] %s", name, line)
        except (k8s.ApiException, urllib3.exceptions.HTTPError) as error:
            # logs are a convenience; the job's state decides
            log.warning("%s %s: cannot stream rank 0's log: %s", self.kind.kind, name, error)


PyTorchJobLauncher = JobLauncher
"""The launcher's name before TrainJobs (a ``JobLauncher`` of PyTorchJobs by default)."""


def install_training_runtime(runtime: dict, api_client: k8s.ApiClient | None = None) -> str:
    """Create the ClusterTrainingRuntime ``runtime`` (``build_training_runtime``), or update
    the one of the same name with it (a JSON merge patch: lists replaced, maps merged, so a
    field an older runtime had and this one lacks stays; delete the runtime first to drop
    it); returns ``created`` or ``updated``. Needs rights on cluster-scoped
    ``clustertrainingruntimes`` (a cluster admin's)."""
    custom = k8s.CustomObjectsApi(api_client or default_api_client())
    group, version = runtime["apiVersion"].split("/")
    try:
        custom.create_cluster_custom_object(group, version, "clustertrainingruntimes", runtime)
        return "created"
    except k8s.ApiException as error:
        if error.status != 409:
            raise
    name = runtime["metadata"]["name"]
    custom.patch_cluster_custom_object(group, version, "clustertrainingruntimes", name, runtime)
    return "updated"
