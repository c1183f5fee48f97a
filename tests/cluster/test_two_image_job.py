"""A GRPO job whose dedicated engines run another image than its trainers (a Megatron trainer
beside vLLM engines): the manifests of both job APIs, checked against the CRDs and the
Trainer's webhook rules (``crd_rules``), the node ranks every pod gets, the refusals, and the
launcher creating and deleting the job's own TrainingRuntime against ``kmock``'s in-memory
Kubernetes emulator (no API server can run here: the test plays the controllers)."""

from __future__ import annotations

import threading
import time

import pytest
import yaml
from crd_rules import api_server_errors, trainer_webhook_errors
from kube_emulator import kube_emulator, trainer_jobset
from kubernetes import client as k8s
from torch.distributed.run import get_args_parser

from cluster.config import ClusterJobConfig, ExecutionConfig, JobLaunch
from cluster.jobs import JOB_RUNTIME_PLURAL, PYTORCHJOB, RUNTIME_OF_LABEL, TRAINJOB
from cluster.launcher import JobFailed, JobLauncher
from cluster.rollout_node import RolloutLayout
from cluster.step_job import (
    RUN_LABEL,
    StepJob,
    build_step_manifest,
    build_step_runtime,
    delete_run_jobs,
    job_name,
    run_step_job,
    step_cluster,
)
from cluster.trainjob import ROLLOUT, TORCH_MASTER_PORT, master_addr
from components.images import GPU_IMAGE, MEGATRON_IMAGE
from pipelines.overrides import apply_overrides
from pipelines.presets import PRESETS, step_execution
from trainer.grpo.config import GRPOConfig

NAMESPACE = "team"
RUN_ID = "3f1c2a9e-5b7d-4e0f-9a31-0c6f2d8e4b17"
NAME = job_name("grpo", RUN_ID)
KINDS = pytest.mark.parametrize("kind", [TRAINJOB, PYTORCHJOB], ids=lambda kind: kind.api)
DEDICATED = {"engine": "vllm", "colocate": False, "num_engines": 2, "tensor_parallel_size": 4}
GRPO = {
    "prompts_per_step": 32,
    "mini_batch_size": 256,
    "micro_batch_size": 1,
    "optim": {"backend": "deepspeed"},
    "rollout": DEDICATED,
}
ARGS = ["--config", f"/mnt/shared/lingo-rl-jobs/{NAME}/grpo_config.json"]


def _grpo(training_nodes: int, per_node: int = 4, **rollout) -> StepJob:
    """A GRPO step of ``training_nodes`` nodes beside 2 engines of TP 4 (gpt-oss-20b's)."""
    config = {**GRPO, "nproc": training_nodes * per_node}
    config["rollout"] = {**DEDICATED, **rollout}
    cfg = GRPOConfig.model_validate(config)
    return StepJob("grpo", "trainer.grpo", cfg, "sft-model", "m", "t", "e")


def _cluster(nodes: int, rollout_image: str | None = GPU_IMAGE, **job) -> ClusterJobConfig:
    execution = ExecutionConfig(
        mode="job", reference="g5.12xlarge", job={"nodes": nodes, "namespace": NAMESPACE, **job}
    )
    return step_cluster(execution, MEGATRON_IMAGE, NAMESPACE, rollout_image)


def _pod(replicated_job: dict) -> dict:
    return replicated_job["template"]["spec"]["template"]["spec"]


@KINDS
def test_one_image_leaves_the_manifests_as_they_were(kind):
    """A rollout image equal to the training image (the DeepSpeed branch: both the GPU image)
    changes nothing: the same manifest as without one, and no runtime of the job's own."""
    job = _grpo(4)
    for image in (MEGATRON_IMAGE, None):
        cluster = _cluster(6, rollout_image=image)
        assert build_step_manifest(job, cluster, RUN_ID, ARGS, kind) == (
            build_step_manifest(job, _cluster(6, rollout_image=None), RUN_ID, ARGS, kind)
        )
        assert build_step_runtime(job, cluster, RUN_ID, ARGS, kind) is None
    # without dedicated engines no node is rollout-only: one image whatever rollout_image says
    cfg = GRPOConfig.model_validate({**GRPO, "nproc": 16, "rollout": {"colocate": True}})
    colocated = StepJob("grpo", "trainer.grpo", cfg, "sft-model", "m", "t", "e")
    assert build_step_runtime(colocated, _cluster(4), RUN_ID, ARGS, TRAINJOB) is None
    manifest = build_step_manifest(colocated, _cluster(4), RUN_ID, ARGS, kind)
    assert MEGATRON_IMAGE in yaml.safe_dump(manifest)
    assert GPU_IMAGE not in yaml.safe_dump(manifest)


def test_a_two_image_trainjob_and_its_runtime_are_accepted():
    """gpt-oss-20b's GRPO job (4 training nodes, 2 rollout-only nodes of 4 GPUs) as a
    Megatron trainer with vLLM engines: the TrainJob references a TrainingRuntime of its own,
    which holds the trainers' ``node`` job and a ``rollout`` job of the GPU image."""
    job, cluster = _grpo(4), _cluster(6)
    trainjob = build_step_manifest(job, cluster, RUN_ID, ARGS, TRAINJOB)
    runtime = build_step_runtime(job, cluster, RUN_ID, ARGS, TRAINJOB)
    assert runtime is not None
    evaluated: list[str] = []
    assert api_server_errors(trainjob) == []
    assert api_server_errors(runtime, evaluated) == []
    assert any("has(self.torch)" in rule for rule in evaluated)
    assert trainer_webhook_errors(trainjob, runtime) == []
    trainer = trainjob["spec"]["trainer"]
    assert trainjob["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime", "name": NAME,
    }  # fmt: skip
    assert (trainer["image"], trainer["numNodes"], trainer["numProcPerNode"]) == (
        MEGATRON_IMAGE, 4, 4,
    )  # fmt: skip
    assert trainer["command"] == [
        "python", "-m", "torch.distributed.run", "--nnodes=6", "-m", "trainer.grpo", *ARGS,
    ]  # fmt: skip
    meta = runtime["metadata"]
    assert (meta["name"], meta["namespace"]) == (NAME, NAMESPACE)
    assert meta["labels"][RUNTIME_OF_LABEL] == NAME
    assert meta["labels"][RUN_LABEL] == RUN_ID  # the exit handler's selector
    node, rollout = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node" and rollout["name"] == ROLLOUT
    assert "labels" not in rollout["template"].get("metadata", {})  # not a trainer ancestor
    spec = rollout["template"]["spec"]
    assert (rollout["replicas"], spec["completionMode"], spec["completions"]) == (1, "Indexed", 2)
    (container,) = _pod(rollout)["containers"]
    assert container["image"] == GPU_IMAGE
    layout = RolloutLayout(4, 2, 4, f"{NAME}-node-0-0.{NAME}", 29500)
    assert container["command"] == layout.command(["-m", "trainer.grpo", *ARGS])
    # the rollout pods take what the job patches into the trainers' pods
    assert container["resources"] == trainer["resourcesPerNode"]
    assert container["env"] == trainer["env"]
    (patch,) = trainjob["spec"]["runtimePatches"]
    (node_patch,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    patched = _pod(node_patch)
    for field in ("volumes", "nodeSelector", "tolerations"):
        assert _pod(rollout)[field] == patched[field]
    assert container["volumeMounts"] == patched["containers"][0]["volumeMounts"]


def test_every_pod_of_the_jobset_gets_its_own_node_rank():
    """The JobSet the Trainer makes of the TrainJob and its runtime (``trainer_jobset``): its
    ``node`` pods with the ``PET_*`` the torch plugin sets (``PET_NNODES`` = ``numNodes``,
    ``PET_NODE_RANK`` = the pod's index) and its ``rollout`` pods with their completion index,
    parsed by torchrun's own parser (``env`` arguments: ``PET_*`` only as the default)."""
    job, cluster = _grpo(4), _cluster(6)
    trainjob = build_step_manifest(job, cluster, RUN_ID, ARGS, TRAINJOB)
    runtime = build_step_runtime(job, cluster, RUN_ID, ARGS, TRAINJOB)
    jobset = trainer_jobset(trainjob, runtime)
    node, rollout = jobset["spec"]["replicatedJobs"]
    nodes = []
    for index in range(node["template"]["spec"]["parallelism"]):
        (container,) = _pod(node)["containers"]
        plugin = {
            "PET_NNODES": str(trainjob["spec"]["trainer"]["numNodes"]),
            "PET_NPROC_PER_NODE": "4",
            "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": master_addr(NAME),
            "PET_MASTER_PORT": str(TORCH_MASTER_PORT),
        }
        with pytest.MonkeyPatch.context() as env:
            for name, value in plugin.items():
                env.setenv(name, value)
            nodes.append(get_args_parser().parse_args(container["command"][3:]))
    assert _pod(rollout)["containers"][0]["image"] == GPU_IMAGE
    command = _pod(rollout)["containers"][0]["command"]
    entry = command[command.index("--") + 1 :]
    for index in range(rollout["template"]["spec"]["parallelism"]):
        layout = RolloutLayout(4, 2, 4, master_addr(NAME), TORCH_MASTER_PORT)
        argv = layout.torchrun_argv(index, entry)
        nodes.append(get_args_parser().parse_args(argv[3:]))
    assert [int(n.node_rank) for n in nodes] == list(range(6))
    assert {(n.nnodes, n.nproc_per_node, n.master_addr, int(n.master_port)) for n in nodes} == {
        ("6", "4", master_addr(NAME), TORCH_MASTER_PORT)
    }
    assert {(n.module, n.training_script, tuple(n.training_script_args)) for n in nodes} == {
        (True, "trainer.grpo", tuple(ARGS))
    }


def test_a_two_image_pytorchjob_trains_on_its_master():
    """One training node: the Master runs the Megatron image, the Workers (node ranks 1..R,
    the rollout-only nodes) the GPU image; one training node and 2 engines of TP 4."""
    manifest = build_step_manifest(_grpo(1), _cluster(3), RUN_ID, ARGS, PYTORCHJOB)
    assert api_server_errors(manifest) == []
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    images = {
        role: [c["image"] for c in spec["template"]["spec"]["containers"]]
        for role, spec in replicas.items()
    }
    assert images == {"Master": [MEGATRON_IMAGE], "Worker": [GPU_IMAGE]}
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    master, worker = (replicas[r]["template"]["spec"] for r in ("Master", "Worker"))
    assert master["containers"][0]["command"] == worker["containers"][0]["command"]
    master["containers"][0]["image"] = GPU_IMAGE
    assert master == worker  # nothing else differs


@pytest.mark.parametrize("preset_name", ["gpt-oss-20b"])
def test_the_presets_two_image_jobs(preset_name):
    """A cluster preset with dedicated engines, its GRPO step in the Megatron image as the
    step's pod builds it: a TrainJob with its own runtime, accepted; a PyTorchJob refused
    (4 training nodes), and accepted with ``hardware.grpo_nodes=1``."""
    preset = PRESETS[preset_name]
    assert preset.grpo.rollout_processes
    for nodes, kind in ((4, TRAINJOB), (1, PYTORCHJOB)):
        chosen = apply_overrides(preset, {"hardware.grpo_nodes": str(nodes)})
        cluster = step_cluster(step_execution(chosen, "grpo"), MEGATRON_IMAGE, "team", GPU_IMAGE)
        job = StepJob("grpo", "trainer.grpo", chosen.grpo, "sft-model", "m", "t", "e")
        manifest = build_step_manifest(job, cluster, RUN_ID, ARGS, kind)
        assert api_server_errors(manifest) == []
        runtime = build_step_runtime(job, cluster, RUN_ID, ARGS, kind)
        if kind is TRAINJOB:
            assert api_server_errors(runtime) == []
            assert trainer_webhook_errors(manifest, runtime) == []
    cluster = step_cluster(step_execution(preset, "grpo"), MEGATRON_IMAGE, "team", GPU_IMAGE)
    job = StepJob("grpo", "trainer.grpo", preset.grpo, "sft-model", "m", "t", "e")
    with pytest.raises(ValueError, match="set cluster.job_api=trainjob, or train on one node"):
        build_step_manifest(job, cluster, RUN_ID, ARGS, PYTORCHJOB)


@KINDS
def test_the_verl_presets_megatron_branch_is_a_two_image_job_of_either_api(kind):
    """``gpt-oss-20b-verl`` with ``-p backend=megatron``: the branch's GRPO config
    (``megatron_grpo_config``, as the component builds it), its 8 Megatron trainers on the
    job's first node in the Megatron image, its 2 vLLM engines (TP 4) on the second in the GPU
    image; one training node, so a PyTorchJob carries it too."""
    from pipelines.presets import megatron_grpo_config

    preset = PRESETS["gpt-oss-20b-verl"]
    cfg = megatron_grpo_config(preset)
    assert cfg.optim.backend == "megatron" and cfg.rollout.engine == "vllm"
    cluster = step_cluster(step_execution(preset, "grpo"), MEGATRON_IMAGE, "team", GPU_IMAGE)
    assert cluster.nodes == 2  # rollout_nodes follow from the config: build_step_manifest
    job = StepJob("grpo", "trainer.grpo", cfg, "sft-model", "m", "t", "e")
    manifest = build_step_manifest(job, cluster, RUN_ID, ARGS, kind)
    assert api_server_errors(manifest) == []
    if kind is PYTORCHJOB:
        replicas = manifest["spec"]["pytorchReplicaSpecs"]
        images = {r: s["template"]["spec"]["containers"][0]["image"] for r, s in replicas.items()}
        assert images == {"Master": MEGATRON_IMAGE, "Worker": GPU_IMAGE}
        return
    runtime = build_step_runtime(job, cluster, RUN_ID, ARGS, kind)
    assert api_server_errors(runtime) == [] and trainer_webhook_errors(manifest, runtime) == []
    trainer = manifest["spec"]["trainer"]
    assert (trainer["image"], trainer["numNodes"], trainer["numProcPerNode"]) == (
        MEGATRON_IMAGE, 1, 8,
    )  # fmt: skip
    _, rollout = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert _pod(rollout)["containers"][0]["image"] == GPU_IMAGE
    assert rollout["template"]["spec"]["completions"] == 1


def test_what_two_images_cannot_do_is_refused_with_the_fix():
    message = (
        "a PyTorchJob has one pod template for the Master and one for the Workers, so its 4 "
        f"training nodes ({MEGATRON_IMAGE}) and 2 rollout-only nodes ({GPU_IMAGE}) cannot run "
        "two images: set cluster.job_api=trainjob, or train on one node (hardware.grpo_nodes=1)"
    )
    with pytest.raises(ValueError) as refused:
        build_step_manifest(_grpo(4), _cluster(6), RUN_ID, ARGS, PYTORCHJOB)
    assert str(refused.value) == message
    elastic = {"elastic": {"min_nodes": 3, "max_nodes": 3}}
    with pytest.raises(ValueError, match="elastic: a PyTorchJob with two images needs fixed"):
        build_step_manifest(_grpo(1), _cluster(3, **elastic), RUN_ID, ARGS, PYTORCHJOB)
    # 2 trainers + 3 engines of TP 2 on 2 nodes of 4: the first node mixes 2 and 2
    rollout = {**DEDICATED, "num_engines": 3, "tensor_parallel_size": 2}
    cfg = GRPOConfig.model_validate({**GRPO, "nproc": 2, "rollout": rollout})
    shared_node = StepJob("grpo", "trainer.grpo", cfg, "sft-model", "m", "t", "e")
    with pytest.raises(ValueError, match="6 rollout-only processes leave a node shared"):
        build_step_manifest(shared_node, _cluster(2), RUN_ID, ARGS, TRAINJOB)
    with pytest.raises(ValueError, match="leaves none of the job's 2 node"):
        ClusterJobConfig(image="a", rollout_image="b", nodes=2, rollout_nodes=2)


def test_a_launch_carries_the_rollout_image(tmp_path):
    """The component passes the GPU image for the engines (``components/grpo.py``)."""
    execution = {"mode": "job", "reference": "g5.12xlarge", "job": {"nodes": 6}}
    launch = JobLaunch.for_step(execution, RUN_ID, str(tmp_path / "j"), MEGATRON_IMAGE, GPU_IMAGE)
    assert (launch.image, launch.rollout_image) == (MEGATRON_IMAGE, GPU_IMAGE)
    assert launch.execution.cluster_job(launch.image, "ns", launch.rollout_image).two_images is (
        False  # no rollout-only node until the step's config says how many (job_layout)
    )
    pinned = {**execution, "job": {**execution["job"], "rollout_image": "mine:1"}}
    cluster = ExecutionConfig.model_validate(pinned).cluster_job(MEGATRON_IMAGE, "ns", GPU_IMAGE)
    assert cluster.rollout_image == "mine:1"  # the execution's own wins


# --- the launcher, against the emulator -------------------------------------------------------


class Trainer(threading.Thread):
    """Plays the Trainer controller: when the TrainJob appears, records whether its runtime was
    there first, writes the model the job would have written, and reports the outcome."""

    def __init__(self, api_client: k8s.ApiClient, shared, fail: bool = False) -> None:
        super().__init__(daemon=True)
        self.jobs = k8s.CustomObjectsApi(api_client)
        self.shared, self.fail = shared, fail
        self.runtime_first: dict | None = None

    def run(self) -> None:
        path = (TRAINJOB.group, TRAINJOB.version, NAMESPACE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            items = self.jobs.list_namespaced_custom_object(*path, TRAINJOB.plural)["items"]
            if any(i["metadata"]["name"] == NAME for i in items):
                break
            time.sleep(0.05)
        job = self.jobs.get_namespaced_custom_object(*path, TRAINJOB.plural, NAME)
        ref = job["spec"]["runtimeRef"]
        self.runtime_first = self.jobs.get_namespaced_custom_object(
            *path, JOB_RUNTIME_PLURAL, ref["name"]
        )
        (self.shared / "model").mkdir(parents=True, exist_ok=True)
        (self.shared / "model" / "config.json").write_text("{}")
        outcome = "Failed" if self.fail else TRAINJOB.succeeded
        status = {"conditions": [{"type": outcome, "status": "True", "reason": outcome}]}
        self.jobs.patch_namespaced_custom_object_status(
            *path, TRAINJOB.plural, NAME, {"status": status}
        )


def _run(api_client, tmp_path, fail: bool = False) -> tuple[Trainer, JobLauncher]:
    for name in ("m", "t", "e"):
        (tmp_path / name).write_text(name)
    execution = ExecutionConfig(
        mode="job",
        reference="g5.12xlarge",
        job={"nodes": 6, "namespace": NAMESPACE, "job_api": "trainjob"},
        work_root=str(tmp_path / "shared"),
        poll_s=0.1,
        timeout_s=60,
    )
    trainer = Trainer(api_client, tmp_path / "shared" / NAME, fail)
    trainer.start()
    launcher = JobLauncher(NAMESPACE, api_client, TRAINJOB)
    job = _grpo(4)
    job = StepJob(job.step, job.module, job.config, job.model_flag, *(tmp_path / n for n in "mte"))
    try:
        run_step_job(
            job, execution, RUN_ID, tmp_path / "model", tmp_path / "work", tmp_path / "job.yaml",
            MEGATRON_IMAGE, launcher, rollout_image=GPU_IMAGE,
        )  # fmt: skip
    finally:
        trainer.join(10)
    return trainer, launcher


def _gone(launcher: JobLauncher, plural: str) -> bool:
    try:
        launcher.jobs.get_namespaced_custom_object(
            TRAINJOB.group, TRAINJOB.version, NAMESPACE, plural, NAME
        )
    except k8s.ApiException as error:
        return error.status == 404
    return False


def test_the_launcher_creates_the_runtime_first_and_deletes_it_with_the_job(tmp_path):
    """No ClusterTrainingRuntime is installed: a two-image job needs only its own."""
    with kube_emulator(namespace=NAMESPACE) as api_client:
        trainer, launcher = _run(api_client, tmp_path)
        assert trainer.runtime_first["metadata"]["labels"][RUNTIME_OF_LABEL] == NAME
        assert _gone(launcher, TRAINJOB.plural) and _gone(launcher, JOB_RUNTIME_PLURAL)
    runtime, trainjob = yaml.safe_load_all((tmp_path / "job.yaml").read_text())
    assert (runtime["kind"], trainjob["kind"]) == ("TrainingRuntime", "TrainJob")
    assert runtime["spec"] == trainer.runtime_first["spec"]
    assert (tmp_path / "model" / "config.json").exists()


def test_a_failed_job_keeps_its_runtime_until_the_exit_handler(tmp_path):
    with kube_emulator(namespace=NAMESPACE) as api_client:
        with pytest.raises(JobFailed, match=f"TrainJob team/{NAME} failed"):
            _run(api_client, tmp_path, fail=True)
        launcher = JobLauncher(NAMESPACE, api_client, TRAINJOB)
        assert not _gone(launcher, TRAINJOB.plural) and not _gone(launcher, JOB_RUNTIME_PLURAL)
        # the exit handler's launcher is a PyTorchJob one (components.tracking)
        assert delete_run_jobs(JobLauncher(NAMESPACE, api_client), RUN_ID, True) == [NAME]
        assert _gone(launcher, TRAINJOB.plural) and _gone(launcher, JOB_RUNTIME_PLURAL)


def test_only_the_jobs_own_runtime_is_deleted_and_a_refused_job_takes_it_along(tmp_path):
    job, cluster = _grpo(4), _cluster(6)
    trainjob = build_step_manifest(job, cluster, RUN_ID, ARGS, TRAINJOB)
    runtime = build_step_runtime(job, cluster, RUN_ID, ARGS, TRAINJOB)
    with kube_emulator(namespace=NAMESPACE) as api_client:
        launcher = JobLauncher(NAMESPACE, api_client, TRAINJOB)
        path = (TRAINJOB.group, TRAINJOB.version, NAMESPACE, JOB_RUNTIME_PLURAL)
        foreign = {**runtime, "metadata": {"name": NAME, "namespace": NAMESPACE}}
        launcher.jobs.create_namespaced_custom_object(*path, foreign)
        with pytest.raises(k8s.ApiException) as taken:  # a runtime we did not write
            launcher.run(trainjob, 5, 0.1, runtime=runtime, stream_logs=False)
        assert taken.value.status == 409
        assert not launcher.delete(NAME)  # no such job; the foreign runtime stays
        assert not _gone(launcher, JOB_RUNTIME_PLURAL)
        launcher.jobs.delete_namespaced_custom_object(*path[:3], JOB_RUNTIME_PLURAL, NAME)
        launcher.create(trainjob)  # a job of that name: the server refuses the next create
        with pytest.raises(k8s.ApiException):
            launcher.run(trainjob, 5, 0.1, runtime=runtime, stream_logs=False)
        assert _gone(launcher, JOB_RUNTIME_PLURAL)
        # a runtime a previous run of the same job left behind is updated, not refused
        stale = {**runtime, "spec": {**runtime["spec"], "mlPolicy": {"numNodes": 9, "torch": {}}}}
        launcher.jobs.create_namespaced_custom_object(*path, stale)
        launcher.create_runtime(runtime)
        current = launcher.jobs.get_namespaced_custom_object(*path, NAME)
        assert current["spec"] == runtime["spec"]
        assert launcher.delete(NAME) and _gone(launcher, JOB_RUNTIME_PLURAL)
