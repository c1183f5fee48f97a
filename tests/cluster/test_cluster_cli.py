"""The cluster as a user meets it from the ``lingo`` command line, against ``kmock``'s in-memory
Kubernetes API emulator (no API server can run here; the test plays the controllers):
``lingo compile --preset gpt-oss-20b`` then a run of its training step creates a TrainJob
where the server serves Kubeflow Trainer and a PyTorchJob where it serves only the Training
Operator; ``lingo cluster install-runtime`` installs the runtime; ``lingo status`` reads the
run's jobs back, a job Kueue holds as queued.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from compiled_form import configure_run
from kube_emulator import SERVED_JOB_APIS, kube_emulator
from kubernetes import client as k8s
from typer.testing import CliRunner

import cluster.launcher
from cluster.config import JobLaunch
from cluster.jobs import PYTORCHJOB, TRAINJOB, JobKind
from cluster.launcher import JobFailed, JobLauncher
from cluster.step_job import RUN_LABEL, StepJob, build_step_manifest, job_name, run_step_job
from components.images import GPU_IMAGE
from pipelines.cli import app
from pipelines.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "7c9e1f2a-0b3d-4c5e-8f6a-1b2c3d4e5f60"
runner = CliRunner()


@pytest.fixture
def cluster_api(monkeypatch):
    """An emulator serving ``apis``; the CLI and the steps reach it as their cluster."""

    def serve(apis: tuple[str, ...], namespace: str = "default"):
        emulator = kube_emulator(namespace=namespace, apis=apis)
        api_client = emulator.__enter__()
        monkeypatch.setattr(cluster.launcher, "default_api_client", lambda: api_client)
        served.append(emulator)
        return api_client

    served: list = []
    yield serve
    for emulator in served:
        emulator.__exit__(None, None, None)


def _fail_when_created(api_client: k8s.ApiClient, kind: JobKind, name: str) -> threading.Thread:
    """Plays the controller of ``kind``: the job fails as soon as it exists (the test is about
    what was created, not about training)."""
    jobs = k8s.CustomObjectsApi(api_client)

    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            items = jobs.list_namespaced_custom_object(
                kind.group, kind.version, "default", kind.plural
            )["items"]
            if any(i["metadata"]["name"] == name for i in items):
                break
            time.sleep(0.05)
        status = {"conditions": [{"type": "Failed", "status": "True", "reason": "Stop"}]}
        jobs.patch_namespaced_custom_object_status(
            kind.group, kind.version, "default", kind.plural, name, {"status": status}
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@SERVED_JOB_APIS
def test_a_compiled_preset_creates_trainjobs_where_served_else_pytorchjobs(
    served, kind, cluster_api, tmp_path, tiny_model_dir, prepared_data
):
    api_client = cluster_api(served)
    compiled = tmp_path / "pipeline.yaml"
    result = runner.invoke(
        app,
        [
            "compile",
            "--preset",
            "gpt-oss-20b",
            "--set",
            "cluster.queue=team-a",
            "-o",
            str(compiled),
        ],
    )
    assert result.exit_code == 0, result.output
    if kind is TRAINJOB:
        result = runner.invoke(app, ["cluster", "install-runtime"])
        assert result.exit_code == 0 and "created ClusterTrainingRuntime lingo-rl" in result.output
    # the execution the compiled pipeline's configure step hands the sft step
    execution = configure_run(compiled)["sft_execution"]
    # as the sft component runs it, with the run's parameter and its own image
    execution = {**execution, "work_root": str(tmp_path / "shared"), "poll_s": 0.1}
    launch = JobLaunch.for_step(execution, RUN_ID, str(tmp_path / "job.yaml"), GPU_IMAGE)
    preset = get_preset("gpt-oss-20b")
    job = StepJob(
        "sft", "trainer.sft", preset.sft, "base-model", tiny_model_dir,
        prepared_data / "train.jsonl", prepared_data / "eval.jsonl",
    )  # fmt: skip
    name = job_name("sft", RUN_ID)
    operator = _fail_when_created(api_client, kind, name)
    with pytest.raises(JobFailed, match=f"{kind.kind} default/{name} failed: Stop"):
        run_step_job(
            job, launch.execution, RUN_ID, tmp_path / "m", tmp_path / "w",
            launch.manifest_path, launch.image,
        )  # fmt: skip
    operator.join(5)
    created = JobLauncher("default", api_client, kind).get(name)  # kept: it failed
    assert created["kind"] == kind.kind
    assert created["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert created["metadata"]["labels"][RUN_LABEL] == RUN_ID
    if kind is TRAINJOB:  # SFT on 2 g5.12xlarge nodes of 4 A10G
        trainer = created["spec"]["trainer"]
        assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
        assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "4"
        assert created["spec"]["runtimeRef"]["name"] == "lingo-rl"
        annotations = created["metadata"]["annotations"]
        assert annotations["trainer.opendatahub.io/metrics-port"] == "28080"
    else:
        assert created["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
        assert "trainjobs" not in str(created)
    assert f"kind: {kind.kind}" in (tmp_path / "job.yaml").read_text()


def test_install_runtime_creates_then_updates_the_shipped_runtime(cluster_api):
    api_client = cluster_api(("trainjob",))
    assert runner.invoke(app, ["cluster", "install-runtime"]).output.startswith("created")
    result = runner.invoke(app, ["cluster", "install-runtime", "--image", "quay.io/me/gpu:2"])
    assert result.exit_code == 0 and result.output.startswith("updated"), result.output
    installed = k8s.CustomObjectsApi(api_client).get_cluster_custom_object(
        TRAINJOB.group, TRAINJOB.version, "clustertrainingruntimes", "lingo-rl"
    )
    pod = installed["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert pod["template"]["spec"]["containers"][0]["image"] == "quay.io/me/gpu:2"
    shipped = yaml.safe_load((ROOT / "deploy" / "cluster-training-runtime.yaml").read_text())
    assert {k: installed[k] for k in ("apiVersion", "kind")} == {
        k: shipped[k] for k in ("apiVersion", "kind")
    }


def test_install_runtime_of_a_local_preset_is_a_usage_error():
    result = runner.invoke(app, ["cluster", "install-runtime", "--preset", "tiny-cpu"])
    assert result.exit_code == 2 and "creates no TrainJob" in result.output


@pytest.fixture
def kfp_run():
    """A KFP API that knows one run, RUNNING (``GET /apis/v2beta1/runs/<id>``)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            found = self.path == f"/apis/v2beta1/runs/{RUN_ID}"
            body = {"run_id": RUN_ID, "display_name": "gpt-oss-20b-x", "state": "RUNNING"}
            data = json.dumps(body if found else {"message": "not found"}).encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_status_shows_the_runs_jobs_and_a_queued_one_is_not_a_failure(
    cluster_api, kfp_run, tmp_path, tiny_model_dir
):
    api_client = cluster_api(("trainjob", "pytorchjob"), namespace="team")
    preset = get_preset("gpt-oss-20b")
    from pipelines.presets import step_execution

    for step, kind, queue in (("sft", PYTORCHJOB, None), ("grpo", TRAINJOB, "team-a")):
        cluster = step_execution(preset, step).cluster_job("img:1", "team")
        cluster = cluster.model_copy(update={"queue": queue})
        config = getattr(preset, step)
        job = StepJob(step, f"trainer.{step}", config, "m", tiny_model_dir, "t", "e")
        manifest = build_step_manifest(job, cluster, RUN_ID, [], kind)
        JobLauncher("team", api_client, kind).create(manifest)
    jobs = k8s.CustomObjectsApi(api_client)
    for kind, name, condition in (
        (PYTORCHJOB, job_name("sft", RUN_ID), {"type": "Succeeded", "status": "True"}),
        (TRAINJOB, job_name("grpo", RUN_ID), {"type": "Suspended", "status": "True"}),
    ):
        jobs.patch_namespaced_custom_object_status(
            kind.group, kind.version, "team", kind.plural, name,
            {"status": {"conditions": [condition]}},
        )  # fmt: skip
    result = runner.invoke(app, ["status", RUN_ID, "--endpoint", kfp_run, "--namespace", "team"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{RUN_ID} RUNNING gpt-oss-20b-x")
    assert f"  grpo  TrainJob   {job_name('grpo', RUN_ID)}  queued (Kueue queue team-a)" in lines
    assert f"  sft   PyTorchJob {job_name('sft', RUN_ID)}  succeeded" in lines
