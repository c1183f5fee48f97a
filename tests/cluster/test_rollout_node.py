"""The rollout-only pods' entry point (``cluster.rollout_node``): its torchrun command line for
each pod of the ``rollout`` replicated job, its errors, and, for real, a rendezvous of a
training pod's command (as the TrainJob builds it, with the ``PET_*`` the Trainer's torch
plugin sets) and a rollout pod's command (as the job's TrainingRuntime builds it) into one
gloo group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import ClusterJobConfig
from cluster.rollout_node import RolloutLayout, RolloutNodeError, completion_index, parse
from cluster.trainjob import ROLLOUT, build_job_runtime, build_trainjob, master_addr

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ["-m", "trainer.grpo", "--config", "/mnt/shared/j/grpo_config.json"]


@pytest.mark.parametrize("index", [0, 1])
def test_each_rollout_pod_is_a_node_rank_after_the_training_nodes(index):
    """4 training nodes + 2 rollout-only nodes of 4 processes (gpt-oss-20b's GRPO job)."""
    addr = "lingo-grpo-run-node-0-0.lingo-grpo-run"
    assert RolloutLayout(4, 2, 4, addr, 29500).torchrun_argv(index, ENTRY) == [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=6", f"--node_rank={4 + index}", "--nproc_per_node=4",
        f"--master_addr={addr}", "--master_port=29500",
        "-m", "trainer.grpo", "--config", "/mnt/shared/j/grpo_config.json",
    ]  # fmt: skip


def test_the_container_command_parses_back_into_the_same_layout():
    layout = RolloutLayout(4, 2, 4, "addr", 29500)
    command = layout.command(ENTRY)
    assert command[:3] == ["python", "-m", "cluster.rollout_node"]
    assert parse(command[3:]) == (layout, ENTRY)


def test_what_cannot_place_the_pod_is_refused_with_the_fix():
    with pytest.raises(RolloutNodeError, match=r"JOB_COMPLETION_INDEX=2 is outside 0\.\.1"):
        RolloutLayout(4, 2, 4, "addr", 29500).torchrun_argv(2, ENTRY)
    with pytest.raises(RolloutNodeError, match="JOB_COMPLETION_INDEX=None: .*Indexed Job"):
        completion_index({})
    with pytest.raises(RolloutNodeError, match="JOB_COMPLETION_INDEX='-1'"):
        completion_index({"JOB_COMPLETION_INDEX": "-1"})
    assert completion_index({"JOB_COMPLETION_INDEX": "1"}) == 1
    with pytest.raises(RolloutNodeError, match="end the arguments with `-- -m"):
        parse(["--training-nodes", "1"])
    with pytest.raises(SystemExit):  # argparse: a count of 0
        parse(["--training-nodes", "0", "--rollout-nodes", "1", "--nproc-per-node", "1",
               "--master-addr", "a", "--master-port", "1", "--", "-m", "x"])  # fmt: skip


def test_the_module_exits_with_one_line_outside_an_indexed_job():
    command = RolloutLayout(1, 1, 1, "127.0.0.1", 29500).command(["-m", "x"])
    env = {k: v for k, v in os.environ.items() if k != "JOB_COMPLETION_INDEX"}
    done = subprocess.run(
        [sys.executable, *command[1:]], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "cluster.rollout_node: JOB_COMPLETION_INDEX=None: cluster.rollout_node runs in a pod of "
        "an Indexed Job (a two-image TrainJob's 'rollout' replicated job), which sets it"
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_training_pod_and_a_rollout_pod_meet_in_one_group(tmp_path):
    """One training node and one rollout-only node, one process each: the training pod runs
    the TrainJob's command with the ``PET_*`` the torch plugin sets (``PET_NNODES=1``: it
    counts only the ``node`` pods, which ``--nnodes=2`` overrides), the rollout pod runs the
    runtime's command with ``JOB_COMPLETION_INDEX=0``. The pods' DNS name and the plugin's
    fixed port 29500 are replaced by 127.0.0.1 and a free port (no cluster DNS here)."""
    cluster = ClusterJobConfig(
        image="megatron:1", rollout_image="gpu:1", nodes=2, rollout_nodes=1, namespace="team"
    )
    name, module, args = "lingo-grpo-run", "rank_probe", [str(tmp_path)]
    trainer = build_trainjob(name, cluster, module, args)["spec"]["trainer"]
    runtime = build_job_runtime(name, cluster, module, args)
    (rollout_job,) = [
        job for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]
        if job["name"] == ROLLOUT
    ]  # fmt: skip
    rollout = rollout_job["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    port = str(_free_port())
    assert rollout[rollout.index("--master-addr") + 1] == master_addr(name)
    assert rollout[rollout.index("--master-port") + 1] == "29500"
    rollout[rollout.index("--master-addr") + 1] = "127.0.0.1"
    rollout[rollout.index("--master-port") + 1] = port
    base = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "cluster"), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
    }
    plugin_env = {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": port,
    }
    pods = [
        subprocess.Popen(
            [sys.executable, *trainer["command"][1:]], env={**base, **plugin_env, "POD": "node-0"}
        ),
        subprocess.Popen(
            [sys.executable, *rollout[1:]],
            env={**base, "JOB_COMPLETION_INDEX": "0", "POD": "rollout-0"},
            cwd=ROOT,
        ),
    ]
    try:
        codes = [pod.wait(timeout=120) for pod in pods]
    finally:
        for pod in pods:
            pod.kill()
    assert codes == [0, 0]
    seen = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")),
                  key=lambda s: s["rank"])  # fmt: skip
    assert [(s["rank"], s["node_rank"], s["pod"]) for s in seen] == [
        (0, 0, "node-0"),
        (1, 1, "rollout-0"),
    ]
    assert {(s["world"], s["rank_sum"]) for s in seen} == {(2, 1)}
