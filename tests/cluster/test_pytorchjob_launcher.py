"""The PyTorchJob launch flow against ``kmock``, an in-memory Kubernetes API emulator.

No Kubernetes API server (nor training operator) can run here, so this is a stand-in: kmock
stores the objects the real client sends over HTTP, and the test plays the training operator by
writing the job's status and its pods through the same API. Label selectors are not applied by
the emulator; the launcher filters pods by label itself.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from kube_emulator import kube_emulator
from kubernetes import client as k8s

from cluster.launcher import (
    GROUP,
    PLURAL,
    VERSION,
    PyTorchJobFailed,
    PyTorchJobLauncher,
    metrics_progress,
)
from cluster.pytorchjob import ClusterJobConfig, build_pytorchjob

NAMESPACE = "team"
MASTER = "sft-run-master-0"
MASTER_LOG = b"step 1 loss 2.0\nstep 2 loss 1.5\n"


@pytest.fixture
def emulator():
    """The emulator, with the master pod's log."""
    with kube_emulator({MASTER: MASTER_LOG}, NAMESPACE) as api_client:
        yield api_client


def _manifest() -> dict:
    cluster = ClusterJobConfig(image="img:1", namespace=NAMESPACE, nodes=2, gpus_per_node=4)
    return build_pytorchjob("sft-run", cluster, "trainer.sft", ["--config", "/mnt/shared/c.json"])


def _pod(name: str, replica: str, terminated: dict | None = None) -> dict:
    labels = {
        "training.kubeflow.org/job-name": "sft-run",
        "training.kubeflow.org/replica-type": replica,
    }
    state = {"terminated": terminated} if terminated else {"running": {}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {"containers": [{"name": "pytorch", "image": "img:1"}]},
        "status": {
            "phase": "Failed" if terminated else "Running",
            "containerStatuses": [
                {"name": "pytorch", "ready": False, "restartCount": 0, "image": "img:1",
                 "imageID": "", "state": state}
            ],
        },
    }  # fmt: skip


class Operator:
    """Plays the training operator: writes pods and job conditions through the API."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.jobs = k8s.CustomObjectsApi(api_client)

    def start_pods(self, **master_terminated) -> None:
        self.core.create_namespaced_pod(NAMESPACE, _pod(MASTER, "master", master_terminated))
        self.core.create_namespaced_pod(NAMESPACE, _pod("sft-run-worker-0", "worker"))
        # A pod of another job, which the launcher must not report.
        other = _pod("other-master-0", "master", {"exitCode": 1, "reason": "Error"})
        other["metadata"]["labels"]["training.kubeflow.org/job-name"] = "other"
        self.core.create_namespaced_pod(NAMESPACE, other)

    def set_conditions(self, *conditions: dict) -> None:
        status = {"conditions": [{"status": "True", **c} for c in conditions]}
        self.jobs.patch_namespaced_custom_object_status(
            GROUP, VERSION, NAMESPACE, PLURAL, "sft-run", {"status": status}
        )


def test_run_succeeds_streams_logs_and_reports_progress(emulator, tmp_path, caplog):
    metrics = tmp_path / "training_metrics.jsonl"
    metrics.write_text(json.dumps({"step": 5, "max_steps": 10}) + "\n")
    launcher = PyTorchJobLauncher(NAMESPACE, emulator)
    operator = Operator(emulator)

    def operate() -> None:
        while not launcher.jobs.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)[
            "items"
        ]:
            time.sleep(0.02)
        operator.start_pods()
        operator.set_conditions({"type": "Created"}, {"type": "Running"})
        time.sleep(0.3)
        operator.set_conditions({"type": "Created"}, {"type": "Succeeded", "reason": "Done"})

    thread = threading.Thread(target=operate)
    thread.start()
    with caplog.at_level(logging.INFO, logger="cluster.launcher"):
        job = launcher.run(
            _manifest(),
            timeout_s=10,
            poll_s=0.05,
            progress=metrics_progress(tmp_path / "training_metrics.jsonl"),
        )
        thread.join(5)
        deadline = time.monotonic() + 5  # the log-streaming thread runs beside the wait
        while "step 2 loss 1.5" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert job["spec"]["nprocPerNode"] == "4"
    assert "Succeeded" in {c["type"] for c in job["status"]["conditions"]}
    assert "PyTorchJob sft-run: step 5/10" in caplog.text
    assert "PyTorchJob sft-run: Running" in caplog.text
    assert "[sft-run master] step 2 loss 1.5" in caplog.text
    assert launcher.master_logs("sft-run") == MASTER_LOG.decode()
    assert [p.metadata.name for p in launcher.pods("sft-run")] == [MASTER, "sft-run-worker-0"]


def test_failed_job_raises_with_condition_and_pod_reasons(emulator):
    launcher = PyTorchJobLauncher(NAMESPACE, emulator)
    operator = Operator(emulator)
    launcher.create(_manifest())
    operator.start_pods(exitCode=137, reason="OOMKilled", message="memory limit 160Gi")
    operator.set_conditions(
        {"type": "Created"},
        {"type": "Failed", "reason": "PyTorchJobFailed", "message": "master 0 exited with 137"},
    )
    with pytest.raises(PyTorchJobFailed) as failure:
        launcher.wait("sft-run", timeout_s=5, poll_s=0.05)
    message = str(failure.value)
    assert "team/sft-run failed: PyTorchJobFailed: master 0 exited with 137" in message
    assert f"{MASTER}: OOMKilled (exit code 137): memory limit 160Gi" in message
    assert "other-master-0" not in message
    assert "step 2 loss 1.5" in message


def test_wait_times_out_naming_the_conditions(emulator):
    launcher = PyTorchJobLauncher(NAMESPACE, emulator)
    launcher.create(_manifest())
    Operator(emulator).set_conditions({"type": "Created"})
    with pytest.raises(
        TimeoutError, match=r"sft-run did not finish in 0 s \(conditions: \['Created'\]"
    ):
        launcher.wait("sft-run", timeout_s=0.2, poll_s=0.05)


def test_delete_is_idempotent(emulator):
    launcher = PyTorchJobLauncher(NAMESPACE, emulator)
    launcher.create(_manifest())
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
