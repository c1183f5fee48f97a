"""The launch flow of both job APIs (TrainJob, PyTorchJob) against ``kmock``, an in-memory
Kubernetes API emulator.

No Kubernetes API server (nor Trainer controller, JobSet or training operator) can run here, so
this is a stand-in: kmock stores the objects the real client sends over HTTP, and the test plays
the controllers by writing the job's status and its pods (with the labels each controller puts
on them) through the same API. Label selectors are not applied by the emulator; the launcher
filters pods by label itself.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from kube_emulator import kube_emulator
from kubernetes import client as k8s

from cluster.jobs import PYTORCHJOB, TRAINJOB, JobKind
from cluster.launcher import JobFailed, JobLauncher, metrics_progress
from cluster.pytorchjob import ClusterJobConfig, build_pytorchjob
from cluster.trainjob import build_trainjob

NAMESPACE = "team"
PRIMARY = {PYTORCHJOB.api: "sft-run-master-0", TRAINJOB.api: "sft-run-node-0-0-x7k2p"}
OTHER = {PYTORCHJOB.api: "sft-run-worker-0", TRAINJOB.api: "sft-run-node-0-1-q9z4m"}
LOG = b"step 1 loss 2.0\nstep 2 loss 1.5\n"
FAILED_REASON = {PYTORCHJOB.api: "PyTorchJobFailed", TRAINJOB.api: "FailedJobs"}


@pytest.fixture(params=[TRAINJOB, PYTORCHJOB], ids=lambda kind: kind.api)
def kind(request) -> JobKind:
    return request.param


@pytest.fixture
def emulator():
    """The emulator, with each API's primary pod's log."""
    with kube_emulator({pod: LOG for pod in PRIMARY.values()}, NAMESPACE) as api_client:
        yield api_client


def _manifest(kind: JobKind) -> dict:
    cluster = ClusterJobConfig(image="img:1", namespace=NAMESPACE, nodes=2, gpus_per_node=4)
    build = build_trainjob if kind is TRAINJOB else build_pytorchjob
    return build("sft-run", cluster, "trainer.sft", ["--config", "/mnt/shared/c.json"])


def _pod(kind: JobKind, name: str, index: int, job: str = "sft-run", terminated=None) -> dict:
    """A pod labelled as the controller of ``kind`` labels it (a JobSet's Indexed Job, or the
    training operator's replica types)."""
    if kind is TRAINJOB:
        labels = {
            "jobset.sigs.k8s.io/jobset-name": job,
            "jobset.sigs.k8s.io/replicatedjob-name": "node",
            "batch.kubernetes.io/job-completion-index": str(index),
        }
    else:
        labels = {
            "training.kubeflow.org/job-name": job,
            "training.kubeflow.org/replica-type": "master" if index == 0 else "worker",
        }
    state = {"terminated": terminated} if terminated else {"running": {}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {"containers": [{"name": kind.container, "image": "img:1"}]},
        "status": {
            "phase": "Failed" if terminated else "Running",
            "containerStatuses": [
                {"name": kind.container, "ready": False, "restartCount": 0, "image": "img:1",
                 "imageID": "", "state": state}
            ],
        },
    }  # fmt: skip


class Operator:
    """Plays the job's controller: writes pods and job conditions through the API."""

    def __init__(self, api_client: k8s.ApiClient, kind: JobKind) -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.jobs = k8s.CustomObjectsApi(api_client)
        self.kind = kind

    def start_pods(self, **primary_terminated) -> None:
        kind = self.kind
        primary = _pod(kind, PRIMARY[kind.api], 0, terminated=primary_terminated or None)
        self.core.create_namespaced_pod(NAMESPACE, primary)
        self.core.create_namespaced_pod(NAMESPACE, _pod(kind, OTHER[kind.api], 1))
        # A failed primary pod of another job, which the launcher must not report.
        other = _pod(kind, "other-0", 0, job="other", terminated={"exitCode": 1, "reason": "E"})
        self.core.create_namespaced_pod(NAMESPACE, other)

    def set_conditions(self, *conditions: dict) -> None:
        status = {"conditions": [{"status": "True", **c} for c in conditions]}
        kind = self.kind
        self.jobs.patch_namespaced_custom_object_status(
            kind.group, kind.version, NAMESPACE, kind.plural, "sft-run", {"status": status}
        )


def test_run_succeeds_streams_logs_and_reports_progress(emulator, kind, tmp_path, caplog):
    metrics = tmp_path / "training_metrics.jsonl"
    metrics.write_text(json.dumps({"step": 5, "max_steps": 10}) + "\n")
    launcher = JobLauncher(NAMESPACE, emulator, kind)
    operator = Operator(emulator, kind)

    def operate() -> None:
        while not launcher.jobs.list_namespaced_custom_object(
            kind.group, kind.version, NAMESPACE, kind.plural
        )["items"]:
            time.sleep(0.02)
        operator.start_pods()
        operator.set_conditions({"type": "Created"}, {"type": "Running"})
        time.sleep(0.3)
        operator.set_conditions({"type": "Created"}, {"type": kind.succeeded, "reason": "Done"})

    thread = threading.Thread(target=operate)
    thread.start()
    with caplog.at_level(logging.INFO, logger="cluster.launcher"):
        job = launcher.run(
            _manifest(kind),
            timeout_s=10,
            poll_s=0.05,
            progress=metrics_progress(tmp_path / "training_metrics.jsonl"),
        )
        thread.join(5)
        deadline = time.monotonic() + 5  # the log-streaming thread runs beside the wait
        while "step 2 loss 1.5" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert job["kind"] == kind.kind
    assert kind.succeeded in {c["type"] for c in job["status"]["conditions"]}
    assert f"{kind.kind} sft-run: step 5/10" in caplog.text
    assert f"{kind.kind} sft-run: Created" in caplog.text
    assert "[sft-run rank 0] step 2 loss 1.5" in caplog.text
    assert launcher.primary_logs("sft-run") == LOG.decode()
    pods = [p.metadata.name for p in launcher.pods("sft-run")]
    assert pods == [PRIMARY[kind.api], OTHER[kind.api]]


def test_failed_job_raises_with_condition_and_pod_reasons(emulator, kind):
    launcher = JobLauncher(NAMESPACE, emulator, kind)
    operator = Operator(emulator, kind)
    launcher.create(_manifest(kind))
    operator.start_pods(exitCode=137, reason="OOMKilled", message="memory limit 160Gi")
    reason = FAILED_REASON[kind.api]
    operator.set_conditions(
        {"type": "Created"},
        {"type": "Failed", "reason": reason, "message": "rank 0 exited with 137"},
    )
    with pytest.raises(JobFailed) as failure:
        launcher.wait("sft-run", timeout_s=5, poll_s=0.05)
    message = str(failure.value)
    assert f"{kind.kind} team/sft-run failed: {reason}: rank 0 exited with 137" in message
    assert f"{PRIMARY[kind.api]}: OOMKilled (exit code 137): memory limit 160Gi" in message
    assert "other-0" not in message
    assert "step 2 loss 1.5" in message


def test_wait_times_out_naming_the_conditions(emulator, kind):
    launcher = JobLauncher(NAMESPACE, emulator, kind)
    launcher.create(_manifest(kind))
    Operator(emulator, kind).set_conditions({"type": "Created"})
    with pytest.raises(
        TimeoutError,
        match=r"sft-run did not finish in 0 s \(created; conditions: \['Created'\]",
    ):
        launcher.wait("sft-run", timeout_s=0.2, poll_s=0.05)


def test_a_suspended_job_waits_as_queued_then_runs(emulator, kind, caplog):
    """Kueue creates the job suspended and lifts it when its queue admits it: the launcher
    says queued (not failed) and keeps waiting."""
    launcher = JobLauncher(NAMESPACE, emulator, kind)
    manifest = _manifest(kind)
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    launcher.create(manifest)
    operator = Operator(emulator, kind)
    operator.set_conditions({"type": "Suspended", "reason": "Suspended"})

    def admit() -> None:
        time.sleep(0.4)
        operator.set_conditions({"type": kind.succeeded, "reason": "Done"})

    thread = threading.Thread(target=admit)
    thread.start()
    with caplog.at_level(logging.INFO, logger="cluster.launcher"):
        job = launcher.wait("sft-run", timeout_s=10, poll_s=0.05)
    thread.join(5)
    assert f"{kind.kind} sft-run: queued (suspended, Kueue queue team-a)" in caplog.text
    assert kind.succeeded in {c["type"] for c in job["status"]["conditions"]}


def test_delete_is_idempotent(emulator, kind):
    launcher = JobLauncher(NAMESPACE, emulator, kind)
    launcher.create(_manifest(kind))
    assert launcher.delete("sft-run") is True
    assert launcher.delete("sft-run") is False
    with pytest.raises(k8s.ApiException) as missing:
        launcher.get("sft-run")
    assert missing.value.status == 404


def test_metrics_progress_skips_a_half_written_line(tmp_path):
    progress = metrics_progress(tmp_path / "training_metrics.jsonl")
    assert progress() is None
    lines = [{"step": s, "max_steps": 40, "epoch": 0.1, "wall_time_s": s} for s in (1, 2)]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "training_metrics.jsonl").write_text(text + '{"step": 3, "max_')
    assert progress() == (2, 40)
