"""Every process the project starts on a cluster gets its share of its pod's CPUs as
``OMP_NUM_THREADS`` (issue #39 item 3).

torchrun sets ``OMP_NUM_THREADS=1`` in every process when the variable is unset and it starts
more than one (``torch/distributed/run.py``), so a rank's CPU work (DeepSpeed's CPU Adam,
Megatron's host optimizer, MXFP4 dequantization) ran on one thread. These tests read every
manifest the presets produce, as an API server would get it, and check the variable against
the CPU request and the processes per pod that manifest itself states.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from cluster.jobs import PYTORCHJOB, TRAINJOB
from cluster.nodes import NODE_TYPES, OMP_THREADS_ENV, cpu_cores, omp_threads
from cluster.step_job import StepJob, build_step_manifest, build_step_runtime, step_cluster
from cluster.torchrun import local_omp_threads
from components.images import GPU_IMAGE, MEGATRON_IMAGE
from pipelines.compile import compile_pipeline
from pipelines.platform import get_platform
from pipelines.presets import PRESETS, megatron_grpo_config, step_execution

RUN_ID = "3f1c2a9e-5b7d-4e0f-9a31-0c6f2d8e4b17"
ARGS = ["--config", "/mnt/shared/c.json"]
CLUSTER_PRESETS = [name for name, p in PRESETS.items() if not p.hardware.local]


def test_a_pods_cpus_are_shared_by_its_processes():
    assert [cpu_cores(q) for q in ("44", "1.5", "500m", " 180 ")] == [44, 1.5, 0.5, 180]
    assert omp_threads("180", 8) == 22  # p5en.48xlarge's job pod, 8 ranks: floor(22.5)
    assert omp_threads("44", 4) == 11  # g5.12xlarge's job pod, 4 ranks
    assert omp_threads("500m", 1) == 1 and omp_threads("2", 4) == 1  # at least one
    assert omp_threads(7.0, 2) == 3
    for bad in ("", "two", "-4", "0", "1Gi"):
        with pytest.raises(ValueError, match="not a Kubernetes CPU quantity"):
            cpu_cores(bad)
    with pytest.raises(ValueError, match="at least one process"):
        omp_threads("4", 0)


def _jobs():
    """``(label, manifest)`` for every training job and job runtime the cluster presets
    build: SFT and GRPO (and the verl preset's Megatron GRPO, in the Megatron image beside
    the GPU image's rollout engines) as a TrainJob and as a PyTorchJob, where that API
    carries it."""
    for name in CLUSTER_PRESETS:
        preset = PRESETS[name]
        steps = [("sft", preset.sft, GPU_IMAGE, None), ("grpo", preset.grpo, GPU_IMAGE, None)]
        if preset.megatron_layout.get("preset") != "tiny-cpu":
            steps.append(("grpo", megatron_grpo_config(preset), MEGATRON_IMAGE, GPU_IMAGE))
        for step, config, image, rollout_image in steps:
            cluster = step_cluster(step_execution(preset, step), image, "team", rollout_image)
            job = StepJob(step, f"trainer.{step}", config, "model", "m", "t", "e")
            for kind in (TRAINJOB, PYTORCHJOB):
                label = f"{name}/{step}/{image.rsplit('/', 1)[-1]}/{kind.kind}"
                try:
                    manifest = build_step_manifest(job, cluster, RUN_ID, ARGS, kind)
                except ValueError:
                    continue  # refused with the fix (test_two_image_job): nothing is sent
                yield label, manifest
                runtime = build_step_runtime(job, cluster, RUN_ID, ARGS, kind)
                if runtime is not None:
                    yield f"{label}/runtime", runtime


def _containers(label: str, manifest: dict) -> list[tuple[str, dict, str, int]]:
    """``(where, env, cpu request, processes per pod)`` of every container of ``manifest``
    that runs training or rollout processes, read from the manifest alone."""
    found = []
    if manifest["kind"] == "TrainJob":
        trainer = manifest["spec"]["trainer"]
        cpu = trainer["resourcesPerNode"]["requests"]["cpu"]
        found.append((label, trainer["env"], cpu, int(trainer["numProcPerNode"])))
    elif manifest["kind"] == "PyTorchJob":
        processes = int(manifest["spec"]["nprocPerNode"])
        for replica, spec in manifest["spec"]["pytorchReplicaSpecs"].items():
            for container in spec["template"]["spec"]["containers"]:
                cpu = container["resources"]["requests"]["cpu"]
                found.append((f"{label}/{replica}", container["env"], cpu, processes))
    else:  # a TrainingRuntime: its rollout pods (the training pods take the TrainJob's env)
        for replicated in manifest["spec"]["template"]["spec"]["replicatedJobs"]:
            for container in replicated["template"]["spec"]["template"]["spec"]["containers"]:
                if "--nproc-per-node" not in container.get("command", []):
                    continue
                command = container["command"]
                processes = int(command[command.index("--nproc-per-node") + 1])
                cpu = container["resources"]["requests"]["cpu"]
                where = f"{label}/{replicated['name']}"
                found.append((where, container["env"], cpu, processes))
    return found


def test_every_training_and_rollout_pod_shares_its_cpus_among_its_processes():
    checked = []
    for label, manifest in _jobs():
        for where, env, cpu, processes in _containers(label, manifest):
            values = {e["name"]: e.get("value") for e in env}
            expected = str(max(1, int(cpu_cores(cpu) // processes)))
            assert values.get(OMP_THREADS_ENV) == expected, (where, cpu, processes, values)
            checked.append((where, processes))
    kinds = {where.split("/")[-1] for where, _ in checked}
    # both APIs, both replicas of a PyTorchJob, the two-image job's rollout pods
    assert {"TrainJob", "Master", "Worker", "rollout"} <= kinds, kinds
    # the 20b presets' 8-GPU ranks get p5en.48xlarge's 180 CPUs ÷ 8, not torchrun's 1
    node = NODE_TYPES["p5en.48xlarge"]
    assert (node.job_cpu, node.gpus) == ("180", 8)
    assert any(p == 8 for _, p in checked)


def test_an_explicit_setting_in_the_job_env_wins():
    preset = PRESETS["gpt-oss-20b"]
    cluster = step_cluster(step_execution(preset, "sft"), GPU_IMAGE, "team")
    cluster = cluster.model_copy(update={"env": {**cluster.env, OMP_THREADS_ENV: "3"}})
    assert dict(cluster.job_env())[OMP_THREADS_ENV] == "3"


@pytest.mark.parametrize("preset_name", CLUSTER_PRESETS)
def test_every_pipeline_pod_that_requests_cpus_gets_them_as_threads(preset_name, tmp_path):
    """The compiled pipeline of a cluster preset: each task's container, one process, has
    ``OMP_NUM_THREADS`` = its CPU request (``pipelines.platform``)."""
    path = compile_pipeline(tmp_path / "p.yaml", PRESETS[preset_name])
    spec = next(yaml.safe_load_all(Path(path).read_text()))
    executors = spec["deploymentSpec"]["executors"]
    threads = {}
    for name, executor in executors.items():
        container = executor.get("container")
        if container is None:
            continue
        cpu = container.get("resources", {}).get("resourceCpuRequest")
        assert cpu, f"{name}: a cluster preset's task requests no CPUs"
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert env.get(OMP_THREADS_ENV) == str(omp_threads(cpu, 1)), (name, cpu, env)
        threads[name.removeprefix("exec-")] = env[OMP_THREADS_ENV]
    assert len(threads) >= 10
    platform = get_platform(PRESETS[preset_name].hardware.platform)
    gpu_steps = ("evaluate", "convert-megatron", "export-hf")  # the branches the preset has
    gpu_threads = {threads[s] for s in gpu_steps if s in threads}
    assert "evaluate" in threads and "export-hf" in threads
    assert gpu_threads == {str(int(cpu_cores(platform.gpu.cpu_request)))}
    assert threads["data-prep"] == platform.cpu.cpu_request == "2"


def test_local_torchrun_divides_the_share_it_was_given(monkeypatch, tmp_path):
    monkeypatch.setenv(OMP_THREADS_ENV, "176")  # a pipeline pod's CPU request
    assert local_omp_threads(8) == 22
    monkeypatch.delenv(OMP_THREADS_ENV)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr("cluster.torchrun.CGROUP_CPU_MAX", cpu_max)
    assert local_omp_threads(4) == 4  # no cgroup file: the affinity mask
    cpu_max.write_text("max 100000\n")
    assert local_omp_threads(4) == 4
    cpu_max.write_text("600000 100000\n")  # a 6-CPU container limit
    assert local_omp_threads(4) == 1 and local_omp_threads(2) == 3
    monkeypatch.setenv(OMP_THREADS_ENV, "lots")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='lots'"):
        local_omp_threads(2)
