"""``lingo cluster setup``: the manifests it prints are what an API server accepts (the
ClusterTrainingRuntime against its CRD, the Role, RoleBinding, PVC and Secrets against the
Kubernetes 1.33 JSON schemas, the ``kubernetes`` client's models and the kinds' own rules,
``crd_rules``); applied to ``kmock``'s in-memory emulator (no API server can run here; it
validates nothing itself) it creates them, keeps an existing PVC and names one that cannot be
shared; without a kubeconfig each ``lingo cluster`` command says so in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from crd_rules import api_server_errors, core_api_errors
from kube_emulator import kube_emulator
from kubernetes import client as k8s
from typer.testing import CliRunner

import cluster.launcher
from cluster.access import grants, step_access
from cluster.jobs import PYTORCHJOB, TRAINJOB
from cluster.setup import (
    ROLE_NAME,
    SecretSource,
    job_role,
    job_role_binding,
    secret,
    setup_plan,
    workspace_claim,
)
from pipelines.cli import app
from pipelines.platform import DEFAULT_SECRETS

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "team"
SECRET_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY000000",
    "AWS_SECRET_ACCESS_KEY": "s3-secret-value-not-to-print",
    "HF_TOKEN": "hf_secretvaluenottoprint0000",
}
runner = CliRunner()


def _no_secret_env(monkeypatch) -> None:
    for source in DEFAULT_SECRETS:
        for env in source.key_to_env.values():
            monkeypatch.delenv(env, raising=False)


def _documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_dry_run_prints_manifests_the_api_server_accepts(monkeypatch):
    _no_secret_env(monkeypatch)
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    result = runner.invoke(app, ["cluster", "setup", "--dry-run", "--namespace", NAMESPACE])
    assert result.exit_code == 0, result.output
    documents = _documents(result.output)
    assert [d["kind"] for d in documents] == [
        "ClusterTrainingRuntime", "Role", "RoleBinding", "PersistentVolumeClaim"
    ]  # fmt: skip
    assert api_server_errors(documents[0]) == []
    for document in documents[1:]:
        assert core_api_errors(document) == [], document["kind"]
        assert document["metadata"]["namespace"] == NAMESPACE
    binding = documents[2]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pipeline-runner-dspa", "namespace": NAMESPACE}
    ]
    claim = documents[3]
    assert claim["metadata"]["name"] == "lingo-workspace"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # Secrets are named (only those whose variables are set), never printed
    assert "# Secret lingo-s3 (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)" in result.output
    assert "# Secret lingo-hf (keys HF_TOKEN)" in result.output
    assert "# Secret lingo-mlflow: not created (MLFLOW_TRACKING_TOKEN" in result.output
    assert all(value not in result.output for value in SECRET_ENV.values())


def test_the_manifests_of_every_option_are_accepted():
    sources = [SecretSource(s.secret_name, s.key_to_env, s.steps) for s in DEFAULT_SECRETS]
    environ = {env: "v" for s in DEFAULT_SECRETS for env in s.key_to_env.values()}
    plan = setup_plan(
        NAMESPACE, "pipeline-runner-x", None, ("ws", "2Ti", "ocs-cephfs"), sources, environ
    )
    assert [m["kind"] for m in plan.namespaced] == [
        "Role", "RoleBinding", "PersistentVolumeClaim", "Secret", "Secret", "Secret"
    ]  # fmt: skip
    assert plan.skipped == []
    for manifest in plan.namespaced:
        assert core_api_errors(manifest) == [], manifest
    assert plan.namespaced[2]["spec"]["storageClassName"] == "ocs-cephfs"
    assert set(plan.namespaced[3]["stringData"]) == {
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("manifest", "error"),
    [
        ({**job_role("t"), "rules": [{"apiGroups": [""], "resources": ["pods"]}]}, "verbs"),
        ({**job_role("t"), "rules": [{"resources": ["pods"], "verbs": ["get"]}]}, "apiGroups"),
        ({**job_role_binding("t", "sa"), "roleRef": {"kind": "Role", "name": "r"}}, "apiGroup"),
        ({**workspace_claim("t", "w", "1Gi", None), "spec": {"accessModes": []}}, "storage"),
        ({**secret("t", "s", {"k": "v"}), "stringdata": {}}, "stringdata"),
        ({**job_role("t"), "metadata": {"name": "Lingo_Jobs"}}, "DNS subdomain"),
    ],
    ids=["no-verbs", "no-groups", "no-ref-group", "no-storage", "unknown-field", "bad-name"],
)
def test_the_checks_refuse_what_the_server_refuses(manifest, error):
    assert any(error in line for line in core_api_errors(manifest))


def test_the_role_grants_what_each_step_checks_for():
    rules = job_role(NAMESPACE)["rules"]
    for kind, own_runtime in ((TRAINJOB, False), (TRAINJOB, True), (PYTORCHJOB, False)):
        assert all(grants(rules, need) for need in step_access(kind, own_runtime))


@pytest.fixture
def cluster_api(monkeypatch):
    with kube_emulator(namespace=NAMESPACE) as api_client:
        monkeypatch.setattr(cluster.launcher, "default_api_client", lambda: api_client)
        yield api_client


def test_setup_creates_then_updates_and_keeps_the_pvc(cluster_api, monkeypatch):
    _no_secret_env(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", SECRET_ENV["HF_TOKEN"])
    args = ["cluster", "setup", "--namespace", NAMESPACE, "--service-account", "runner"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert first.output.splitlines()[:5] == [
        "created ClusterTrainingRuntime lingo-rl",
        f"created Role {NAMESPACE}/{ROLE_NAME}",
        f"created RoleBinding {NAMESPACE}/{ROLE_NAME}",
        f"created PersistentVolumeClaim {NAMESPACE}/lingo-workspace",
        f"created Secret {NAMESPACE}/lingo-hf",
    ]
    assert SECRET_ENV["HF_TOKEN"] not in first.output
    core, rbac = k8s.CoreV1Api(cluster_api), k8s.RbacAuthorizationV1Api(cluster_api)
    stored = core.read_namespaced_secret("lingo-hf", NAMESPACE)
    assert (stored.string_data or {}).get("HF_TOKEN") == SECRET_ENV["HF_TOKEN"]
    binding = rbac.read_namespaced_role_binding(ROLE_NAME, NAMESPACE)
    assert [(s.kind, s.name) for s in binding.subjects] == [("ServiceAccount", "runner")]
    with pytest.raises(k8s.ApiException):
        core.read_namespaced_secret("lingo-s3", NAMESPACE)  # its variables are not set here
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    assert "updated ClusterTrainingRuntime lingo-rl" in second.output
    assert f"updated Role {NAMESPACE}/{ROLE_NAME}" in second.output
    assert f"kept PersistentVolumeClaim {NAMESPACE}/lingo-workspace (it exists)" in second.output


def test_a_workspace_pvc_that_cannot_be_shared_is_named(cluster_api, monkeypatch):
    _no_secret_env(monkeypatch)
    claim = workspace_claim(NAMESPACE, "lingo-workspace", "1Gi", None)
    claim["spec"]["accessModes"] = ["ReadWriteOnce"]
    k8s.CoreV1Api(cluster_api).create_namespaced_persistent_volume_claim(NAMESPACE, claim)
    result = runner.invoke(app, ["cluster", "setup", "--namespace", NAMESPACE, "--skip-runtime"])
    assert result.exit_code == 1
    assert "error: PersistentVolumeClaim team/lingo-workspace exists with access modes " in (
        result.output
    )
    assert "takes ReadWriteMany" in result.output
    assert "ClusterTrainingRuntime" not in result.output


@pytest.mark.parametrize(
    "args",
    [["cluster", "setup"], ["cluster", "install-runtime"]],
    ids=["setup", "install-runtime"],
)
def test_without_a_kubeconfig_it_is_one_line(tmp_path, args):
    """The 64-line traceback ``install-runtime`` printed before (a real process, with no
    kubeconfig and not in a pod)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(HOME=str(tmp_path), KUBECONFIG=str(tmp_path / "absent"))
    result = subprocess.run(
        [sys.executable, "-m", "pipelines", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no Kubernetes access: not in a pod, and no usable")
    assert "KUBECONFIG" in lines[0]


def test_a_step_that_needs_a_missing_secret_names_it():
    """The platform's Secrets are optional; the failures of a step that needed one name it
    (S3: ``core.storage``, tested against botocore in tests/core/test_storage.py; the hub)."""
    import httpx2
    from huggingface_hub.errors import GatedRepoError

    from core.errors import describe_error
    from core.storage import NO_CREDENTIALS

    names = {s.secret_name for s in DEFAULT_SECRETS}
    assert all(s.optional for s in DEFAULT_SECRETS)
    assert "lingo-s3" in names and "Secret lingo-s3" in NO_CREDENTIALS
    response = httpx2.Response(401, request=httpx2.Request("GET", "https://huggingface.co/x"))
    gated = GatedRepoError("401 Client Error. Cannot access gated repo", response=response)
    line = describe_error(gated)
    assert "lingo-hf" in names and "Secret lingo-hf" in line and "HF_TOKEN" in line


def test_a_workbench_data_connection_fills_the_s3_secret_under_the_pipelines_names():
    """OpenShift AI's data connection sets AWS_S3_ENDPOINT; the pipeline (boto3) reads
    AWS_ENDPOINT_URL: the S3 Secret made from a workbench's environment holds it there."""
    from cluster.setup import secrets_from_env

    sources = [SecretSource(s.secret_name, s.key_to_env, s.steps) for s in DEFAULT_SECRETS]
    environ = {
        "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "key",
        "AWS_S3_ENDPOINT": "https://minio.example:9000",
    }
    made, _ = secrets_from_env(NAMESPACE, sources, environ)
    (s3,) = [m for m in made if m["metadata"]["name"] == "lingo-s3"]
    endpoint_keys = [
        k for k, env in DEFAULT_SECRETS[0].key_to_env.items() if env == "AWS_ENDPOINT_URL"
    ]
    assert [s3["stringData"][k] for k in endpoint_keys] == ["https://minio.example:9000"]
    explicit = {**environ, "AWS_ENDPOINT_URL": "https://s3.other:443"}
    made, _ = secrets_from_env(NAMESPACE, sources, explicit)
    (s3,) = [m for m in made if m["metadata"]["name"] == "lingo-s3"]
    assert [s3["stringData"][k] for k in endpoint_keys] == ["https://s3.other:443"]
