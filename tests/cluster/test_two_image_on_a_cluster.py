"""On a real cluster (``pytest -m cluster``): a two-image job of one training node in the
Megatron image and one rollout-only node in the GPU image meets in one gloo group, as a
TrainJob with its own TrainingRuntime and as a PyTorchJob.

Needs a kubeconfig whose context may create TrainJobs, TrainingRuntimes and PyTorchJobs in
``LINGO_TEST_NAMESPACE`` (default ``default``), the images as ``LINGO_MEGATRON_IMAGE`` and
``LINGO_GPU_IMAGE`` name them (``components.images``), and a ReadWriteMany PVC
``LINGO_TEST_PVC`` (default ``lingo-rl-shared``). The pods run on CPU (no GPU requested). The
entry is replaced by a one-line gloo all-reduce (``torchrun --no-python python -c …``), so no
staged inputs are needed; everything else is the manifest the step builds.
"""

from __future__ import annotations

import os
import uuid

import pytest

from cluster.config import ClusterJobConfig
from cluster.jobs import PYTORCHJOB, TRAINJOB
from cluster.launcher import JobLauncher
from cluster.pytorchjob import build_pytorchjob
from cluster.trainjob import build_job_runtime, build_trainjob
from components.images import GPU_IMAGE, MEGATRON_IMAGE

pytestmark = pytest.mark.cluster

ALL_REDUCE = (
    "import torch, torch.distributed as d; d.init_process_group('gloo'); t = torch.ones(1); "
    "d.all_reduce(t); assert int(t) == d.get_world_size() == 2, t; print('rank', d.get_rank())"
)
ENTRY = ["--no-python", "python", "-c", ALL_REDUCE]


def _with_entry(command: list[str]) -> list[str]:
    """The command with its torchrun entry (``-m module args…``) replaced by ``ENTRY``."""
    return [*command[: command.index("-m", 3)], *ENTRY]


def _cluster() -> ClusterJobConfig:
    return ClusterJobConfig(
        image=MEGATRON_IMAGE,
        rollout_image=GPU_IMAGE,
        nodes=2,
        rollout_nodes=1,
        namespace=os.environ.get("LINGO_TEST_NAMESPACE", "default"),
        shared_pvc=os.environ.get("LINGO_TEST_PVC", "lingo-rl-shared"),
        cpu="1",
        memory="4Gi",
        shm_size="1Gi",
        progress_tracking=False,
    )


@pytest.mark.parametrize("kind", [TRAINJOB, PYTORCHJOB], ids=lambda kind: kind.api)
def test_a_two_image_job_meets_in_one_group(kind):
    cluster = _cluster()
    name = f"lingo-two-image-{uuid.uuid4().hex[:8]}"
    launcher = JobLauncher(cluster.namespace, kind=kind)
    runtime = None
    if kind is TRAINJOB:
        manifest = build_trainjob(name, cluster, "unused", [])
        trainer = manifest["spec"]["trainer"]
        trainer["command"] = _with_entry(trainer["command"])
        runtime = build_job_runtime(name, cluster, "unused", [])
        rollout = runtime["spec"]["template"]["spec"]["replicatedJobs"][1]
        container = rollout["template"]["spec"]["template"]["spec"]["containers"][0]
        command = container["command"]
        container["command"] = [*command[: command.index("--") + 1], *ENTRY]
    else:
        manifest = build_pytorchjob(name, cluster, "unused", [])
        for spec in manifest["spec"]["pytorchReplicaSpecs"].values():
            for container in spec["template"]["spec"]["containers"]:
                container["command"] = _with_entry(container["command"])
    try:
        launcher.run(manifest, timeout_s=900, poll_s=5, runtime=runtime)
    finally:
        launcher.delete(name)
    if kind is TRAINJOB:
        assert not launcher.delete_runtime(name)  # deleted with the job
