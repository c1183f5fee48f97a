"""What a namespace needs before a pipeline run launches training jobs there, as manifests, and
applying them (``lingo cluster setup``).

- the **ClusterTrainingRuntime** TrainJobs reference (``cluster.trainjob.build_training_runtime``;
  cluster-scoped, so creating it takes a cluster admin: without that right the rest is still
  set up and the runtime is reported as left to one);
- a **Role** with what the training steps need (``cluster.access.job_role_rules``) and a
  **RoleBinding** of it to the pipeline's service account (Data Science Pipelines names it
  ``pipeline-runner-<DSPA name>``; its own role grants nothing in ``trainer.kubeflow.org``);
- the **workspace PVC** (ReadWriteMany) the steps and jobs share, only when it is missing (an
  existing claim is never changed);
- a **Secret** for each of the platform's Secrets whose variables are set in this environment
  (S3, MLflow, Hugging Face): they are optional in the pipeline, so only what a run uses is
  needed.

The manifests are plain dicts in the shape the API server takes; ``tests/cluster`` validates
them against the Kubernetes 1.33 JSON schemas.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.access import job_role_rules

log = logging.getLogger(__name__)

ROLE_NAME = "lingo-rl-jobs"
DEFAULT_SERVICE_ACCOUNT = "pipeline-runner-dspa"
"""The service account of a Data Science Pipelines server named ``dspa`` (OpenShift AI's
default name; DSPO's ``sa_pipeline-runner.yaml.tmpl``: ``pipeline-runner-{{.Name}}``)."""
PART_OF = {"app.kubernetes.io/part-of": "lingo-rl"}
RBAC_API = "rbac.authorization.k8s.io"


@dataclass(frozen=True)
class SecretSource:
    """A platform Secret and the environment variables its keys come from."""

    name: str
    key_to_env: Mapping[str, str]
    steps: tuple[str, ...] | None = None


@dataclass
class SetupPlan:
    """What ``lingo cluster setup`` creates in ``namespace``.

    Attributes:
        runtime: the ClusterTrainingRuntime, or None to leave it (``--skip-runtime``).
        namespaced: the Role, RoleBinding, PVC and Secrets, in the order they are created.
        skipped: one line per platform Secret not created, and why.
    """

    namespace: str
    runtime: dict | None
    namespaced: list[dict]
    skipped: list[str] = field(default_factory=list)

    def manifests(self) -> list[dict]:
        """Everything, the runtime first."""
        return ([self.runtime] if self.runtime else []) + self.namespaced


def job_role(namespace: str) -> dict:
    """The Role the pipeline's service account needs to run the training steps as jobs."""
    return {
        "apiVersion": f"{RBAC_API}/v1",
        "kind": "Role",
        "metadata": {"name": ROLE_NAME, "namespace": namespace, "labels": dict(PART_OF)},
        "rules": job_role_rules(),
    }


def job_role_binding(namespace: str, service_account: str) -> dict:
    """``job_role`` bound to ``service_account`` of ``namespace``."""
    return {
        "apiVersion": f"{RBAC_API}/v1",
        "kind": "RoleBinding",
        "metadata": {"name": ROLE_NAME, "namespace": namespace, "labels": dict(PART_OF)},
        "roleRef": {"apiGroup": RBAC_API, "kind": "Role", "name": ROLE_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }


def workspace_claim(namespace: str, name: str, size: str, storage_class: str | None) -> dict:
    """The ReadWriteMany PVC the steps and their jobs share (weights, checkpoints, metrics)."""
    spec: dict = {
        "accessModes": ["ReadWriteMany"],
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": size}},
    }
    if storage_class:
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(PART_OF)},
        "spec": spec,
    }


DATA_CONNECTION_NAMES = {"AWS_ENDPOINT_URL": "AWS_S3_ENDPOINT"}
"""Our variable → the name an OpenShift AI data connection gives the same value."""


def secret(namespace: str, name: str, values: Mapping[str, str]) -> dict:
    """An Opaque Secret of ``values`` (key → value)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(PART_OF)},
        "stringData": dict(values),
    }


def secrets_from_env(
    namespace: str, sources: list[SecretSource], environ: Mapping[str, str]
) -> tuple[list[dict], list[str]]:
    """A Secret for each source with at least one of its variables set in ``environ`` (only
    the keys whose variable is set); and one line for each source left out.

    An OpenShift AI data connection names the endpoint ``AWS_S3_ENDPOINT`` (and the region
    ``AWS_DEFAULT_REGION``); boto3 and the pipeline read ``AWS_ENDPOINT_URL``: run from a
    workbench with a data connection attached, the S3 Secret gets the connection's endpoint
    under the name the pipeline reads."""
    environ = dict(environ)
    for ours, theirs in DATA_CONNECTION_NAMES.items():
        if not environ.get(ours) and environ.get(theirs):
            environ[ours] = environ[theirs]
    made, skipped = [], []
    for source in sources:
        values = {key: environ[env] for key, env in source.key_to_env.items() if environ.get(env)}
        if values:
            made.append(secret(namespace, source.name, values))
            continue
        steps = ", ".join(source.steps) if source.steps else "every step"
        variables = ", ".join(sorted(set(source.key_to_env.values())))
        skipped.append(
            f"Secret {source.name}: not created ({variables} not set here); optional for "
            f"{steps}: a step that needs it fails naming it"
        )
    return made, skipped


def setup_plan(
    namespace: str,
    service_account: str,
    runtime: dict | None,
    workspace: tuple[str, str, str | None] | None,
    secret_sources: list[SecretSource],
    environ: Mapping[str, str],
) -> SetupPlan:
    """What ``lingo cluster setup`` creates.

    Args:
        namespace: where the pipeline runs and its jobs live.
        service_account: the pipeline's service account (its pods' identity).
        runtime: the ClusterTrainingRuntime, or None to leave it out.
        workspace: the workspace PVC's ``(name, size, storage class)``, or None (the
            platform has no workspace volume).
        secret_sources: the platform's Secrets.
        environ: where the Secrets' values are read (``os.environ``).
    """
    namespaced = [job_role(namespace), job_role_binding(namespace, service_account)]
    if workspace is not None:
        namespaced.append(workspace_claim(namespace, *workspace))
    secrets, skipped = secrets_from_env(namespace, secret_sources, environ)
    return SetupPlan(namespace, runtime, namespaced + secrets, skipped)


def describe_secret(manifest: dict) -> str:
    """A Secret as a comment line (its name and keys; never its values)."""
    keys = ", ".join(sorted(manifest["stringData"]))
    return (
        f"# Secret {manifest['metadata']['name']} (keys {keys}) is created from this "
        "environment by `lingo cluster setup`; its values are never printed"
    )


def apply_plan(plan: SetupPlan, api_client) -> tuple[list[str], list[str]]:
    """Create (or update) what ``plan`` holds; returns the lines done and the lines failed.

    The Role, RoleBinding and Secrets are created or updated (a JSON merge patch: the Role's
    rules and the binding's subjects are replaced, a Secret's keys merged); the PVC is created
    only when missing; the runtime is created or merge-patched (``install_training_runtime``). A 403
    on one object is reported and the rest still applied.
    """
    from kubernetes import client as k8s

    from cluster.launcher import install_training_runtime

    done, failed = [], []
    if plan.runtime is not None:
        name = plan.runtime["metadata"]["name"]
        try:
            done.append(f"{install_training_runtime(plan.runtime, api_client)} "
                        f"ClusterTrainingRuntime {name}")  # fmt: skip
        except k8s.ApiException as error:
            if error.status != 403:
                raise
            failed.append(
                f"ClusterTrainingRuntime {name}: not installed (403: creating it takes a "
                "cluster admin; one runs `lingo cluster install-runtime`)"
            )
    rbac, core = k8s.RbacAuthorizationV1Api(api_client), k8s.CoreV1Api(api_client)
    writers = {
        "Role": (rbac.create_namespaced_role, rbac.patch_namespaced_role),
        "RoleBinding": (rbac.create_namespaced_role_binding, rbac.patch_namespaced_role_binding),
        "Secret": (core.create_namespaced_secret, core.patch_namespaced_secret),
    }
    for manifest in plan.namespaced:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        what = f"{kind} {plan.namespace}/{name}"
        try:
            if kind == "PersistentVolumeClaim":
                line, usable = _claim(core, plan.namespace, manifest)
                (done if usable else failed).append(line)
                continue
            create, update = writers[kind]
            try:
                create(plan.namespace, manifest)
                done.append(f"created {what}")
            except k8s.ApiException as error:
                if error.status != 409:
                    raise
                update(name, plan.namespace, manifest)
                done.append(f"updated {what}")
        except k8s.ApiException as error:
            if error.status != 403:
                raise
            failed.append(f"{what}: not created (403: {error.reason}; a namespace admin's)")
    return done, failed


def _claim(core, namespace: str, manifest: dict) -> tuple[str, bool]:
    """Create the workspace PVC if missing; ``(line, usable)``: an existing claim is kept
    as it is, and is not usable when it is not ReadWriteMany (the jobs' pods share it)."""
    from kubernetes import client as k8s

    name = manifest["metadata"]["name"]
    try:
        existing = core.read_namespaced_persistent_volume_claim(name, namespace)
    except k8s.ApiException as error:
        if error.status != 404:
            raise
        core.create_namespaced_persistent_volume_claim(namespace, manifest)
        return f"created PersistentVolumeClaim {namespace}/{name}", True
    modes = (existing.spec and existing.spec.access_modes) or []
    if "ReadWriteMany" in modes:
        return f"kept PersistentVolumeClaim {namespace}/{name} (it exists)", True
    return (
        f"PersistentVolumeClaim {namespace}/{name} exists with access modes {modes}: the "
        "steps and their jobs' pods share it, which takes ReadWriteMany; delete it or set "
        "the platform's workspace_pvc to a ReadWriteMany claim",
        False,
    )
