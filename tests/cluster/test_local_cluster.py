"""The rehearsal's controller (``cluster.local_cluster``): the pods it makes of the presets'
TrainJobs, the primary-pod rule, torchrun's ``OMP_NUM_THREADS`` rule checked against torch's
own launcher, and a TrainJob run to ``Complete`` and to ``Failed`` by local processes."""

from __future__ import annotations

import os
import sys
import time

import pytest
from kubernetes import client as k8s
from torch.distributed.run import config_from_args, get_args_parser

from cluster.config import ExecutionConfig
from cluster.jobs import TRAINJOB, job_state
from cluster.local_cluster import (
    COMPLETION_INDEX_LABEL,
    LocalCluster,
    cpu_cores,
    jobset_pods,
    primary_pod_matches,
    torchrun_omp_threads,
    trainer_jobset,
)
from cluster.step_job import StepJob, build_step_manifest, build_step_runtime, step_cluster
from cluster.trainjob import build_training_runtime, build_trainjob, master_addr
from components.images import GPU_IMAGE, MEGATRON_IMAGE
from pipelines.presets import PRESETS, Preset, grpo_branch_config, step_execution
from pipelines.rehearsal import mismatch_gate_check, omp_check, primary_pod_check


def _grpo_pods(preset_name: str, backend: str) -> list:
    """The GRPO job's pods of ``preset_name`` on ``backend``, as the step builds the job."""
    preset = Preset.model_validate({**dict(PRESETS[preset_name]), "backend": backend})
    execution = step_execution(preset, "grpo")
    image = MEGATRON_IMAGE if backend == "megatron" else GPU_IMAGE
    cluster = step_cluster(execution, image, "default", GPU_IMAGE)
    job = StepJob("grpo", "trainer.grpo", grpo_branch_config(preset), "m", "m", "t", "e")
    args = ["--config", "/mnt/shared/grpo_config.json"]
    manifest = build_step_manifest(job, cluster, "run", args, TRAINJOB)
    runtime = build_step_runtime(job, cluster, "run", args, TRAINJOB) or build_training_runtime(
        cluster
    )
    return jobset_pods(trainer_jobset(manifest, runtime), manifest)


def test_the_one_image_grpo_job_has_one_primary_pod_with_pet_env():
    """gpt-oss-20b on DeepSpeed: 6 pods of the ``node`` job (4 training, 2 rollout-only), each
    with the Trainer's ``PET_*`` (node rank = completion index), parsed by torchrun."""
    pods = _grpo_pods("gpt-oss-20b", "hf")
    assert [p.name for p in pods] == [f"lingo-grpo-run-node-0-{i}" for i in range(6)]
    for index, pod in enumerate(pods):
        env = {e["name"]: e.get("value") for e in pod.container["env"]}
        assert env["PET_NODE_RANK"] == str(index) == env["JOB_COMPLETION_INDEX"]
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("6", "4")
        assert env["PET_MASTER_ADDR"] == master_addr("lingo-grpo-run")
    assert primary_pod_matches(pods) == ["lingo-grpo-run-node-0-0"]
    assert primary_pod_check({"grpo": pods}).passed


def test_the_two_image_grpo_job_has_two_pods_the_primary_rule_matches():
    """gpt-oss-20b-verl on Megatron: trainers in ``node``, engines in ``rollout``; both
    ``node-0-0`` and ``rollout-0-0`` carry job index 0 and completion index 0 (defect 6 of
    issue #39), which the rehearsal's check reports; it passes because the trainer's pod sorts
    first by name (``sorts_after_trainers``, the fix), and fails a rollout job named
    ``launch``, which would sort first."""
    import dataclasses

    pods = _grpo_pods("gpt-oss-20b-verl", "megatron")
    assert [p.replicated_job for p in pods] == ["node", "rollout"]
    assert {p.container["image"] for p in pods} == {MEGATRON_IMAGE, GPU_IMAGE}
    assert primary_pod_matches(pods) == ["lingo-grpo-run-node-0-0", "lingo-grpo-run-rollout-0-0"]
    check = primary_pod_check({"grpo": pods})
    assert check.passed is True and "2 pods match" in check.detail
    launch = dataclasses.replace(pods[1], name="lingo-grpo-run-launch-0-0", replicated_job="launch")
    check = primary_pod_check({"grpo": [pods[0], launch]})
    assert check.passed is False and "2 pods match" in check.detail
    # the rollout pod gets no PET_* (the torch plugin's env goes to the trainer's node only)
    rollout_env = {e["name"] for e in pods[1].container["env"]}
    assert not any(name.startswith("PET_") for name in rollout_env)
    assert pods[1].labels[COMPLETION_INDEX_LABEL] == "0"


@pytest.mark.parametrize(("env", "nproc"), [({}, 4), ({}, 1), ({"OMP_NUM_THREADS": "10"}, 4)])
def test_omp_threads_follow_torchruns_own_rule(env, nproc, monkeypatch):
    """``torchrun_omp_threads`` says what torch's launcher does: ``config_from_args`` sets
    ``OMP_NUM_THREADS=1`` for its workers when unset and more than one process per node."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = get_args_parser().parse_args([f"--nproc_per_node={nproc}", "-m", "trainer.sft"])
    config_from_args(args)
    assert os.environ.get("OMP_NUM_THREADS", "") == torchrun_omp_threads(env, nproc)


def test_the_omp_check_passes_the_built_pods_and_fails_one_thread_on_many_cpus():
    """The GRPO job's pods as the step builds them carry OMP_NUM_THREADS = their CPU request ÷
    their ranks (issue #39 item 3); a pod without it (as before the fix: torchrun then gives
    each rank 1 thread) fails the check, naming the pod, its ranks and its CPUs."""
    pods = _grpo_pods("gpt-oss-20b", "hf")
    assert cpu_cores("40") == 40 and cpu_cores("500m") == 0.5
    cpus = cpu_cores(pods[0].container["resources"]["requests"]["cpu"])
    assert cpus > 4  # a g5.12xlarge's share: 48 vCPUs less the node's reserve
    check = omp_check([], {"grpo": pods})
    assert check.passed is True, check.detail
    assert f"4 ranks, {cpus} CPUs, OMP_NUM_THREADS={int(cpus // 4)}" in check.detail
    for pod in pods:
        pod.container["env"] = [e for e in pod.container["env"] if e["name"] != "OMP_NUM_THREADS"]
    check = omp_check([], {"grpo": pods})
    assert check.passed is False
    assert f"lingo-grpo-run-node-0-0 (grpo): 4 ranks × 1 thread on {cpus:g} CPUs" in check.detail


def test_the_gate_check_reads_the_metrics_lines(tmp_path):
    """The lines one-step-off-policy writes (gpt-oss-20b-verl's rehearsal, measured): step 1
    on-policy sets the on-policy floor, step 2 the stale one, step 3 is bounded by it (before
    issue #39's fix the gate looked at on-policy steps only: no step was bounded); a run whose
    every step is the first of its staleness has none bounded."""
    preset = PRESETS["gpt-oss-20b"]
    work = tmp_path / "lingo-rl-jobs" / "lingo-grpo-run" / "work"
    work.mkdir(parents=True)
    metrics = work / "training_metrics.jsonl"

    def write(lines):
        metrics.write_text(
            '{"step": 0}\n'
            + "".join(
                f'{{"step": {s}, "staleness": {st}, "rollout_kl": {kl}}}\n' for s, st, kl in lines
            )
        )

    write([(1, 0, 2.3e-14), (2, 1, 1.2e-07), (3, 1, 4.3e-07)])
    check = mismatch_gate_check(preset, tmp_path, {"grpo"})
    assert check.passed is True
    assert (
        check.detail == "steps [3] bounded (the floors: step 1 (staleness 0), step 2 (staleness 1))"
    )
    write([(1, 0, 2.3e-14), (2, 1, 1.2e-07)])
    check = mismatch_gate_check(preset, tmp_path, {"grpo"})
    assert check.passed is False and "no step was bounded" in check.detail
    on_policy = "".join(f'{{"step": {s}, "staleness": 0, "rollout_kl": 0.001}}\n' for s in (1, 2))
    metrics.write_text(on_policy)
    assert mismatch_gate_check(preset, tmp_path, {"grpo"}).passed is True
    metrics.write_text('{"step": 1, "staleness": 0, "rollout_kl": 0.001}\n')
    assert mismatch_gate_check(preset, tmp_path, {"grpo"}).passed is None
    metrics.unlink()
    assert mismatch_gate_check(preset, tmp_path, {"grpo"}).passed is None


def _trainjob(name: str, shared, script: str, nodes: int = 2) -> dict:
    execution = ExecutionConfig(
        mode="job", reference="g5.12xlarge", job={"nodes": nodes, "shared_mount": str(shared)}
    )
    cluster = execution.cluster_job(GPU_IMAGE, "default")
    manifest = build_trainjob(name, cluster, "tests_probe", [])
    manifest["spec"]["trainer"]["command"] = ["python", "-c", script]
    return manifest, build_training_runtime(cluster)


@pytest.mark.parametrize("outcome", ["Complete", "Failed"])
def test_a_trainjob_runs_as_local_pods(tmp_path, outcome):
    """A TrainJob created through the Kubernetes client is expanded and run: each pod a
    process with its ``PET_*``, the job's condition set from their exit codes; the cluster's
    thread limit reaches each process, recorded as a substitution, not as the pod's env."""
    shared = tmp_path / "shared"
    shared.mkdir()
    script = (
        "import os, pathlib; rank = os.environ['PET_NODE_RANK']; "
        "seen = os.environ['PET_MASTER_ADDR'] + ' ' + os.environ.get('OMP_THREAD_LIMIT', '-'); "
        f"pathlib.Path('{shared}', rank).write_text(seen); "
        f"raise SystemExit({1 if outcome == 'Failed' else 0} if rank == '1' else 0)"
    )
    manifest, runtime = _trainjob("lingo-sft-probe", shared, script)
    pythons = {GPU_IMAGE: sys.executable}
    cluster = LocalCluster(tmp_path / "cluster", pythons, {}, tmp_path, "default", thread_limit=1)
    with cluster:
        cluster.install_runtime(runtime)
        api = k8s.CustomObjectsApi(cluster.api_client)
        api.create_namespaced_custom_object(*_path(), manifest)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            job = api.get_namespaced_custom_object(*_path(), "lingo-sft-probe")
            if job_state(TRAINJOB, job) in ("succeeded", "failed"):
                break
            time.sleep(0.5)
        pods = cluster.pods
    assert job_state(TRAINJOB, job) == ("succeeded" if outcome == "Complete" else "failed")
    assert sorted(p.name for p in pods) == ["lingo-sft-probe-node-0-0", "lingo-sft-probe-node-0-1"]
    if outcome == "Complete":
        assert {(shared / r).read_text() for r in ("0", "1")} == {"127.0.0.1 1"}
        assert all("rendezvous" in " ".join(p.substituted) for p in pods)
        assert all("held to 1 (OMP_THREAD_LIMIT)" in " ".join(p.substituted) for p in pods)
        assert not [p for p in pods if "OMP_THREAD_LIMIT" in p.env]


def test_each_ranks_env_is_read_from_its_process(tmp_path):
    """A pod's torchrun (its rendezvous from ``PET_*``) starts ``numProcPerNode`` ranks; the
    controller reads each rank's ``OMP_NUM_THREADS`` from the process, and the OMP check
    fails the pods whose ranks got 1 thread on a node of more CPUs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    rank = tmp_path / "rank.py"
    rank.write_text("import time\ntime.sleep(4)\n")
    manifest, runtime = _trainjob("lingo-sft-ranks", shared, "")
    manifest["spec"]["trainer"]["command"] = ["python", "-m", "torch.distributed.run", str(rank)]
    pythons = {GPU_IMAGE: sys.executable}
    with LocalCluster(tmp_path / "cluster", pythons, {}, tmp_path, "default") as cluster:
        cluster.install_runtime(runtime)
        api = k8s.CustomObjectsApi(cluster.api_client)
        api.create_namespaced_custom_object(*_path(), manifest)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job = api.get_namespaced_custom_object(*_path(), "lingo-sft-ranks")
            if job_state(TRAINJOB, job) in ("succeeded", "failed"):
                break
            time.sleep(0.5)
        pods = cluster.pods
    assert job_state(TRAINJOB, job) == "succeeded", [p.log_path.read_text() for p in pods]
    per_node = manifest["spec"]["trainer"]["numProcPerNode"]
    env = {e["name"]: e.get("value") for e in manifest["spec"]["trainer"].get("env") or []}
    threads = env.get("OMP_NUM_THREADS")
    if threads is None:  # the manifest sets none: torchrun's 1 a rank
        assert [sorted(p.rank_env.values()) for p in pods] == [["1"] * per_node] * 2
        check = omp_check(pods, {})
        assert check.passed is False and "ranks had OMP_NUM_THREADS=1" in check.detail
    else:  # the job's env (CPUs ÷ ranks) reaches every rank as it is
        assert [sorted(p.rank_env.values()) for p in pods] == [[threads] * per_node] * 2


def _path() -> tuple[str, str, str, str]:
    return TRAINJOB.group, TRAINJOB.version, "default", TRAINJOB.plural


def test_access_reviews_are_answered_from_the_role_cluster_setup_binds(tmp_path):
    """The rehearsal's API answers each step's SelfSubjectAccessReviews (two of them in a row
    had been a 409 from kmock, failing SFT's access check) from ``lingo cluster setup``'s Role:
    a two-image job's needs are granted, a Secret's deletion is not."""
    from cluster.access import Access, missing_access, step_access

    with LocalCluster(tmp_path / "cluster", {}, {}, tmp_path, "default") as cluster:
        needs = step_access(TRAINJOB, own_runtime=True)
        assert missing_access(cluster.api_client, "default", needs) == []
        assert missing_access(cluster.api_client, "default", needs) == []  # asked again
        secret = Access("delete", "", "secrets")
        assert missing_access(cluster.api_client, "default", [secret]) == [secret]


def _pytorchjob(name: str, shared, script: str, nodes: int = 3) -> dict:
    from cluster.pytorchjob import build_pytorchjob

    execution = ExecutionConfig(
        mode="job",
        reference="g5.12xlarge",
        job={"nodes": nodes, "shared_mount": str(shared), "job_api": "pytorchjob"},
    )
    manifest = build_pytorchjob(name, execution.cluster_job(GPU_IMAGE, "default"), "m", [])
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["spec"]["containers"][0]["command"] = ["python", "-c", script]
    return manifest


def test_a_pytorchjobs_pods_get_the_training_operators_env():
    """Training Operator v1.9.0 (``pytorch/envvar.go`` ``setPodEnv``, ``master.go``): a Master
    and 2 Workers named ``<job>-<type>-<index>``; MASTER_*/PET_MASTER_* at the Master's
    default port, RANK = PET_NODE_RANK = the Worker's index + 1, WORLD_SIZE = replicas ×
    nprocPerNode; only the Master has the job role torchrun's rank 0 runs in."""
    from cluster.local_cluster import PYTORCHJOB_DEFAULT_PORT, pytorchjob_pods

    manifest = _pytorchjob("lingo-sft-pt", "/mnt/shared", "")
    nproc = manifest["spec"]["nprocPerNode"]
    pods = pytorchjob_pods(manifest)
    assert [p.name for p in pods] == [
        "lingo-sft-pt-master-0",
        "lingo-sft-pt-worker-0",
        "lingo-sft-pt-worker-1",
    ]
    for rank, pod in enumerate(pods):
        env = {e["name"]: e.get("value") for e in pod.container["env"]}
        assert env["RANK"] == env["PET_NODE_RANK"] == str(rank)
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "lingo-sft-pt-master-0"
        assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == str(PYTORCHJOB_DEFAULT_PORT)
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("3", nproc)
        assert env["WORLD_SIZE"] == str(3 * int(nproc))
        assert env["PYTHONUNBUFFERED"] == "1"
    assert primary_pod_matches(pods) == ["lingo-sft-pt-master-0"]
    manifest["spec"]["elasticPolicy"] = {"minReplicas": 1, "maxReplicas": 3}
    with pytest.raises(Exception, match="elasticPolicy"):
        pytorchjob_pods(manifest)


@pytest.mark.parametrize("outcome", ["Succeeded", "Failed"])
def test_a_pytorchjob_runs_as_local_pods_on_a_training_operator_cluster(tmp_path, outcome):
    """A cluster serving only PyTorchJob (``job_apis=("pytorchjob",)``): discovery finds no
    Trainer API, the job created through the client runs as its Master and Workers, each
    with its rank, and gets the operator's ``Succeeded`` or ``Failed`` condition."""
    from cluster.jobs import PYTORCHJOB, served_job_apis

    shared = tmp_path / "shared"
    shared.mkdir()
    script = (
        "import os, pathlib; rank = os.environ['RANK']; "
        f"pathlib.Path('{shared}', rank).write_text(os.environ['MASTER_ADDR']); "
        f"raise SystemExit({1 if outcome == 'Failed' else 0} if rank == '2' else 0)"
    )
    manifest = _pytorchjob("lingo-sft-ptrun", shared, script)
    path = (PYTORCHJOB.group, PYTORCHJOB.version, "default", PYTORCHJOB.plural)
    pythons = {GPU_IMAGE: sys.executable}
    with LocalCluster(
        tmp_path / "cluster", pythons, {}, tmp_path, "default", job_apis=("pytorchjob",)
    ) as cluster:
        assert served_job_apis(cluster.api_client) == ["pytorchjob"]
        api = k8s.CustomObjectsApi(cluster.api_client)
        api.create_namespaced_custom_object(*path, manifest)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            job = api.get_namespaced_custom_object(*path, "lingo-sft-ptrun")
            if job_state(PYTORCHJOB, job) in ("succeeded", "failed"):
                break
            time.sleep(0.5)
        pods = cluster.pods
    assert job_state(PYTORCHJOB, job) == outcome.lower()
    assert sorted(p.replicated_job for p in pods) == ["master", "worker", "worker"]
    if outcome == "Succeeded":
        assert {(shared / r).read_text() for r in ("0", "1", "2")} == {"127.0.0.1"}
