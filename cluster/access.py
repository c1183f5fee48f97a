"""The Kubernetes access a training step needs, checked before it creates anything.

A step that launches a job talks to the API server as its pod's service account (on OpenShift
AI's Data Science Pipelines: ``pipeline-runner-<DSPA name>``). DSPO's role for that account
(``config/internal/apiserver/default/role_pipeline-runner.yaml.tmpl``) grants ``kubeflow.org``
resources (PyTorchJobs) but nothing in ``trainer.kubeflow.org``, so a TrainJob (and a two-image
job's own TrainingRuntime) would be refused with HTTP 403 after the step had staged its
inputs. ``check_access`` asks the API server first, one ``SelfSubjectAccessReview`` per verb
and resource the step needs (``step_access``), and fails with one line naming what is missing;
``lingo cluster setup`` creates the Role that grants it (``job_role_rules``). The ``deploy``
step, which applies the champion's KServe InferenceService, is checked the same way
(``DEPLOY_ACCESS``).
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from cluster.jobs import JOB_KINDS, JobKind

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class AccessDenied(RuntimeError):
    """The step's identity may not do something the step needs; the message names it."""


@dataclass(frozen=True)
class Access:
    """One verb on one resource (``group`` ``""``: the core API)."""

    verb: str
    group: str
    resource: str
    subresource: str = ""

    @property
    def what(self) -> str:
        """``trainjobs.trainer.kubeflow.org``, ``pods/log``: the resource as kubectl names it."""
        name = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{name}.{self.group}" if self.group else name


JOB_VERBS = ("create", "get", "list", "delete")
"""On the job itself: create it, follow it, find a run's jobs (exit handler, ``lingo status``),
delete it."""
RUNTIME_VERBS = ("create", "get", "patch", "delete")
"""On a two-image TrainJob's own TrainingRuntime (``JobLauncher.create_runtime``: a 409 is
answered with get and patch)."""
POD_ACCESS = (Access("list", "", "pods"), Access("get", "", "pods", "log"))
"""Rank 0's log and the pods' termination reasons (``JobLauncher.pods``, ``primary_logs``)."""
READ = ("get", "list", "watch")
SERVING_GROUP, SERVING_PLURAL = "serving.kserve.io", "inferenceservices"
DEPLOY_VERBS = ("create", "get", "patch")
"""On the champion's KServe InferenceService (``cluster.serving``): create it, read it (the
one there, its readiness), patch it to the next revision."""
DEPLOY_ACCESS = tuple(Access(verb, SERVING_GROUP, SERVING_PLURAL) for verb in DEPLOY_VERBS)
"""What the ``deploy`` step needs in the InferenceService's namespace."""


def step_access(kind: JobKind, own_runtime: bool = False) -> list[Access]:
    """What a step that runs a ``kind`` job needs in its namespace (``own_runtime``: a
    two-image TrainJob, which creates its own TrainingRuntime first).

    Reading the ClusterTrainingRuntime is not listed: it is cluster-scoped (a ClusterRole's
    business), and the step creates the job anyway when it may not read it
    (``cluster.step_job.require_runtime``).
    """
    needs = [Access(verb, kind.group, kind.plural) for verb in JOB_VERBS]
    if own_runtime:
        needs += [Access(verb, kind.group, kind.runtime_plural) for verb in RUNTIME_VERBS]
    return needs + list(POD_ACCESS)


def job_role_rules() -> list[dict]:
    """The rules of the Role ``lingo cluster setup`` grants the pipeline's service account:
    what ``step_access`` lists for every job API (``JOB_KINDS``) and a two-image job (its own
    runtimes, where the API has them), what ``deploy`` needs on InferenceServices
    (``DEPLOY_ACCESS``), and read access to the JobSets, pods, logs and events that explain a
    job (``kubectl describe``)."""
    jobs = [
        {
            "apiGroups": [kind.group],
            "resources": [kind.plural, *filter(None, [kind.runtime_plural])],
            "verbs": sorted({*JOB_VERBS, *(RUNTIME_VERBS if kind.runtime_plural else ()), "watch"}),
        }
        for kind in JOB_KINDS.values()
    ]
    return [
        *jobs,
        {
            "apiGroups": [SERVING_GROUP],
            "resources": [SERVING_PLURAL],
            "verbs": sorted({*DEPLOY_VERBS, "list", "watch"}),
        },
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": list(READ)},
        {"apiGroups": [""], "resources": ["pods", "pods/log", "events"], "verbs": list(READ)},
    ]


def grants(rules: list[dict], access: Access) -> bool:
    """True when one of the RBAC ``rules`` (a Role's ``rules``) allows ``access``, by the
    authorizer's matching (``*`` matches any group, resource or verb; a subresource is named
    ``resource/subresource``)."""
    resource = f"{access.resource}/{access.subresource}" if access.subresource else access.resource
    for rule in rules:
        groups, resources, verbs = (rule.get(k) or [] for k in ("apiGroups", "resources", "verbs"))
        if (
            ("*" in groups or access.group in groups)
            and ("*" in resources or resource in resources)
            and ("*" in verbs or access.verb in verbs)
        ):
            return True
    return False


def identity(token_path: Path = SERVICE_ACCOUNT_TOKEN) -> str:
    """Who the API server sees: ``system:serviceaccount:<namespace>:<name>`` read from this
    pod's service-account token (the JWT's claims; not verified, only named), else ``the
    kubeconfig's user``."""
    try:
        payload = token_path.read_text().split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (OSError, IndexError, ValueError):
        return "the kubeconfig's user"
    return str(claims.get("sub") or "this pod's service account")


def missing_access(api_client, namespace: str, needs: list[Access]) -> list[Access]:
    """The items of ``needs`` the API server says this client may not do in ``namespace``
    (one ``SelfSubjectAccessReview`` each)."""
    from kubernetes import client as k8s

    authorization = k8s.AuthorizationV1Api(api_client)
    missing = []
    for need in needs:
        review = k8s.V1SelfSubjectAccessReview(
            spec=k8s.V1SelfSubjectAccessReviewSpec(
                resource_attributes=k8s.V1ResourceAttributes(
                    namespace=namespace,
                    verb=need.verb,
                    group=need.group,
                    resource=need.resource,
                    subresource=need.subresource or None,
                )
            )
        )
        answer = authorization.create_self_subject_access_review(review)
        if not (answer.status and answer.status.allowed):
            missing.append(need)
    return missing


def check_access(api_client, namespace: str, needs: list[Access]) -> None:
    """Fail before anything is created when the API server denies one of ``needs``.

    Raises:
        AccessDenied: one line: the identity, each verb and resource denied, the namespace,
            and the fix (``lingo cluster setup``).
    """
    missing = missing_access(api_client, namespace, needs)
    if not missing:
        return
    denied = ", ".join(f"{m.verb} {m.what}" for m in missing)
    raise AccessDenied(
        f"{identity()} may not {denied} in namespace {namespace}: grant it with "
        f"`lingo cluster setup --namespace {namespace} --service-account <the pipeline's "
        "service account>` (a Role and RoleBinding; docs/cluster.md, 'Access each step needs')"
    )
