"""``kmock``'s in-memory Kubernetes API emulator on 127.0.0.1, for the cluster tests.

No Kubernetes API server (nor training operator, Trainer controller or JobSet controller) can
run here: kmock stores the objects the real client sends over HTTP and answers API discovery
(``/apis/<group>/<version>``) for the resources declared; a test plays the controllers by
writing statuses, JobSets and pods through the API. It is an emulator, not an API server: it
validates nothing and runs no admission; what it answers for ``SelfSubjectAccessReview`` is
this module's own authorizer (``denied``), not Kubernetes RBAC.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import kmock
import pytest
from kubernetes import client as k8s

from cluster.jobs import PYTORCHJOB, TRAINJOB
from cluster.local_cluster import trainer_jobset  # noqa: F401 (the tests import it from here)

JOB_RESOURCES = {
    "trainjob": {
        "trainer.kubeflow.org/v1alpha1/trainjobs": ("TrainJob", True),
        "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes": ("ClusterTrainingRuntime", False),
        "trainer.kubeflow.org/v1alpha1/trainingruntimes": ("TrainingRuntime", True),
        "jobset.x-k8s.io/v1alpha2/jobsets": ("JobSet", True),
    },
    "pytorchjob": {"kubeflow.org/v1/pytorchjobs": ("PyTorchJob", True)},
    "kserve": {"serving.kserve.io/v1beta1/inferenceservices": ("InferenceService", True)},
}
CORE_RESOURCES = {
    "v1/pods": ("Pod", True),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True),
    "v1/secrets": ("Secret", True),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True),
}
"""What every emulator serves besides the job APIs: pods, and what ``lingo cluster setup``
creates in a namespace."""
SSAR_PATH = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
"""The resources each job API brings: Kubeflow Trainer v2 serves TrainJobs, (cluster-scoped)
ClusterTrainingRuntimes and (namespaced) TrainingRuntimes and runs on the JobSet operator;
Training Operator v1 serves PyTorchJobs."""
VERBS = {"create", "get", "list", "watch", "update", "patch", "delete"}
SERVED_JOB_APIS = pytest.mark.parametrize(
    ("served", "kind"),
    [(("trainjob", "pytorchjob"), TRAINJOB), (("pytorchjob",), PYTORCHJOB)],
    ids=["trainer-served", "training-operator-only"],
)
"""``(served, kind)``: the job APIs a server serves, and the kind ``job_api: auto`` picks
there (a TrainJob where Kubeflow Trainer is served, else a PyTorchJob)."""


class _Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, except that a ``SelfSubjectAccessReview`` is answered, not stored
    (the API server keeps none: the emulator would refuse the second review of the same
    nameless object with 409)."""

    async def _handle(self, request):
        if request.url.path == SSAR_PATH:
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        return await super()._handle(request)


@contextmanager
def kube_emulator(
    pod_logs: dict[str, bytes] | None = None,
    namespace: str = "team",
    apis: tuple[str, ...] = ("trainjob", "pytorchjob"),
    denied: set[tuple[str, str, str]] | None = None,
) -> Iterator:
    """Serve an emulator (the job APIs in ``apis``, ``CORE_RESOURCES``) from its own
    event-loop thread; yields an ``ApiClient`` pointed at it. ``pod_logs``: pod name → the
    log its ``/log`` returns. ``denied``: ``(verb, group, resource)`` triples (``pods/log``
    for a subresource) a ``SelfSubjectAccessReview`` answers ``allowed: false`` for; all else
    is allowed (the emulator enforces none of it on the other requests)."""
    refused = denied or set()

    def review(request) -> dict:
        attributes = request.data["spec"]["resourceAttributes"]
        resource = attributes.get("resource", "")
        if attributes.get("subresource"):
            resource += "/" + attributes["subresource"]
        key = (attributes.get("verb", ""), attributes.get("group", ""), resource)
        return {**request.data, "status": {"allowed": key not in refused}}

    started = threading.Event()
    state: dict = {}

    async def serve() -> None:
        async with _Emulator() as api, kmock.Server(api) as server:
            for served in apis:
                for resource, (kind, namespaced) in JOB_RESOURCES[served].items():
                    api.resources[resource] = kmock.ResourceInfo(
                        kind=kind, namespaced=namespaced, verbs=VERBS, subresources={"status"}
                    )
            for resource, (kind, namespaced) in CORE_RESOURCES.items():
                api.resources[resource] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, verbs=VERBS
                )
            api[f"post {SSAR_PATH}"] << review
            for pod, log in (pod_logs or {}).items():
                api[f"get /api/v1/namespaces/{namespace}/pods/{pod}/log"] << log
            state.update(url=str(server.url).rstrip("/"), stop=asyncio.Event())
            state["loop"] = asyncio.get_running_loop()
            started.set()
            await state["stop"].wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(10), "kmock did not start"
    configuration = k8s.Configuration()
    configuration.host = state["url"]
    try:
        yield k8s.ApiClient(configuration)
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(10)
