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

JOB_RESOURCES = {
    "trainjob": {
        "trainer.kubeflow.org/v1alpha1/trainjobs": ("TrainJob", True),
        "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes": ("ClusterTrainingRuntime", False),
        "trainer.kubeflow.org/v1alpha1/trainingruntimes": ("TrainingRuntime", True),
        "jobset.x-k8s.io/v1alpha2/jobsets": ("JobSet", True),
    },
    "pytorchjob": {"kubeflow.org/v1/pytorchjobs": ("PyTorchJob", True)},
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


def _merge(base: list[dict], patch: list[dict], key: str) -> list[dict]:
    """A strategic merge of two lists keyed on ``key``: a patch item updates the base item of
    the same key (dicts merged recursively), or is appended."""
    merged = [dict(item) for item in base]
    for item in patch:
        same = [m for m in merged if m.get(key) == item.get(key)]
        if same:
            _merge_dict(same[0], item)
        else:
            merged.append(dict(item))
    return merged


def _merge_dict(base: dict, patch: dict) -> None:
    for field, value in patch.items():
        if isinstance(value, dict) and isinstance(base.get(field), dict):
            _merge_dict(base[field], value)
        else:
            base[field] = value


def trainer_jobset(trainjob: dict, runtime: dict) -> dict:
    """The JobSet the Trainer controller makes of ``trainjob`` with its ClusterTrainingRuntime
    (kubeflow/trainer v2.3.0 ``pkg/runtime/core/trainingruntime.go``: the runtime's JobSet
    template, the TrainJob's ``runtimePatches`` merged into it strategically (containers and
    volumes by name, volume mounts by mount path), then ``spec.trainer``'s image, command, env
    and resources on the ``node`` container, ``numNodes`` pods of the ``node`` job). A patch
    naming a replicated job or a container the runtime lacks fails, as the webhook refuses it
    (``pkg/runtime/framework/plugins/jobset/jobset.go``, ``Validate``)."""
    import copy

    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    jobs = {job["name"]: job for job in spec["replicatedJobs"]}
    for patch in trainjob["spec"].get("runtimePatches") or []:
        for job_patch in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            pod = jobs[job_patch["name"]]["template"]["spec"]["template"]["spec"]
            pod_patch = job_patch["template"]["spec"]["template"]["spec"]
            containers = {c["name"]: c for c in pod["containers"]}
            for container in pod_patch.get("containers") or []:
                target = containers[container["name"]]
                mounts = container.get("volumeMounts") or []
                target["volumeMounts"] = _merge(target.get("volumeMounts", []), mounts, "mountPath")
            pod["volumes"] = _merge(pod.get("volumes", []), pod_patch.get("volumes") or [], "name")
            for field in ("nodeSelector", "tolerations", "serviceAccountName"):
                if field in pod_patch:
                    pod[field] = pod_patch[field]
    trainer = trainjob["spec"]["trainer"]
    node = jobs["node"]
    node["template"]["spec"]["parallelism"] = trainer.get("numNodes", 1)
    node["template"]["spec"]["completions"] = trainer.get("numNodes", 1)
    (container,) = [c for c in node["template"]["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "node"]  # fmt: skip
    container.update(image=trainer["image"], command=trainer["command"])
    container["env"] = trainer.get("env", [])
    container["resources"] = trainer.get("resourcesPerNode", {})
    name = trainjob["metadata"]["name"]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": trainjob["metadata"]["namespace"]},
        "spec": spec,
    }
