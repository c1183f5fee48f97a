"""A training step run as a TrainJob or a PyTorchJob, against ``kmock``'s in-memory Kubernetes
emulator.

No API server, Trainer controller, JobSet or training operator can run here. The emulator
stores what the real client sends and answers API discovery for the job APIs it is told to
serve; the test plays the controllers: when the job appears it works out the training
container (a PyTorchJob's Master; for a TrainJob, the ``node`` container of the JobSet the
Trainer controller makes from the shipped ClusterTrainingRuntime and the job's patches, which
it creates too), runs that container's own command (``python -m torch.distributed.run -m
trainer.sft …``) with the ``PET_*`` variables the controller would set, then writes the job's
conditions through the API. So the manifest's command line, the staging on the "shared volume"
(a temp dir) and the copy-back are all exercised for real on the tiny model, for both APIs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
from kube_emulator import SERVED_JOB_APIS, kube_emulator, trainer_jobset
from kubernetes import client as k8s
from tests_helpers_cluster import DEDICATED_GRPO

import cluster.launcher
from cluster.config import ExecutionConfig, JobLaunch
from cluster.jobs import JOB_KINDS, PYTORCHJOB, TRAINJOB, JobApiNotServed, JobKind
from cluster.launcher import JobFailed, JobLauncher, install_training_runtime
from cluster.step_job import (
    RUN_LABEL,
    RuntimeNotInstalled,
    StepJob,
    build_step_manifest,
    delete_on_sigterm,
    delete_run_jobs,
    job_name,
    run_step_job,
)
from cluster.trainjob import build_training_runtime
from trainer.sft.config import SFTConfig
from trainer.sft.step import run_sft_step

NAMESPACE = "team"
KINDS = pytest.mark.parametrize("kind", [TRAINJOB, PYTORCHJOB], ids=lambda kind: kind.api)


@pytest.fixture
def emulator():
    with kube_emulator(namespace=NAMESPACE) as api_client:
        yield api_client


RUN_ID = "3f1c2a9e-5b7d-4e0f-9a31-0c6f2d8e4b17"
SFT = {
    "lora": {"r": 4, "alpha": 8, "experts": True},
    "max_seq_len": 512,
    "micro_batch_size": 2,
    "max_steps": 2,
    "eval_every": 0,
    "checkpoint_every": 0,
    "merge_check_prompts": 1,
    "dtype": "float32",
}


def _execution(tmp_path, job_api: str = "auto", **job) -> ExecutionConfig:
    return ExecutionConfig(
        mode="job",
        job={"namespace": NAMESPACE, "cpu": "2", "memory": "4Gi", "job_api": job_api, **job},
        work_root=str(tmp_path / "shared"),
        poll_s=0.1,
        timeout_s=600,
    )


def install_runtime(api_client: k8s.ApiClient, tmp_path) -> None:
    """The shipped ClusterTrainingRuntime, as ``lingo cluster install-runtime`` installs it."""
    cluster = _execution(tmp_path).cluster_job("img:1", NAMESPACE)
    assert install_training_runtime(build_training_runtime(cluster), api_client) == "created"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Operator(threading.Thread):
    """Waits for the job, runs its training container's command locally (one node), reports
    the outcome as the job's controller would."""

    def __init__(
        self, api_client: k8s.ApiClient, kind: JobKind, name: str, fail: bool = False
    ) -> None:
        super().__init__(daemon=True)
        self.jobs = k8s.CustomObjectsApi(api_client)
        self.kind, self.name, self.fail = kind, name, fail
        self.command: list[str] | None = None
        self.jobset: dict | None = None
        self.returncode: int | None = None

    def _status(self, *conditions: dict) -> None:
        status = {"conditions": [{"status": "True", **c} for c in conditions]}
        kind = self.kind
        self.jobs.patch_namespaced_custom_object_status(
            kind.group, kind.version, NAMESPACE, kind.plural, self.name, {"status": status}
        )

    def _container(self, job: dict) -> tuple[list[str], str, dict[str, str]]:
        """The training container's command, its processes per node and plain env."""
        if self.kind is PYTORCHJOB:
            master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
            return master["containers"][0]["command"], job["spec"]["nprocPerNode"], {}
        runtime_name = job["spec"]["runtimeRef"]["name"]
        runtime = self.jobs.get_cluster_custom_object(
            TRAINJOB.group, TRAINJOB.version, "clustertrainingruntimes", runtime_name
        )
        self.jobset = trainer_jobset(job, runtime)
        self.jobs.create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", self.jobset
        )
        (node,) = self.jobset["spec"]["replicatedJobs"]
        (container,) = node["template"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        return container["command"], str(job["spec"]["trainer"]["numProcPerNode"]), env

    def run(self) -> None:
        kind = self.kind
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            items = self.jobs.list_namespaced_custom_object(
                kind.group, kind.version, NAMESPACE, kind.plural
            )["items"]
            if any(i["metadata"]["name"] == self.name for i in items):
                break
            time.sleep(0.05)
        job = self.jobs.get_namespaced_custom_object(
            kind.group, kind.version, NAMESPACE, kind.plural, self.name
        )
        self.command, nproc, container_env = self._container(job)
        self._status({"type": "Created"}, {"type": "Running"})
        if self.fail:
            self._status({"type": "Failed", "reason": "JobFailed", "message": "boom"})
            return
        env = {
            **os.environ,
            **container_env,
            "PET_NPROC_PER_NODE": nproc,
            "PET_NNODES": "1",
            "PET_NODE_RANK": "0",
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(_free_port()),
            "OMP_NUM_THREADS": "1",
        }
        command = [os.sys.executable, *self.command[1:]]  # the image's `python` is this one
        self.returncode = subprocess.run(command, env=env, check=False).returncode
        outcome = kind.succeeded if self.returncode == 0 else "Failed"
        self._status({"type": "Created"}, {"type": outcome, "reason": outcome})


def test_a_local_step_still_fills_its_job_manifest_artifact(tmp_path):
    manifest = tmp_path / "job_manifest"
    launch = JobLaunch.for_step({"mode": "local"}, RUN_ID, str(manifest), "img:1")
    assert not launch.as_job
    assert manifest.read_text() == "# trained in the pipeline step's own pod\n"
    with pytest.raises(ValueError, match="mode"):
        JobLaunch.for_step({"mode": "slurm"}, RUN_ID, str(manifest), "img:1")


@SERVED_JOB_APIS
def test_sft_runs_as_a_job_of_the_served_api_and_its_results_come_back(
    served, kind, tmp_path, tiny_model_dir, prepared_data, monkeypatch
):
    """``job_api: auto``: a TrainJob where the server serves Kubeflow Trainer, else a
    PyTorchJob; the step finds the API server as in a pod (here: the emulator)."""
    with kube_emulator(namespace=NAMESPACE, apis=served) as api_client:
        monkeypatch.setattr(cluster.launcher, "default_api_client", lambda: api_client)
        if kind is TRAINJOB:
            install_runtime(api_client, tmp_path)
        name = job_name("sft", RUN_ID)
        operator = Operator(api_client, kind, name)
        operator.start()
        # as the component builds it: from the execution parameter's plain dict
        execution = _execution(tmp_path).model_dump()
        launch = JobLaunch.for_step(execution, RUN_ID, str(tmp_path / "job.yaml"), "img:1")
        assert launch.as_job and not (tmp_path / "job.yaml").exists()  # its YAML comes later
        cfg = SFTConfig.model_validate(SFT)
        model_out, work = tmp_path / "model", tmp_path / "work"
        result = run_sft_step(
            cfg, tiny_model_dir, prepared_data / "train.jsonl", prepared_data / "eval.jsonl",
            model_out, work, launch,
        )  # fmt: skip
        operator.join(5)
        launcher = JobLauncher(NAMESPACE, api_client, kind)
        with pytest.raises(k8s.ApiException):  # a job that succeeded is deleted
            launcher.get(name)
    assert operator.returncode == 0
    command = ["python", "-m", "torch.distributed.run", "-m", "trainer.sft"]
    assert operator.command[:5] == command
    shared = tmp_path / "shared" / name
    assert operator.command[operator.command.index("--base-model") + 1] == str(
        shared / "inputs" / "base-model"
    )
    if kind is TRAINJOB:  # the runtime's volumes, as the job patched them
        pod = operator.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert result.steps == 2
    assert (model_out / "config.json").exists()
    assert (work / "training_metrics.jsonl").exists()
    assert str(shared) not in (work / "sft_summary.json").read_text()  # paths rewritten
    assert f"kind: {kind.kind}" in (tmp_path / "job.yaml").read_text()
    assert f"{RUN_LABEL}: {RUN_ID}" in (tmp_path / "job.yaml").read_text()


@KINDS
def test_failed_job_fails_the_step_and_is_kept(
    emulator, kind, tmp_path, tiny_model_dir, prepared_data
):
    if kind is TRAINJOB:
        install_runtime(emulator, tmp_path)
    launcher = JobLauncher(NAMESPACE, emulator, kind)
    name = job_name("sft", RUN_ID)
    Operator(emulator, kind, name, fail=True).start()
    job = StepJob(
        "sft", "trainer.sft", SFTConfig.model_validate(SFT), "base-model", tiny_model_dir,
        prepared_data / "train.jsonl", None,
    )  # fmt: skip
    with pytest.raises(JobFailed, match=f"{kind.kind} team/{name} failed: JobFailed: boom"):
        run_step_job(
            job, _execution(tmp_path), RUN_ID, tmp_path / "m", tmp_path / "w",
            tmp_path / "job.yaml", "img:1", launcher,
        )  # fmt: skip
    assert launcher.get(name)["metadata"]["labels"][RUN_LABEL] == RUN_ID
    # the exit handler: a finished job stays unless asked; everything goes with include_finished
    assert delete_run_jobs(launcher, RUN_ID) == []
    assert delete_run_jobs(launcher, RUN_ID, include_finished=True) == [name]


def test_a_trainjob_needs_the_runtime_installed(emulator, tmp_path, tiny_model_dir):
    job = StepJob("sft", "trainer.sft", SFTConfig(), "base-model", tiny_model_dir, "t", None)
    with pytest.raises(RuntimeNotInstalled, match="lingo cluster install-runtime"):
        run_step_job(
            job, _execution(tmp_path), RUN_ID, tmp_path / "m", tmp_path / "w",
            tmp_path / "job.yaml", "img:1", JobLauncher(NAMESPACE, emulator, TRAINJOB),
        )  # fmt: skip
    assert not JobLauncher(NAMESPACE, emulator, TRAINJOB).list(f"{RUN_LABEL}={RUN_ID}")


def test_a_job_api_the_server_does_not_serve_is_named(monkeypatch):
    with kube_emulator(namespace=NAMESPACE, apis=("pytorchjob",)) as api_client:
        with pytest.raises(JobApiNotServed, match=r"no TrainJob .*serves PyTorchJob"):
            JobLauncher.connect(NAMESPACE, "trainjob", api_client)
        assert JobLauncher.connect(NAMESPACE, "auto", api_client).kind is PYTORCHJOB
    with (
        kube_emulator(namespace=NAMESPACE, apis=()) as api_client,
        pytest.raises(JobApiNotServed, match="install Kubeflow Trainer v2"),
    ):
        JobLauncher.connect(NAMESPACE, "auto", api_client)


def test_exit_handler_deletes_only_this_runs_active_jobs_of_both_apis(
    emulator, tmp_path, tiny_model_dir
):
    cluster = _execution(tmp_path).cluster_job("img:1", NAMESPACE)
    for step, kind in (("sft", PYTORCHJOB), ("grpo", TRAINJOB)):
        job = StepJob(step, f"trainer.{step}", SFTConfig(), "m", tiny_model_dir, "t", "e")
        launcher = JobLauncher(NAMESPACE, emulator, kind)
        for run in (RUN_ID, "another-run"):
            launcher.create(build_step_manifest(job, cluster, run, ["--config", "c.json"], kind))
    # the exit handler's launcher is a PyTorchJob one (components.tracking): it finds both
    deleted = delete_run_jobs(JobLauncher(NAMESPACE, emulator), RUN_ID)
    assert sorted(deleted) == [job_name("grpo", RUN_ID), job_name("sft", RUN_ID)]
    for kind in JOB_KINDS.values():
        kept = JobLauncher(NAMESPACE, emulator, kind).list(f"{RUN_LABEL}=another-run")
        assert [job["metadata"]["labels"][RUN_LABEL] for job in kept] == ["another-run"]


def test_a_queued_job_of_the_run_is_deleted_too(emulator, tmp_path, tiny_model_dir):
    cluster = _execution(tmp_path, queue="team-a").cluster_job("img:1", NAMESPACE)
    job = StepJob("sft", "trainer.sft", SFTConfig(), "m", tiny_model_dir, "t", None)
    launcher = JobLauncher(NAMESPACE, emulator, TRAINJOB)
    manifest = build_step_manifest(job, cluster, RUN_ID, [], TRAINJOB)
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    launcher.create({**manifest, "spec": {**manifest["spec"], "suspend": True}})  # as Kueue does
    assert delete_run_jobs(launcher, RUN_ID) == [job_name("sft", RUN_ID)]


@KINDS
def test_sigterm_deletes_the_job(emulator, kind, tmp_path, tiny_model_dir):
    launcher = JobLauncher(NAMESPACE, emulator, kind)
    cluster = _execution(tmp_path).cluster_job("img:1", NAMESPACE)
    job = StepJob("sft", "trainer.sft", SFTConfig(), "base-model", tiny_model_dir, "t", None)
    name = launcher.create(build_step_manifest(job, cluster, RUN_ID, ["--config", "c.json"], kind))
    with pytest.raises(SystemExit) as stopped, delete_on_sigterm(launcher, name):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert stopped.value.code == 128 + signal.SIGTERM
    with pytest.raises(k8s.ApiException):
        launcher.get(name)
    assert signal.getsignal(signal.SIGTERM) is not None


@KINDS
def test_world_size_must_match_the_config(kind, tmp_path, tiny_model_dir):
    cluster = _execution(tmp_path, nodes=2, gpus_per_node=4).cluster_job("img:1", NAMESPACE)
    cfg = SFTConfig.model_validate({**SFT, "nproc": 4, "optim": {"backend": "deepspeed"}})
    job = StepJob("sft", "trainer.sft", cfg, "base-model", tiny_model_dir, "t", None)
    with pytest.raises(ValueError, match=rf"nproc=4 but the {kind.kind} runs 8 processes"):
        build_step_manifest(job, cluster, RUN_ID, [], kind)


@KINDS
def test_a_grpo_job_counts_the_rollout_only_processes(kind, tmp_path, tiny_model_dir):
    """Dedicated engines: the job runs nproc training processes plus the engines'
    (gpt-oss-20b: 16 + 2 engines of TP 4 = 24 = 6 nodes x 4 GPUs)."""
    from trainer.grpo.config import GRPOConfig

    cluster = _execution(tmp_path, nodes=6, gpus_per_node=4).cluster_job("img:1", NAMESPACE)
    cfg = GRPOConfig.model_validate(DEDICATED_GRPO)
    job = StepJob("grpo", "trainer.grpo", cfg, "sft-model", tiny_model_dir, "t", "e")
    spec = build_step_manifest(job, cluster, RUN_ID, [], kind)["spec"]
    if kind is TRAINJOB:
        assert (spec["trainer"]["numNodes"], spec["trainer"]["numProcPerNode"]) == (6, 4)
    else:
        assert spec["nprocPerNode"] == "4"
        assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 5
    wrong = GRPOConfig.model_validate(
        {**DEDICATED_GRPO, "rollout": {**DEDICATED_GRPO["rollout"], "num_engines": 1}}
    )
    job = StepJob("grpo", "trainer.grpo", wrong, "sft-model", tiny_model_dir, "t", "e")
    with pytest.raises(ValueError, match=r"nproc=16 \+ 4 rollout-only processes but"):
        build_step_manifest(job, cluster, RUN_ID, [], kind)


def test_execution_config_errors_are_caught_at_validation():
    with pytest.raises(ValueError, match="unknown reference layout 'g6'"):
        ExecutionConfig(mode="job", reference="g6")
    with pytest.raises(ValueError, match="takes no reference layout"):
        ExecutionConfig(mode="local", reference="g5.12xlarge")
    with pytest.raises(ValueError, match="look like credentials"):
        ExecutionConfig(mode="job", job={"env": {"HF_TOKEN": "x"}})
    with pytest.raises(ValueError, match="job_api"):
        ExecutionConfig(mode="job", job={"job_api": "mpijob"})
    with pytest.raises(ValueError, match="not a Kubernetes label value"):
        ExecutionConfig(mode="job", job={"queue": "team a"})
    ref = ExecutionConfig(mode="job", reference="g5.12xlarge", job={"nodes": 2})
    cluster = ref.cluster_job("img:2", "ns")
    assert (cluster.nodes, cluster.gpus_per_node, cluster.image) == (2, 4, "img:2")
    assert json.loads(ref.model_dump_json())["job"] == {"nodes": 2}


def test_the_old_pytorchjob_mode_still_means_a_pytorchjob():
    """Runs scheduled before TrainJobs keep their parameters: ``mode: pytorchjob``."""
    old = ExecutionConfig.model_validate({"mode": "pytorchjob", "reference": "g5.12xlarge"})
    assert old.mode == "job"
    assert old.cluster_job("img:1", "ns").job_api == "pytorchjob"
    assert JobLaunch(old, RUN_ID, "m", "img:1").as_job
