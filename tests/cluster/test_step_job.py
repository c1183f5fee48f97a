"""A training step run as a PyTorchJob, against ``kmock``'s in-memory Kubernetes emulator.

No API server or training operator can run here. The emulator stores what the real client
sends; the test plays the operator: when the job appears it runs the job's own container
command (``python -m torch.distributed.run -m trainer.sft …``) with the ``PET_*`` variables the
operator would set, then writes the job's conditions through the API. So the manifest's command
line, the staging on the "shared volume" (a temp dir) and the copy-back are all exercised for
real on the tiny model.
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
from kube_emulator import kube_emulator
from kubernetes import client as k8s

from cluster.config import ExecutionConfig, JobLaunch
from cluster.launcher import GROUP, PLURAL, VERSION, PyTorchJobFailed, PyTorchJobLauncher
from cluster.step_job import (
    RUN_LABEL,
    StepJob,
    build_step_manifest,
    delete_on_sigterm,
    delete_run_jobs,
    job_name,
    run_step_job,
)
from trainer.sft.config import SFTConfig
from trainer.sft.step import run_sft_step

NAMESPACE = "team"


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


def _execution(tmp_path, **job) -> ExecutionConfig:
    return ExecutionConfig(
        mode="pytorchjob",
        job={"namespace": NAMESPACE, "cpu": "2", "memory": "4Gi", **job},
        work_root=str(tmp_path / "shared"),
        poll_s=0.1,
        timeout_s=600,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Operator(threading.Thread):
    """Waits for the job, runs its Master container's command locally, reports the outcome."""

    def __init__(self, api_client: k8s.ApiClient, name: str, fail: bool = False) -> None:
        super().__init__(daemon=True)
        self.jobs = k8s.CustomObjectsApi(api_client)
        self.name, self.fail = name, fail
        self.command: list[str] | None = None
        self.returncode: int | None = None

    def _status(self, *conditions: dict) -> None:
        status = {"conditions": [{"status": "True", **c} for c in conditions]}
        self.jobs.patch_namespaced_custom_object_status(
            GROUP, VERSION, NAMESPACE, PLURAL, self.name, {"status": status}
        )

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            items = self.jobs.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
            if any(i["metadata"]["name"] == self.name for i in items["items"]):
                break
            time.sleep(0.05)
        job = self.jobs.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, self.name)
        master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        self.command = master["containers"][0]["command"]
        self._status({"type": "Created"}, {"type": "Running"})
        if self.fail:
            self._status({"type": "Failed", "reason": "PyTorchJobFailed", "message": "boom"})
            return
        env = {
            **os.environ,
            "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
            "PET_NNODES": "1",
            "PET_NODE_RANK": "0",
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(_free_port()),
            "OMP_NUM_THREADS": "1",
        }
        command = [os.sys.executable, *self.command[1:]]  # the image's `python` is this one
        self.returncode = subprocess.run(command, env=env, check=False).returncode
        outcome = "Succeeded" if self.returncode == 0 else "Failed"
        self._status({"type": "Created"}, {"type": outcome, "reason": outcome})


def test_a_local_step_still_fills_its_job_manifest_artifact(tmp_path):
    manifest = tmp_path / "job_manifest"
    launch = JobLaunch.for_step({"mode": "local"}, RUN_ID, str(manifest), "img:1")
    assert not launch.as_job
    assert manifest.read_text() == "# trained in the pipeline step's own pod\n"
    with pytest.raises(ValueError, match="mode"):
        JobLaunch.for_step({"mode": "slurm"}, RUN_ID, str(manifest), "img:1")


def test_sft_runs_as_a_pytorchjob_and_its_results_come_back(
    emulator,
    tmp_path,
    tiny_model_dir,
    prepared_data,
):
    launcher = PyTorchJobLauncher(NAMESPACE, emulator)
    name = job_name("sft", RUN_ID)
    operator = Operator(emulator, name)
    operator.start()
    # as the component builds it: from the execution parameter's plain dict
    execution = _execution(tmp_path).model_dump()
    launch = JobLaunch.for_step(execution, RUN_ID, str(tmp_path / "job.yaml"), "img:1")
    assert launch.as_job and not (tmp_path / "job.yaml").exists()  # the job's YAML comes later
    cfg = SFTConfig.model_validate(SFT)
    model_out, work = tmp_path / "model", tmp_path / "work"
    # run_sft_step builds its own launcher from the kubeconfig: hand it ours
    import cluster.step_job as step_job

    original = step_job.PyTorchJobLauncher
    step_job.PyTorchJobLauncher = lambda namespace: launcher
    try:
        result = run_sft_step(
            cfg, tiny_model_dir, prepared_data / "train.jsonl", prepared_data / "eval.jsonl",
            model_out, work, launch,
        )  # fmt: skip
    finally:
        step_job.PyTorchJobLauncher = original
    operator.join(5)
    assert operator.returncode == 0
    assert operator.command[:5] == ["python", "-m", "torch.distributed.run", "-m", "trainer.sft"]
    shared = tmp_path / "shared" / name
    assert operator.command[operator.command.index("--base-model") + 1] == str(
        shared / "inputs" / "base-model"
    )
    assert result.steps == 2
    assert (model_out / "config.json").exists()
    assert (work / "training_metrics.jsonl").exists()
    assert str(shared) not in (work / "sft_summary.json").read_text()  # paths rewritten
    assert "kind: PyTorchJob" in (tmp_path / "job.yaml").read_text()
    assert f"{RUN_LABEL}: {RUN_ID}" in (tmp_path / "job.yaml").read_text()
    with pytest.raises(k8s.ApiException):  # a job that succeeded is deleted
        launcher.get(name)


def test_failed_job_fails_the_step_and_is_kept(emulator, tmp_path, tiny_model_dir, prepared_data):
    launcher = PyTorchJobLauncher(NAMESPACE, emulator)
    name = job_name("sft", RUN_ID)
    Operator(emulator, name, fail=True).start()
    job = StepJob(
        "sft", "trainer.sft", SFTConfig.model_validate(SFT), "base-model", tiny_model_dir,
        prepared_data / "train.jsonl", None,
    )  # fmt: skip
    with pytest.raises(PyTorchJobFailed, match="PyTorchJobFailed: boom"):
        run_step_job(
            job, _execution(tmp_path), RUN_ID, tmp_path / "m", tmp_path / "w",
            tmp_path / "job.yaml", "img:1", launcher,
        )  # fmt: skip
    assert launcher.get(name)["metadata"]["labels"][RUN_LABEL] == RUN_ID
    # the exit handler: a finished job stays unless asked; everything goes with include_finished
    assert delete_run_jobs(launcher, RUN_ID) == []
    assert delete_run_jobs(launcher, RUN_ID, include_finished=True) == [name]


def test_exit_handler_deletes_only_this_runs_active_jobs(emulator, tmp_path, tiny_model_dir):
    launcher = PyTorchJobLauncher(NAMESPACE, emulator)
    cluster = _execution(tmp_path).cluster_job("img:1", NAMESPACE)
    job = StepJob("grpo", "trainer.grpo", SFTConfig(), "sft-model", tiny_model_dir, "t", "e")
    for run in (RUN_ID, "another-run"):
        launcher.create(build_step_manifest(job, cluster, run, ["--config", "c.json"]))
    assert delete_run_jobs(launcher, RUN_ID) == [job_name("grpo", RUN_ID)]
    assert launcher.get(job_name("grpo", "another-run"))


def test_sigterm_deletes_the_job(emulator, tmp_path, tiny_model_dir):
    launcher = PyTorchJobLauncher(NAMESPACE, emulator)
    cluster = _execution(tmp_path).cluster_job("img:1", NAMESPACE)
    job = StepJob("sft", "trainer.sft", SFTConfig(), "base-model", tiny_model_dir, "t", None)
    name = launcher.create(build_step_manifest(job, cluster, RUN_ID, ["--config", "c.json"]))
    with pytest.raises(SystemExit) as stopped, delete_on_sigterm(launcher, name):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert stopped.value.code == 128 + signal.SIGTERM
    with pytest.raises(k8s.ApiException):
        launcher.get(name)
    assert signal.getsignal(signal.SIGTERM) is not None


def test_world_size_must_match_the_config(tmp_path, tiny_model_dir):
    cluster = _execution(tmp_path, nodes=2, gpus_per_node=4).cluster_job("img:1", NAMESPACE)
    cfg = SFTConfig.model_validate({**SFT, "nproc": 4, "optim": {"backend": "deepspeed"}})
    job = StepJob("sft", "trainer.sft", cfg, "base-model", tiny_model_dir, "t", None)
    with pytest.raises(ValueError, match=r"nproc=4 but the PyTorchJob runs 8 processes"):
        build_step_manifest(job, cluster, RUN_ID, [])


def test_a_grpo_job_counts_the_rollout_only_processes(tmp_path, tiny_model_dir):
    """Dedicated engines: the PyTorchJob runs nproc training processes plus the engines'
    (gpt-oss-20b: 16 + 2 engines of TP 4 = 24 = 6 nodes x 4 GPUs)."""
    from trainer.grpo.config import GRPOConfig

    cluster = _execution(tmp_path, nodes=6, gpus_per_node=4).cluster_job("img:1", NAMESPACE)
    dedicated = {"colocate": False, "num_engines": 2, "tensor_parallel_size": 4}
    grpo = {
        "nproc": 16,
        "prompts_per_step": 32,
        "mini_batch_size": 256,
        "micro_batch_size": 1,
        "optim": {"backend": "deepspeed"},
        "rollout": {"engine": "vllm", **dedicated},
    }
    cfg = GRPOConfig.model_validate(grpo)
    job = StepJob("grpo", "trainer.grpo", cfg, "sft-model", tiny_model_dir, "t", "e")
    manifest = build_step_manifest(job, cluster, RUN_ID, [])
    assert manifest["spec"]["nprocPerNode"] == "4"
    wrong = GRPOConfig.model_validate({**grpo, "rollout": {**grpo["rollout"], "num_engines": 1}})
    job = StepJob("grpo", "trainer.grpo", wrong, "sft-model", tiny_model_dir, "t", "e")
    with pytest.raises(ValueError, match=r"nproc=16 \+ 4 rollout-only processes but"):
        build_step_manifest(job, cluster, RUN_ID, [])


def test_execution_config_errors_are_caught_at_validation():
    with pytest.raises(ValueError, match="unknown reference layout 'g6'"):
        ExecutionConfig(mode="pytorchjob", reference="g6")
    with pytest.raises(ValueError, match="takes no reference layout"):
        ExecutionConfig(mode="local", reference="g5.12xlarge")
    with pytest.raises(ValueError, match="look like credentials"):
        ExecutionConfig(mode="pytorchjob", job={"env": {"HF_TOKEN": "x"}})
    ref = ExecutionConfig(mode="pytorchjob", reference="g5.12xlarge", job={"nodes": 2})
    cluster = ref.cluster_job("img:2", "ns")
    assert (cluster.nodes, cluster.gpus_per_node, cluster.image) == (2, 4, "img:2")
    assert json.loads(ref.model_dump_json())["job"] == {"nodes": 2}
