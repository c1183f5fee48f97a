"""Which pod OpenShift AI polls for a TrainJob's progress, for the two-image GRPO job (trainer
pods of the ``node`` job beside rollout pods of the ``rollout`` job).

The rule, transcribed from opendatahub-io/trainer (commit d140e85, 2026-08-20)
``pkg/rhai/progression/progression.go``:

- ``GetPrimaryPod`` (lines 110-207): for each label set in order (lines 115-142; the first is
  ``jobset.sigs.k8s.io/jobset-name: <job>``, ``jobset.sigs.k8s.io/job-index: "0"``,
  ``batch.kubernetes.io/job-completion-index: "0"``, the second the JobSet name alone) list
  the pods (lines 147-152) and return the first that is Running, has an IP and is Ready
  (lines 155-159);
- ``PollAndUpdateFinalProgress`` (lines 549-576): after the job ends, the first pod of the
  JobSet labelled ``jobset.sigs.k8s.io/job-index: "0"``, whatever its phase (its termination
  message holds the final progress).

The API server lists a namespace's pods in key order, by name. Both the trainers' first pod
and the rollout job's first pod carry job index 0 and completion index 0 (every replicated job
has one Job, ``replicas: 1``, and JobSet makes it an Indexed Job), so the rule picks the
trainer only because its pods sort first: ``cluster.trainjob.sorts_after_trainers``, which
``build_job_runtime`` enforces. These tests expand the job into the JobSet the Trainer makes
(``kube_emulator.trainer_jobset``) and into its pods as JobSet names and labels them, then
apply the rule.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kube_emulator import trainer_jobset
from tests_helpers_cluster import DEDICATED_GRPO

import cluster.trainjob
from cluster.config import ClusterJobConfig, ExecutionConfig
from cluster.jobs import TRAINJOB
from cluster.step_job import StepJob, build_step_manifest, build_step_runtime, step_cluster
from cluster.trainjob import NODE, build_job_runtime
from components.images import GPU_IMAGE, MEGATRON_IMAGE
from trainer.grpo.config import GRPOConfig

NAMESPACE = "team"
RUN_ID = "3f1c2a9e-5b7d-4e0f-9a31-0c6f2d8e4b17"
JOBSET = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"


def odh_primary_pod(pods: list[dict], job: str) -> dict | None:
    """``GetPrimaryPod``'s choice among ``pods`` (the first two label sets: the others are
    Training Operator v1's, which a JobSet's pods never carry)."""
    listed = sorted(pods, key=lambda pod: pod["name"])  # the API server's order
    for wanted in ({JOBSET: job, JOB_INDEX: "0", COMPLETION_INDEX: "0"}, {JOBSET: job}):
        for pod in listed:
            if wanted.items() <= pod["labels"].items() and pod["running_ready_ip"]:
                return pod
    return None


def odh_final_pod(pods: list[dict], job: str) -> dict | None:
    """``PollAndUpdateFinalProgress``'s choice: the first listed pod of job index 0."""
    listed = sorted((p for p in pods if p["labels"].get(JOBSET) == job), key=lambda p: p["name"])
    return next((pod for pod in listed if pod["labels"].get(JOB_INDEX) == "0"), None)


def jobset_pods(jobset: dict, suffix) -> list[dict]:
    """The JobSet's pods as JobSet and the Job controller name and label them: ``<jobset>-
    <replicated job>-<job index>-<completion index>-<random suffix>``."""
    name = jobset["metadata"]["name"]
    pods = []
    for replicated in jobset["spec"]["replicatedJobs"]:
        for job_index in range(replicated.get("replicas", 1)):
            for index in range(replicated["template"]["spec"]["parallelism"]):
                labels = {
                    JOBSET: name,
                    REPLICATED_JOB: replicated["name"],
                    JOB_INDEX: str(job_index),
                    COMPLETION_INDEX: str(index),  # JobSet defaults Jobs to Indexed
                }
                prefix = f"{name}-{replicated['name']}-{job_index}-{index}"
                pods.append({"name": f"{prefix}-{suffix()}", "labels": labels})
    return pods


def _two_image_jobset(run_id: str = RUN_ID) -> dict:
    config = GRPOConfig.model_validate(DEDICATED_GRPO)
    job = StepJob("grpo", "trainer.grpo", config, "sft-model", "m", "t", "e")
    execution = ExecutionConfig(
        mode="job", reference="g5.12xlarge", job={"nodes": 6, "namespace": NAMESPACE}
    )
    cluster = step_cluster(execution, MEGATRON_IMAGE, NAMESPACE, GPU_IMAGE)
    args = ["--config", "/mnt/shared/grpo_config.json"]
    trainjob = build_step_manifest(job, cluster, run_id, args, TRAINJOB)
    runtime = build_step_runtime(job, cluster, run_id, args, TRAINJOB)
    return trainer_jobset(trainjob, runtime)


def _is_trainer_rank_0(pod: dict) -> bool:
    return pod["labels"][REPLICATED_JOB] == NODE and pod["labels"][COMPLETION_INDEX] == "0"


@settings(max_examples=200, deadline=None)
@given(
    run_id=st.uuids().map(str),
    seed=st.integers(0, 2**32 - 1),
    others_ready=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_the_rule_picks_the_trainer_whatever_the_names_and_the_other_pods(
    run_id, seed, others_ready
):
    """Any run id (so any job name), any pods' random suffixes, any list order, any of the
    other pods running or not: while the trainers' rank 0 is running and ready the progress
    is polled there, and the final progress is read from it."""
    rng = random.Random(seed)
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # what the Job controller's suffixes use
    pods = jobset_pods(_two_image_jobset(run_id), lambda: "".join(rng.choices(alphabet, k=5)))
    assert sorted(p["labels"][REPLICATED_JOB] for p in pods) == ["node"] * 4 + ["rollout"] * 2
    others = [pod for pod in pods if not _is_trainer_rank_0(pod)]
    for pod, ready in zip(others, others_ready, strict=True):
        pod["running_ready_ip"] = ready
    (trainer,) = [pod for pod in pods if _is_trainer_rank_0(pod)]
    trainer["running_ready_ip"] = True
    rng.shuffle(pods)
    job = pods[0]["labels"][JOBSET]
    assert odh_primary_pod(pods, job) is trainer
    assert odh_final_pod(pods, job) is trainer
    # both first pods match the first label set: only the name order separates them
    first_set = [p for p in pods if p["labels"][JOB_INDEX] == p["labels"][COMPLETION_INDEX] == "0"]
    assert sorted(p["labels"][REPLICATED_JOB] for p in first_set) == ["node", "rollout"]


def test_a_replicated_job_that_would_sort_first_is_refused(monkeypatch):
    """The reproduction: named ``launch`` (before ``node``), the rollout job's first pod is the
    one the rule polls; the runtime builder refuses such a name."""
    monkeypatch.setattr(cluster.trainjob, "ROLLOUT", "launch")
    pods = jobset_pods(
        {
            "metadata": {"name": "lingo-grpo-x"},
            "spec": {
                "replicatedJobs": [
                    {"name": "node", "template": {"spec": {"parallelism": 4}}},
                    {"name": "launch", "template": {"spec": {"parallelism": 2}}},
                ]
            },
        },
        lambda: "abcde",
    )
    for pod in pods:
        pod["running_ready_ip"] = True
    assert odh_primary_pod(pods, "lingo-grpo-x")["labels"][REPLICATED_JOB] == "launch"
    cluster_config = ClusterJobConfig(
        image=MEGATRON_IMAGE, rollout_image=GPU_IMAGE, nodes=6, gpus_per_node=4, rollout_nodes=2
    )
    with pytest.raises(ValueError, match="'launch': its first pod would sort before the trainers"):
        build_job_runtime("lingo-grpo-x", cluster_config, "trainer.grpo", [])


@pytest.mark.parametrize(
    ("name", "after"),
    [("rollout", True), ("node0", True), ("a", False), ("node-0", False), ("node--x", False)],
)
def test_sorts_after_trainers(name, after):
    assert cluster.trainjob.sorts_after_trainers(name) is after


def test_before_the_trainer_is_ready_the_rule_may_pick_a_rollout_pod():
    """What names cannot settle: while the trainers' rank 0 is not yet ready (a bigger image
    to pull) and a rollout pod is, the rule polls the rollout pod. Nothing listens there (only
    global rank 0 serves progress), so the poll fails and the controller polls again at the
    next interval; no progress is shown from the wrong pod."""
    pods = jobset_pods(_two_image_jobset(), lambda: "abcde")
    for pod in pods:
        pod["running_ready_ip"] = pod["labels"][REPLICATED_JOB] == "rollout"
    picked = odh_primary_pod(pods, pods[0]["labels"][JOBSET])
    assert picked["labels"][REPLICATED_JOB] == "rollout"
