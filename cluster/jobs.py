"""The job APIs a training step can run on (``JOB_KINDS``), which of them a cluster serves, and
a job's state. Each is a ``JobKind``:

- **TrainJob** (Kubeflow Trainer v2, ``trainer.kubeflow.org/v1alpha1``): the Trainer
  controller turns it into a JobSet of ``numNodes`` pods from a ClusterTrainingRuntime; its
  conditions are ``Suspended``, ``Complete`` and ``Failed``.
- **PyTorchJob** (Training Operator v1, ``kubeflow.org/v1``): a Master and Workers; conditions
  ``Created``, ``Running``, ``Restarting``, ``Suspended``, ``Succeeded``, ``Failed``.

Both start the same container command (torchrun reads the ``PET_*`` variables both controllers
set), so only the manifest, the runtimes, the condition names and the pod labels differ: the
fields of ``JobKind``, which the launcher and the step job read instead of asking which API it
is. ``job_api: auto`` asks the API server's discovery which group versions it serves and takes
TrainJob when it serves both (OpenShift AI 3.x serves only TrainJob; Training Operator v1 is in
maintenance).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

JobState = Literal["created", "queued", "running", "succeeded", "failed"]
"""What a job is doing: ``queued`` is a suspended job (Kueue holds it until it admits it)."""
ManifestBuilder = Callable[..., dict]
"""``build(name: str, layout: ClusterJobConfig, module: str, args: list[str]) -> dict``: the
object that runs ``python -m module args…`` on the layout's nodes
(``cluster.step_job.job_layout``'s), as a plain dict; ValueError for a layout the job API
cannot hold, naming the field and the fix. (``cluster.config`` imports this module, so its
types are named here, not imported.)"""


@dataclass(frozen=True)
class JobKind:
    """One job API: what the launcher, the step job and the access checks read instead of
    asking which API it is.

    Attributes:
        api: its ``cluster.job_api`` name.
        kind, group, version, plural: the custom resource.
        succeeded: the condition type of a job that ended well.
        container: the training container's name (logs).
        job_label: the pod label that holds the job's name.
        primary_labels: further pod labels of the primary pod (global rank 0).
        builder: its ``ManifestBuilder``, or where it is (``module:function``, imported when
            first called: reading the registry does not import the Kubernetes SDK models the
            builders need, which take seconds).
        own_runtime_builder: for a layout whose nodes run two images (``two_images``), the
            ``ManifestBuilder`` (or where it is) of the namespaced runtime of the job's own
            that the job references, created before it and deleted with it
            (``runtime_plural``, in the job's group); "": the API has none (its manifest holds
            both images itself, or refuses them).
        runtime_plural: the plural of those runtimes ("": none).
        cluster_runtime_plural: the cluster-scoped runtime a job references otherwise
            (``cluster.runtime``, which ``lingo cluster install-runtime`` installs; "": none).
    """

    api: str
    kind: str
    group: str
    version: str
    plural: str
    succeeded: str
    container: str
    job_label: str
    primary_labels: tuple[tuple[str, str], ...]
    builder: ManifestBuilder | str
    own_runtime_builder: ManifestBuilder | str = ""
    runtime_plural: str = ""
    cluster_runtime_plural: str = ""

    def build(self, name: str, layout: BaseModel, module: str, args: list[str]) -> dict:
        """The job ``name``'s manifest on ``layout`` (a ``ClusterJobConfig``; ``builder``)."""
        return _builder(self.builder)(name, layout, module, args)

    def build_own_runtime(self, name: str, layout: BaseModel, module: str, args: list[str]) -> dict:
        """Job ``name``'s own runtime (``own_runtime_builder``).

        Raises:
            ValueError: the job API has no runtimes of a job's own.
        """
        if not self.own_runtime_builder:
            raise ValueError(f"a {self.kind} has no runtime of its own")
        return _builder(self.own_runtime_builder)(name, layout, module, args)

    @property
    def api_version(self) -> str:
        """``group/version``, as a manifest's ``apiVersion``."""
        return f"{self.group}/{self.version}"

    def pod_labels(self, name: str, primary: bool = False) -> dict[str, str]:
        """The labels that select job ``name``'s pods (only its primary pod: ``primary``)."""
        return {self.job_label: name, **(dict(self.primary_labels) if primary else {})}


TRAINJOB = JobKind(
    api="trainjob",
    kind="TrainJob",
    group="trainer.kubeflow.org",
    version="v1alpha1",
    plural="trainjobs",
    succeeded="Complete",
    container="node",
    # the JobSet's pods; rank 0 is the first pod of the "node" replicated job (Indexed Job)
    job_label="jobset.sigs.k8s.io/jobset-name",
    primary_labels=(
        ("jobset.sigs.k8s.io/replicatedjob-name", "node"),
        ("batch.kubernetes.io/job-completion-index", "0"),
    ),
    builder="cluster.trainjob:build_trainjob",
    own_runtime_builder="cluster.trainjob:build_job_runtime",
    runtime_plural="trainingruntimes",
    cluster_runtime_plural="clustertrainingruntimes",
)
PYTORCHJOB = JobKind(
    api="pytorchjob",
    kind="PyTorchJob",
    group="kubeflow.org",
    version="v1",
    plural="pytorchjobs",
    succeeded="Succeeded",
    container="pytorch",
    job_label="training.kubeflow.org/job-name",
    primary_labels=(("training.kubeflow.org/replica-type", "master"),),
    builder="cluster.pytorchjob:build_pytorchjob",
)
JOB_RUNTIME_KIND = "TrainingRuntime"
JOB_RUNTIME_PLURAL = TRAINJOB.runtime_plural
"""A two-image TrainJob's own runtime: namespaced, named after the job
(``cluster.trainjob.build_job_runtime``; a TrainJob may reference a TrainingRuntime of its
namespace: kubeflow/trainer v2.3.0 ``pkg/runtime/core/trainingruntime.go``, lines 97 and 306)."""
RUNTIME_OF_LABEL = "lingo-rl/runtime-of"
"""On a job's own TrainingRuntime: the TrainJob it was made for; ``JobLauncher.delete`` deletes
only a runtime that carries it (never one it did not create)."""
JOB_KINDS: dict[str, JobKind] = {TRAINJOB.api: TRAINJOB, PYTORCHJOB.api: PYTORCHJOB}
"""The job APIs by name, by preference: ``auto`` takes the first one the API server serves. A
new job API is its ``JobKind`` (its builder in a module of its own) and one entry here."""
AUTO = "auto"
"""The ``cluster.job_api`` that names no job API: the first of ``JOB_KINDS`` the API server
serves."""


def _builder(builder: ManifestBuilder | str) -> ManifestBuilder:
    if callable(builder):
        return builder
    module, _, function = builder.partition(":")
    return getattr(importlib.import_module(module), function)


class JobApiNotServed(RuntimeError):
    """The API server serves none of the job APIs asked for."""


def job_conditions(job: dict) -> dict[str, dict]:
    """The job's conditions that are currently true, by type (Created, Running, Succeeded…)."""
    conditions = job.get("status", {}).get("conditions") or []
    return {c["type"]: c for c in conditions if c.get("status") == "True"}


def job_state(kind: JobKind, job: dict) -> JobState:
    """Where ``job`` (an object as the API server returns it) stands.

    A suspended job is ``queued``, not failed: Kueue creates jobs suspended
    (``spec.suspend`` of a TrainJob, ``spec.runPolicy.suspend`` of a PyTorchJob) and lifts it
    when the queue admits them; the controllers report it as the ``Suspended`` condition.
    """
    conditions = job_conditions(job)
    if "Failed" in conditions:
        return "failed"
    if kind.succeeded in conditions:
        return "succeeded"
    spec = job.get("spec") or {}
    suspended = spec.get("suspend") or (spec.get("runPolicy") or {}).get("suspend")
    if "Suspended" in conditions or suspended:
        return "queued"
    active = any(j.get("active") for j in (job.get("status") or {}).get("jobsStatus") or [])
    if "Running" in conditions or active:
        return "running"
    return "created"


def served_job_apis(api_client) -> list[str]:
    """The job APIs (``trainjob``, ``pytorchjob``) the API server serves, by API discovery
    (``GET /apis/<group>/<version>`` lists the group version's resources; 404: not served).

    Raises:
        kubernetes.client.ApiException: the server answered something else than 200 or 404.
    """
    from kubernetes import client as k8s

    custom = k8s.CustomObjectsApi(api_client)
    served = []
    for kind in JOB_KINDS.values():
        try:
            resources = custom.get_api_resources(kind.group, kind.version)
        except k8s.ApiException as error:
            if error.status == 404:
                continue
            raise
        if any(r.name == kind.plural for r in resources.resources or []):
            served.append(kind.api)
    return served


def wanted_job_apis(job_api: str) -> list[str]:
    """The job APIs ``cluster.job_api`` accepts, by preference: ``auto`` any of ``JOB_KINDS``.

    Raises:
        ValueError: ``job_api`` is neither ``auto`` nor a job API's name (the valid names in
            the message).
    """
    if job_api == AUTO:
        return list(JOB_KINDS)
    if job_api not in JOB_KINDS:
        known = ", ".join([AUTO, *sorted(JOB_KINDS)])
        raise ValueError(f"cluster.job_api={job_api!r} is not a job API; valid names: {known}")
    return [job_api]


def resolve_job_api(job_api: str, api_client) -> JobKind:
    """The job API to create jobs with: ``job_api`` itself, or for ``auto`` the first of
    ``JOB_KINDS`` the server serves.

    Raises:
        JobApiNotServed: the server serves neither (``auto``) or not the one asked for.
    """
    served = served_job_apis(api_client)
    wanted = wanted_job_apis(job_api)
    for api in wanted:
        if api in served:
            return JOB_KINDS[api]
    names = " nor ".join(f"{JOB_KINDS[a].kind} ({JOB_KINDS[a].api_version})" for a in wanted)
    hint = (
        f"; it serves {', '.join(JOB_KINDS[a].kind for a in served)}: set cluster.job_api=auto"
        if served
        else ": install Kubeflow Trainer v2 (TrainJob) or Training Operator v1 (PyTorchJob)"
    )
    raise JobApiNotServed(f"the Kubernetes API server serves no {names}{hint}")
