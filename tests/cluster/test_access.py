"""The access a training step needs, checked with SelfSubjectAccessReviews before it creates
anything (``cluster.access``), against DSPO's pipeline-runner role and the Role ``lingo
cluster setup`` grants.

No API server can run here: the reviews are answered by ``kube_emulator``'s own authorizer (an
emulator that says ``allowed: false`` for the triples a test denies), and the RBAC matching of
a Role's rules is ``cluster.access.grants`` (the authorizer's rule: ``*`` or the exact group,
resource and verb).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml
from kube_emulator import kube_emulator
from tests_helpers_cluster import DEDICATED_GRPO

from cluster.access import (
    Access,
    AccessDenied,
    check_access,
    grants,
    identity,
    job_role_rules,
    step_access,
)
from cluster.config import ExecutionConfig
from cluster.jobs import JOB_RUNTIME_PLURAL, PYTORCHJOB, TRAINJOB
from cluster.launcher import JobLauncher
from cluster.step_job import StepJob, run_step_job
from components.images import GPU_IMAGE, MEGATRON_IMAGE
from trainer.grpo.config import GRPOConfig

NAMESPACE = "team"
RUN_ID = "3f1c2a9e-5b7d-4e0f-9a31-0c6f2d8e4b17"
DSPO_ROLE = Path(__file__).parent / "fixtures" / "dspo_role_pipeline-runner.yaml"


def _dspo_rules() -> list[dict]:
    return yaml.safe_load(DSPO_ROLE.read_text())["rules"]


def test_dspo_pipeline_runner_role_grants_pytorchjobs_but_no_trainjob():
    """The reason for the check: DSPO's role (copied in fixtures/) lets a step create a
    PyTorchJob, but neither a TrainJob nor a two-image job's TrainingRuntime."""
    rules = _dspo_rules()
    assert all(grants(rules, need) for need in step_access(PYTORCHJOB))
    denied = [n for n in step_access(TRAINJOB, own_runtime=True) if not grants(rules, n)]
    assert {(n.verb, n.resource) for n in denied} == {
        *((verb, "trainjobs") for verb in ("create", "get", "list", "delete")),
        *((verb, "trainingruntimes") for verb in ("create", "get", "patch", "delete")),
    }


@pytest.mark.parametrize(
    ("kind", "own_runtime"), [(TRAINJOB, False), (TRAINJOB, True), (PYTORCHJOB, False)]
)
def test_the_setup_role_grants_everything_each_step_needs(kind, own_runtime):
    assert all(grants(job_role_rules(), need) for need in step_access(kind, own_runtime))


def test_what_a_step_needs():
    assert [n.what for n in step_access(TRAINJOB, own_runtime=True)] == [
        *["trainjobs.trainer.kubeflow.org"] * 4,
        *["trainingruntimes.trainer.kubeflow.org"] * 4,
        "pods",
        "pods/log",
    ]
    assert {n.verb for n in step_access(PYTORCHJOB) if n.group == "kubeflow.org"} == {
        "create", "get", "list", "delete"
    }  # fmt: skip


def test_grants_matches_like_the_authorizer():
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    assert grants(rules, Access("list", "", "pods"))
    assert not grants(rules, Access("get", "", "pods", "log"))  # a subresource is its own
    assert not grants(rules, Access("list", "apps", "pods"))
    assert grants([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}], Access("x", "y", "z"))


def test_a_denial_is_one_line_naming_verb_resource_and_identity(tmp_path):
    claims = {"sub": "system:serviceaccount:team:pipeline-runner-dspa"}
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    token = tmp_path / "token"
    token.write_text(f"e30.{payload}.sig")
    assert identity(token) == "system:serviceaccount:team:pipeline-runner-dspa"
    assert identity(tmp_path / "absent") == "the kubeconfig's user"
    denied = [("create", "trainer.kubeflow.org", "trainjobs"), ("get", "", "pods/log")]
    with kube_emulator(namespace=NAMESPACE, denied={denied[0]}) as api_client:
        check_access(api_client, NAMESPACE, step_access(PYTORCHJOB))  # nothing it needs
    with (
        kube_emulator(namespace=NAMESPACE, denied=set(denied)) as api_client,
        pytest.raises(AccessDenied) as caught,
    ):
        check_access(api_client, NAMESPACE, step_access(TRAINJOB))
    message = str(caught.value)
    assert "\n" not in message
    assert "may not create trainjobs.trainer.kubeflow.org, get pods/log in namespace team" in (
        message
    )
    assert "lingo cluster setup --namespace team" in message


@pytest.mark.parametrize(
    "denied",
    [("create", "trainer.kubeflow.org", "trainingruntimes"), ("list", "", "pods")],
    ids=["runtime", "pods"],
)
def test_a_two_image_step_stops_before_it_stages_or_creates_anything(tmp_path, denied):
    """GRPO with Megatron trainers beside vLLM engines creates its own TrainingRuntime: a
    service account that may not is told so before a file is staged or an object created."""
    job = StepJob(
        "grpo", "trainer.grpo", GRPOConfig.model_validate(DEDICATED_GRPO), "sft-model",
        tmp_path / "m", tmp_path / "t", None,
    )  # fmt: skip
    execution = ExecutionConfig(
        mode="job",
        reference="g5.12xlarge",
        job={"nodes": 6, "namespace": NAMESPACE, "job_api": "trainjob"},
        work_root=str(tmp_path / "shared"),
        timeout_s=5,  # without the check the step would stage, create and wait for the job
        poll_s=0.1,
    )
    with kube_emulator(namespace=NAMESPACE, denied={denied}) as api_client:
        launcher = JobLauncher(NAMESPACE, api_client, TRAINJOB)
        with pytest.raises(AccessDenied, match=f"may not {denied[0]} {denied[2]}"):
            run_step_job(
                job, execution, RUN_ID, tmp_path / "model", tmp_path / "work",
                tmp_path / "job.yaml", MEGATRON_IMAGE, launcher, rollout_image=GPU_IMAGE,
            )  # fmt: skip
        path = (TRAINJOB.group, TRAINJOB.version, NAMESPACE)
        for plural in (TRAINJOB.plural, JOB_RUNTIME_PLURAL):
            assert not launcher.jobs.list_namespaced_custom_object(*path, plural)["items"]
    assert not (tmp_path / "shared").exists()
    assert not (tmp_path / "job.yaml").exists()
