"""pipelines.run_outputs against the emulated pipeline server (tests/kfp_run_emulator.py) and a
real S3-compatible server (moto): a run's tasks followed, its output artifacts read."""

from pathlib import Path

import boto3
import pytest
from kfp import compiler, dsl
from kfp_run_emulator import RunOutputsEmulator
from s3_server import moto_s3_server, s3_env

from pipelines.kfp_client import (
    KfpApiError,
    KfpConnection,
    RunFailedError,
    create_run,
    get_or_create_experiment,
    upload_pipeline,
)
from pipelines.run_outputs import (
    RunOutputError,
    fetch_artifact,
    find_task,
    follow_run,
    get_run_detail,
    output_uri,
)

BUCKET = "root"


@dsl.component(base_image="python:3.11")
def train(training_log: dsl.Output[dsl.Artifact]):
    pass


@dsl.component(base_image="python:3.11")
def evaluate(report: dsl.Output[dsl.Markdown]):
    pass


@dsl.pipeline(name="two-branches")
def two_branches(big: bool = False):
    with dsl.If(big == True):  # noqa: E712 (a KFP condition)
        train()
    with dsl.Else():
        train()
    evaluate()


@pytest.fixture(scope="module")
def s3():
    with moto_s3_server() as endpoint:
        env = s3_env(endpoint)
        mp = pytest.MonkeyPatch()
        for key, value in env.items():
            mp.setenv(key, value)
        yield boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        mp.undo()


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pipeline") / "two_branches.yaml"
    compiler.Compiler().compile(two_branches, str(path))
    return path


def _outputs(tmp_path: Path) -> dict:
    log = tmp_path / "log"
    (log / "plots").mkdir(parents=True)
    (log / "training_metrics.jsonl").write_text('{"step": 1}\n')
    (log / "plots" / "loss.png").write_bytes(b"\x89PNG fake")
    report = tmp_path / "report.md"
    report.write_text("# report\n")
    return {("train", "training_log"): log, ("evaluate", "report"): report}


def _start(kfp: RunOutputsEmulator, package: Path) -> tuple[KfpConnection, str]:
    kfp.start()
    conn = KfpConnection(kfp.endpoint)
    version = upload_pipeline(conn, package, "two-branches")
    run_id = create_run(conn, version, get_or_create_experiment(conn, "e"), {}, "r")
    return conn, run_id


def test_a_run_is_followed_task_by_task_and_its_outputs_are_read(s3, package, tmp_path):
    states = [{"state": "RUNNING"}] * 3 + [{"state": "SUCCEEDED"}]
    kfp = RunOutputsEmulator(s3, BUCKET, _outputs(tmp_path), states)
    conn, run_id = _start(kfp, package)
    try:
        lines: list[str] = []
        run = follow_run(conn, run_id, timeout_s=30, poll_s=0, echo=lines.append)

        assert lines[-1] == f"run {run_id}: SUCCEEDED"
        assert lines.index("  train: RUNNING") < lines.index("  train: SUCCEEDED")
        assert "  train-2: SUCCEEDED" not in lines  # the Else branch did not run
        assert find_task(run, "train").name == "train"
        log_uri = output_uri(conn, run, "train", "training_log")
        assert log_uri == f"s3://{BUCKET}/two-branches/{run_id}/train/training_log"

        log = fetch_artifact(log_uri, tmp_path / "got" / "log")
        assert (log / "training_metrics.jsonl").read_text() == '{"step": 1}\n'
        assert (log / "plots" / "loss.png").read_bytes() == b"\x89PNG fake"
        report = output_uri(conn, run, "evaluate", "report").replace("s3://", "minio://")
        assert fetch_artifact(report, tmp_path / "got" / "r.md").read_text() == "# report\n"

        with pytest.raises(
            RunOutputError, match=r"task 'evaluate' \(SUCCEEDED\) lists no output 'metrics'"
        ):
            output_uri(conn, run, "evaluate", "metrics")
        with pytest.raises(RunOutputError, match=r"no task 'sft' ran \(tasks: .*evaluate"):
            find_task(run, "sft")
        with pytest.raises(RunOutputError, match="no object at s3://root/nothing/here"):
            fetch_artifact(f"s3://{BUCKET}/nothing/here", tmp_path / "x")
        with pytest.raises(RunOutputError, match="only S3"):
            fetch_artifact("gs://b/k", tmp_path / "x")
        with pytest.raises(KfpApiError, match="HTTP 404.*artifact 999 not found"):
            conn.request("GET", "/artifacts/999")
    finally:
        kfp.stop()


def test_a_failed_run_names_its_failed_task(s3, package, tmp_path):
    states = [{"state": "RUNNING"}, {"state": "FAILED", "error": {"code": 2, "message": "boom"}}]
    kfp = RunOutputsEmulator(
        s3, BUCKET, {}, states, failed_task="train", failed_message="OOMKilled"
    )
    conn, run_id = _start(kfp, package)
    try:
        lines: list[str] = []
        with pytest.raises(
            RunFailedError, match=rf"run {run_id} FAILED: boom; failed tasks: train: OOMKilled"
        ):
            follow_run(conn, run_id, timeout_s=30, poll_s=0, echo=lines.append)
        assert "  train: FAILED (OOMKilled)" in lines
    finally:
        kfp.stop()


def test_the_wait_is_bounded(s3, package, tmp_path):
    kfp = RunOutputsEmulator(s3, BUCKET, {}, [{"state": "RUNNING"}])
    conn, run_id = _start(kfp, package)
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    try:
        with pytest.raises(TimeoutError, match=rf"run {run_id} still RUNNING after 100 s"):
            follow_run(conn, run_id, timeout_s=100, poll_s=30, echo=lambda _: None,
                       sleep=sleep, clock=lambda: now[0])  # fmt: skip
        assert slept == [30, 30, 30, 10]  # the last sleep ends at the timeout, not after it
        assert get_run_detail(conn, run_id)["state"] == "RUNNING"  # the run goes on
    finally:
        kfp.stop()


def test_unlisted_outputs_are_found_where_the_launcher_writes_them(s3, package, tmp_path):
    """A server that lists no output artifacts for its tasks (KFP 2.x may leave them in ML
    Metadata only): the output is looked up under the pipeline root."""
    states = [{"state": "SUCCEEDED"}]
    kfp = RunOutputsEmulator(s3, BUCKET, _outputs(tmp_path), states, list_outputs=False)
    conn, run_id = _start(kfp, package)
    try:
        run = follow_run(conn, run_id, timeout_s=30, poll_s=0, echo=lambda _: None)
        assert find_task(run, "train").outputs == {}
        with pytest.raises(RunOutputError, match="lists no output 'training_log'.*pipeline_root"):
            output_uri(conn, run, "train", "training_log")

        uri = output_uri(conn, run, "train", "training_log", pipeline_root=f"s3://{BUCKET}")
        assert uri == f"s3://{BUCKET}/two-branches/{run_id}/train/training_log"
        report = output_uri(conn, run, "evaluate", "report", pipeline_root=f"minio://{BUCKET}/")
        assert fetch_artifact(report, tmp_path / "r.md").read_text() == "# report\n"
        with pytest.raises(
            RunOutputError, match=r"nothing under s3://root/two-branches/.*train/model"
        ):
            output_uri(conn, run, "train", "model", pipeline_root=f"s3://{BUCKET}")
        assert not [c for c in kfp.calls if "/artifacts/" in c["path"]]
    finally:
        kfp.stop()


def test_the_training_jobs_log_lines_are_followed_once_each(s3, package, tmp_path):
    """The run's PyTorchJob (labelled with the KFP run id) in kmock, an in-memory Kubernetes
    API emulator, with its primary pod's log: each line is shown once, prefixed by the job."""
    from kube_emulator import kube_emulator
    from kubernetes import client as k8s

    from cluster.jobs import PYTORCHJOB
    from cluster.step_job import RUN_LABEL, STEP_LABEL, label_value
    from pipelines.run_outputs import JobLogs

    kfp = RunOutputsEmulator(s3, BUCKET, {}, [{"state": "RUNNING"}] * 2 + [{"state": "SUCCEEDED"}])
    conn, run_id = _start(kfp, package)
    log = b"step 1/2 loss 0.9\nstep 2/2 loss 0.7\n"
    try:
        with kube_emulator({"grpo-x-master-0": log}, "team", ("pytorchjob",)) as api_client:
            kind = PYTORCHJOB
            k8s.CustomObjectsApi(api_client).create_namespaced_custom_object(
                kind.group, kind.version, "team", kind.plural,
                {"apiVersion": f"{kind.group}/{kind.version}", "kind": kind.kind,
                 "metadata": {"name": "grpo-x", "namespace": "team",
                              "labels": {RUN_LABEL: label_value(run_id), STEP_LABEL: "grpo"}},
                 "spec": {}},
            )  # fmt: skip
            labels = dict(kind.pod_labels("grpo-x", primary=True))
            k8s.CoreV1Api(api_client).create_namespaced_pod(
                "team",
                {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "grpo-x-master-0", "namespace": "team", "labels": labels},
                 "spec": {"containers": [{"name": kind.container, "image": "img:1"}]}},
            )  # fmt: skip
            lines: list[str] = []
            follow_run(
                conn, run_id, 30, 0, echo=lines.append,
                job_logs=JobLogs(run_id, "team", api_client),
            )  # fmt: skip
    finally:
        kfp.stop()
    assert [line for line in lines if line.startswith("[")] == [
        "[grpo-x] step 1/2 loss 0.9",
        "[grpo-x] step 2/2 loss 0.7",
    ]
    assert lines.index("[grpo-x] step 1/2 loss 0.9") > lines.index(f"run {run_id}: RUNNING")


def test_job_logs_without_a_cluster_say_so(monkeypatch, tmp_path):
    from pipelines.run_outputs import JobLogs

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    logs, how = JobLogs.in_workbench("run-1")
    assert logs is None and how.startswith("job logs: not followed (no Kubernetes configuration")
