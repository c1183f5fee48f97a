"""Create a PyTorchJob, wait for it while following its progress, collect logs, delete it.

Talks to the API server with the Kubernetes client's ``CustomObjectsApi`` (group
``kubeflow.org``, version ``v1``, plural ``pytorchjobs``) and ``CoreV1Api`` for the pods.
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

from cluster.pytorchjob import CONTAINER_NAME

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"

Progress = Callable[[], tuple[int, int] | None]
"""Returns the latest ``(step, max_steps)``, or None before the first step."""


class PyTorchJobFailed(RuntimeError):
    """The PyTorchJob reached the Failed condition; the message holds the reasons."""


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


def job_conditions(job: dict) -> dict[str, dict]:
    """The job's conditions that are currently true, by type (Created, Running, Succeeded…)."""
    conditions = job.get("status", {}).get("conditions") or []
    return {c["type"]: c for c in conditions if c.get("status") == "True"}


class PyTorchJobLauncher:
    """Run PyTorchJobs in one namespace.

    Args:
        namespace: where the jobs live.
        api_client: a configured Kubernetes ``ApiClient``; default: the in-cluster service
            account, else the local kubeconfig.
    """

    def __init__(self, namespace: str, api_client: k8s.ApiClient | None = None) -> None:
        if api_client is None:
            try:
                k8s_config.load_incluster_config()
            except k8s_config.ConfigException:
                k8s_config.load_kube_config()
            api_client = k8s.ApiClient()
        self.namespace = namespace
        self.jobs = k8s.CustomObjectsApi(api_client)
        self.core = k8s.CoreV1Api(api_client)

    def create(self, manifest: dict) -> str:
        """Submit the manifest (see ``build_pytorchjob``); returns the job's name."""
        name = manifest["metadata"]["name"]
        self.jobs.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, manifest)
        log.info("created PyTorchJob %s/%s", self.namespace, name)
        return name

    def get(self, name: str) -> dict:
        """The job object as the API server has it."""
        return self.jobs.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def pods(self, name: str, replica_type: str | None = None) -> list[k8s.V1Pod]:
        """The job's pods (``replica_type``: ``master`` or ``worker`` to narrow), by name."""
        labels = {JOB_NAME_LABEL: name}
        if replica_type:
            labels[REPLICA_TYPE_LABEL] = replica_type
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        matching = [p for p in pods if labels.items() <= (p.metadata.labels or {}).items()]
        return sorted(matching, key=lambda p: p.metadata.name)

    def master_logs(self, name: str, tail_lines: int | None = None) -> str:
        """The training container's log of the master pod ('' when it has none yet)."""
        masters = self.pods(name, "master")
        if not masters:
            return ""
        return self.core.read_namespaced_pod_log(
            masters[0].metadata.name,
            self.namespace,
            container=CONTAINER_NAME,
            tail_lines=tail_lines,
        )

    def stream_master_logs(self, name: str) -> Iterator[str]:
        """Follow the master pod's log line by line until the container ends."""
        masters = self.pods(name, "master")
        if not masters:
            return
        response = self.core.read_namespaced_pod_log(
            masters[0].metadata.name,
            self.namespace,
            container=CONTAINER_NAME,
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
        """Poll until the job Succeeded; log its conditions and progress on the way.

        Returns:
            The finished job object.

        Raises:
            PyTorchJobFailed: the job Failed (message: the condition's reason and message, the
                failing pods' termination reasons, the master log's tail).
            TimeoutError: neither Succeeded nor Failed within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        seen: set[str] = set()
        last_progress = None
        while True:
            job = self.get(name)
            conditions = job_conditions(job)
            for kind in conditions.keys() - seen:
                log.info("PyTorchJob %s: %s", name, kind)
            seen |= conditions.keys()
            if progress and (now := progress()) and now != last_progress:
                last_progress = now
                log.info("PyTorchJob %s: step %d/%d", name, *now)
            if "Succeeded" in conditions:
                return job
            if "Failed" in conditions:
                raise PyTorchJobFailed(self._failure_message(name, conditions["Failed"]))
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"PyTorchJob {self.namespace}/{name} did not finish in {timeout_s:.0f} s "
                    f"(conditions: {sorted(conditions) or 'none'}); raise the timeout or check "
                    "`kubectl describe pytorchjob`"
                )
            time.sleep(poll_s)

    def _failure_message(self, name: str, condition: dict) -> str:
        lines = [
            f"PyTorchJob {self.namespace}/{name} failed: {condition.get('reason', 'unknown')}: "
            f"{condition.get('message', '')}".rstrip(": ")
        ]
        lines += [f"  {failure}" for failure in self.pod_failures(name)]
        tail = self.master_logs(name, tail_lines=20)
        if tail:
            lines += ["master log (last lines):", tail.rstrip()]
        return "\n".join(lines)

    def delete(self, name: str) -> bool:
        """Delete the job and its pods; True if it existed. Safe to call twice (exit handlers)."""
        try:
            self.jobs.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, propagation_policy="Foreground"
            )
        except k8s.ApiException as error:
            if error.status == 404:
                return False
            raise
        log.info("deleted PyTorchJob %s/%s", self.namespace, name)
        return True

    def run(
        self,
        manifest: dict,
        timeout_s: float,
        poll_s: float = 10.0,
        progress: Progress | None = None,
        stream_logs: bool = True,
    ) -> dict:
        """Create the job, stream the master's log to this log, and wait until it finishes.

        The job is left in place (for inspection); call ``delete`` from the exit handler.

        Returns:
            The finished job object.

        Raises:
            PyTorchJobFailed, TimeoutError: see ``wait``.
        """
        name = self.create(manifest)
        stop = threading.Event()
        if stream_logs:
            threading.Thread(
                target=self._log_master, args=(name, timeout_s, poll_s, stop), daemon=True
            ).start()
        try:
            return self.wait(name, timeout_s, poll_s, progress)
        finally:
            stop.set()

    def _log_master(
        self, name: str, timeout_s: float, poll_s: float, stop: threading.Event
    ) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while not any(
                p.status and p.status.phase in ("Running", "Succeeded", "Failed")
                for p in self.pods(name, "master")
            ):
                if time.monotonic() > deadline or stop.wait(poll_s):
                    return
            for line in self.stream_master_logs(name):
                if stop.is_set():
                    return
                log.info("[%s master] %s", name, line)
        except (k8s.ApiException, urllib3.exceptions.HTTPError) as error:
            # logs are a convenience; the job's state decides
            log.warning("PyTorchJob %s: cannot stream the master log: %s", name, error)
