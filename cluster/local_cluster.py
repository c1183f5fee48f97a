"""A Kubernetes API and a Trainer controller on this machine, whose pods are local processes.

``lingo rehearse`` (``pipelines.rehearsal``) runs a cluster preset's compiled pipeline with its
training steps launching their TrainJobs exactly as on a cluster (``cluster.step_job``): the
steps reach this API through a kubeconfig (``KUBECONFIG``), and a controller thread plays the
Kubeflow Trainer and JobSet controllers:

- TrainJob + its (Cluster)TrainingRuntime → JobSet (``trainer_jobset``: kubeflow/trainer
  v2.3.0 ``pkg/runtime/core/trainingruntime.go``: the runtime's JobSet template, the
  TrainJob's ``runtimePatches`` merged into it strategically, then ``spec.trainer``'s image,
  command, env and resources on the ``node`` container, ``numNodes`` pods of the ``node`` job);
- JobSet → one Indexed Job per replicated job and replica → one pod per completion index,
  named ``<jobset>-<replicated job>-<job index>-<pod index>`` with the labels JobSet and the Job
  controller set (``jobset.sigs.k8s.io/jobset-name``, ``…/replicatedjob-name``,
  ``…/job-index``, ``batch.kubernetes.io/job-completion-index``) and ``JOB_COMPLETION_INDEX``;
- the Trainer's torch plugin gives the ``node`` container of the trainer replicated job the
  ``PET_*`` variables torchrun reads (v2.3.0 ``pkg/runtime/framework/plugins/torch/torch.go``,
  ``EnforceMLPolicy``): ``PET_NNODES`` = ``numNodes``, ``PET_NPROC_PER_NODE`` =
  ``numProcPerNode``, ``PET_NODE_RANK`` = the pod's completion index, ``PET_MASTER_ADDR`` =
  ``<job>-node-0-0.<job>``, ``PET_MASTER_PORT`` = 29500.

With ``job_apis=("pytorchjob",)`` it serves Training Operator v1's PyTorchJob instead (a
cluster without Trainer v2, where ``job_api: auto`` picks PyTorchJob) and plays its controller
(``pytorchjob_pods``: v1.9.0 ``pkg/controller.v1/pytorch``): a Master pod and the Workers,
``<job>-master-0``, ``<job>-worker-<i>``, with the env the operator sets.

Each pod is one process group (a "process kubelet"): its container's command with the image's
Python in place of ``python``, its env (plain values, Secrets key by key from ``secrets``),
run from the repository root. What a machine cannot give is substituted and recorded on the
pod (``PodRecord.substituted``): the pod DNS name and port of the rendezvous become
``127.0.0.1`` and a free port, an image becomes a local Python. Statuses go back to the API:
the TrainJob's ``Complete`` or ``Failed`` condition (a failed pod ends the others, as the
JobSet's failure policy does).

The API is ``kmock``'s in-memory emulator (the ``dev`` extra): no API server can run here.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cluster.jobs import JOB_RUNTIME_PLURAL, PYTORCHJOB, TRAINJOB, JobKind
from cluster.trainjob import ANCESTOR_LABEL, NODE, RUNTIME_PLURAL, TORCH_MASTER_PORT, master_addr

log = logging.getLogger(__name__)

JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
RESOURCES = {
    "trainer.kubeflow.org/v1alpha1/trainjobs": ("TrainJob", True),
    "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes": ("ClusterTrainingRuntime", False),
    "trainer.kubeflow.org/v1alpha1/trainingruntimes": ("TrainingRuntime", True),
    "jobset.x-k8s.io/v1alpha2/jobsets": ("JobSet", True),
}
"""What Kubeflow Trainer v2 serves (and the JobSet operator it runs on): the API this cluster
serves, so ``job_api: auto`` picks TrainJob as on OpenShift AI 3.x."""
PYTORCHJOB_RESOURCES = {"kubeflow.org/v1/pytorchjobs": ("PyTorchJob", True)}
"""What Training Operator v1 serves (``job_apis=("pytorchjob",)``)."""
PYTORCHJOB_PORT_NAME, PYTORCHJOB_DEFAULT_PORT = "pytorchjob-port", 23456
"""The Master container's port the operator's defaulting adds when the manifest has none
(v1.9.0 ``pkg/apis/kubeflow.org/v1/pytorch_types.go`` lines 25-29, ``pytorch_defaults.go``
``setPyTorchDefaultPort``): ``MASTER_PORT`` is that port."""
PYTORCHJOB_LABELS = {
    "job": "training.kubeflow.org/job-name",
    "operator": "training.kubeflow.org/operator-name",
    "type": "training.kubeflow.org/replica-type",
    "index": "training.kubeflow.org/replica-index",
    "role": "training.kubeflow.org/job-role",
}
"""The labels the operator puts on each pod (v1.9.0 ``pkg/apis/kubeflow.org/v1/common_types.go``
lines 25-37; ``pkg/controller.v1/common/pod.go`` ``createNewPod``: job role ``master`` on the
Master)."""
VERBS = {"create", "get", "list", "watch", "update", "patch", "delete"}


SSAR_PATH = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


def access_review(request) -> dict:
    """The answer to a ``SelfSubjectAccessReview``: allowed when the Role ``lingo cluster
    setup`` binds to the pipeline's service account (``cluster.access.job_role_rules``) grants
    it, so a step that needs more than that Role gives fails its access check here as on a
    cluster set up by that command."""
    from cluster.access import Access, grants, job_role_rules

    attributes = request.data["spec"]["resourceAttributes"]
    access = Access(
        attributes.get("verb", ""),
        attributes.get("group", ""),
        attributes.get("resource", ""),
        attributes.get("subresource", ""),
    )
    return {**request.data, "status": {"allowed": grants(job_role_rules(), access)}}


class LocalClusterError(RuntimeError):
    """The local cluster cannot start, or cannot run a pod as asked."""


@dataclass
class PodRecord:
    """One pod the controller made and ran.

    Attributes:
        name, job, replicated_job, labels, env, command: as the pod spec holds them (env:
            resolved, Secrets included as the names of their keys only).
        cpu: the container's CPU request (cores; None: none asked).
        nproc_per_node: the torchrun processes the pod starts.
        substituted: what this machine ran in place of what a cluster would.
        rank_env: per rank process seen (pid → its ``OMP_NUM_THREADS``, '' when unset).
        returncode: the pod's exit code (None while it runs or when it never started).
        log_path: its output.
    """

    name: str
    job: str
    replicated_job: str
    labels: dict[str, str]
    env: dict[str, str]
    command: list[str]
    cpu: float | None
    nproc_per_node: int
    substituted: list[str] = field(default_factory=list)
    rank_env: dict[int, str] = field(default_factory=dict)
    returncode: int | None = None
    log_path: Path | None = None


def trainer_jobset(trainjob: dict, runtime: dict) -> dict:
    """The JobSet the Trainer controller makes of ``trainjob`` with its runtime (see the
    module's docstring). A patch naming a replicated job or container the runtime lacks raises
    ``KeyError``, as the Trainer's webhook refuses it."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    jobs = {job["name"]: job for job in spec["replicatedJobs"]}
    for patch in trainjob["spec"].get("runtimePatches") or []:
        for job_patch in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            pod = _pod_spec(jobs[job_patch["name"]])
            pod_patch = job_patch["template"]["spec"]["template"]["spec"]
            containers = {c["name"]: c for c in pod["containers"]}
            for container in pod_patch.get("containers") or []:
                target = containers[container["name"]]
                mounts = container.get("volumeMounts") or []
                target["volumeMounts"] = _merge(target.get("volumeMounts", []), mounts, "mountPath")
            pod["volumes"] = _merge(pod.get("volumes", []), pod_patch.get("volumes") or [], "name")
            for name in ("nodeSelector", "tolerations", "serviceAccountName"):
                if name in pod_patch:
                    pod[name] = pod_patch[name]
    trainer = trainjob["spec"]["trainer"]
    node = jobs[NODE]
    node["template"]["spec"]["parallelism"] = trainer.get("numNodes", 1)
    node["template"]["spec"]["completions"] = trainer.get("numNodes", 1)
    (container,) = [c for c in _pod_spec(node)["containers"] if c["name"] == NODE]
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


def _pod_spec(replicated_job: dict) -> dict:
    return replicated_job["template"]["spec"]["template"]["spec"]


def _merge(base: list[dict], patch: list[dict], key: str) -> list[dict]:
    """A strategic merge of two lists keyed on ``key``: a patch item updates the base item of
    the same key (dicts merged recursively), or is appended."""
    merged = [copy.deepcopy(item) for item in base]
    for item in patch:
        same = [m for m in merged if m.get(key) == item.get(key)]
        if same:
            _merge_dict(same[0], item)
        else:
            merged.append(copy.deepcopy(item))
    return merged


def _merge_dict(base: dict, patch: dict) -> None:
    for name, value in patch.items():
        if isinstance(value, dict) and isinstance(base.get(name), dict):
            _merge_dict(base[name], value)
        else:
            base[name] = copy.deepcopy(value)


@dataclass(frozen=True)
class ExpandedPod:
    """One pod of a JobSet, before it runs: name, labels, its container."""

    name: str
    replicated_job: str
    labels: dict[str, str]
    container: dict
    volumes: list[dict]
    completion_index: int


def jobset_pods(jobset: dict, trainjob: dict) -> list[ExpandedPod]:
    """The pods the JobSet and Job controllers make of ``jobset``, with the ``PET_*`` env the
    torch plugin gives the trainer's ``node`` container and ``JOB_COMPLETION_INDEX``."""
    name = jobset["metadata"]["name"]
    trainer = trainjob["spec"]["trainer"]
    pods = []
    for replicated in jobset["spec"]["replicatedJobs"]:
        template = replicated["template"]
        labels = dict(
            ((template.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels")
            or {}
        )
        labels.update((template.get("metadata") or {}).get("labels") or {})
        spec = template["spec"]
        count = spec.get("parallelism") or spec.get("completions") or 1
        is_trainer = labels.get(ANCESTOR_LABEL) == "trainer" or replicated["name"] == NODE
        for job_index in range(replicated.get("replicas", 1)):
            for index in range(count):
                pod_spec = _pod_spec(replicated)
                (container, *_) = pod_spec["containers"]
                container = copy.deepcopy(container)
                env = list(container.get("env") or [])
                env.append({"name": COMPLETION_INDEX_ENV, "value": str(index)})
                if is_trainer and container["name"] == NODE:
                    env += [
                        {"name": "PET_NNODES", "value": str(trainer.get("numNodes", 1))},
                        {
                            "name": "PET_NPROC_PER_NODE",
                            "value": str(trainer.get("numProcPerNode", 1)),
                        },
                        {"name": "PET_NODE_RANK", "value": str(index)},
                        {"name": "PET_MASTER_ADDR", "value": master_addr(name)},
                        {"name": "PET_MASTER_PORT", "value": str(TORCH_MASTER_PORT)},
                    ]
                container["env"] = env
                pod_labels = {
                    **labels,
                    JOBSET_LABEL: name,
                    REPLICATED_JOB_LABEL: replicated["name"],
                    JOB_INDEX_LABEL: str(job_index),
                    COMPLETION_INDEX_LABEL: str(index),
                }
                pods.append(
                    ExpandedPod(
                        f"{name}-{replicated['name']}-{job_index}-{index}",
                        replicated["name"],
                        pod_labels,
                        container,
                        pod_spec.get("volumes") or [],
                        index,
                    )
                )
    return pods


def pytorchjob_pods(job: dict) -> list[ExpandedPod]:
    """The pods Training Operator v1.9.0 makes of a PyTorchJob: the Master, then the Workers,
    each named ``<job>-<type>-<index>`` (``common/pod.go`` ``GenGeneralName``), its
    ``pytorch`` container with the env ``pytorch/envvar.go`` ``setPodEnv`` and ``master.go``
    append to the container's own (the last of a name wins in a pod):

    - ``PYTHONUNBUFFERED=1``;
    - with a Master: ``MASTER_PORT`` and ``PET_MASTER_PORT`` (the Master's ``pytorchjob-port``,
      23456 by default), ``MASTER_ADDR`` and ``PET_MASTER_ADDR`` (``<job>-master-0``),
      ``WORLD_SIZE`` = all replicas × ``nprocPerNode`` (1 when not an integer: ``auto``),
      ``RANK`` and ``PET_NODE_RANK`` = 0 on the Master, the Worker's index + 1 on a Worker;
    - ``PET_NPROC_PER_NODE`` = ``spec.nprocPerNode`` (defaulted to ``auto``);
    - ``PET_NNODES`` = all replicas (elastic jobs get a range instead: not expanded here).

    Raises:
        LocalClusterError: an elastic job, or a replica without a ``pytorch`` container.
    """
    name = job["metadata"]["name"]
    spec = job["spec"]
    if spec.get("elasticPolicy"):
        raise LocalClusterError(f"PyTorchJob {name}: elasticPolicy is not expanded here")
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(int(r.get("replicas", 1)) for r in replicas.values())
    nproc = str(spec.get("nprocPerNode") or "auto")
    world = total * (int(nproc) if nproc.isdigit() else 1)
    master_env = _pytorchjob_master_env(name, replicas)
    pods = []
    for rtype in ("Master", "Worker"):
        if rtype not in replicas:
            continue
        replica = replicas[rtype]
        for index in range(int(replica.get("replicas", 1))):
            template = copy.deepcopy(replica["template"])
            pod_spec = template["spec"]
            container = next((c for c in pod_spec["containers"] if c["name"] == "pytorch"), None)
            if container is None:
                raise LocalClusterError(f"PyTorchJob {name}: {rtype} has no 'pytorch' container")
            rank = index + (1 if rtype == "Worker" else 0)
            env = [*(container.get("env") or []), {"name": "PYTHONUNBUFFERED", "value": "1"}]
            if master_env:
                env += [
                    *master_env,
                    {"name": "WORLD_SIZE", "value": str(world)},
                    {"name": "RANK", "value": str(rank)},
                    {"name": "PET_NODE_RANK", "value": str(rank)},
                ]
            env += [
                {"name": "PET_NPROC_PER_NODE", "value": nproc},
                {"name": "PET_NNODES", "value": str(total)},
            ]
            container["env"] = env
            labels = {
                **((template.get("metadata") or {}).get("labels") or {}),
                PYTORCHJOB_LABELS["job"]: name,
                PYTORCHJOB_LABELS["operator"]: "pytorchjob-controller",
                PYTORCHJOB_LABELS["type"]: rtype.lower(),
                PYTORCHJOB_LABELS["index"]: str(index),
            }
            if rtype == "Master":
                labels[PYTORCHJOB_LABELS["role"]] = "master"
            pods.append(
                ExpandedPod(
                    f"{name}-{rtype.lower()}-{index}", rtype.lower(), labels, container,
                    pod_spec.get("volumes") or [], index,
                )
            )  # fmt: skip
    return pods


def _pytorchjob_master_env(name: str, replicas: dict) -> list[dict]:
    """The Master's address and port as every replica's env gets them (none without a
    Master): the Master's ``pytorchjob-port``, 23456 by default."""
    if "Master" not in replicas:
        return []
    containers = replicas["Master"]["template"]["spec"]["containers"]
    ports = next((c.get("ports") or [] for c in containers if c["name"] == "pytorch"), [])
    port = next(
        (p["containerPort"] for p in ports if p.get("name") == PYTORCHJOB_PORT_NAME),
        PYTORCHJOB_DEFAULT_PORT,
    )
    addr = f"{name}-master-0"
    return [
        {"name": "MASTER_PORT", "value": str(port)},
        {"name": "PET_MASTER_PORT", "value": str(port)},
        {"name": "MASTER_ADDR", "value": addr},
        {"name": "PET_MASTER_ADDR", "value": addr},
    ]


PRIMARY_POD_RULE = {JOB_INDEX_LABEL: "0", COMPLETION_INDEX_LABEL: "0"}
"""How OpenShift AI's progress tracking picks a TrainJob's primary pod, the one it polls
(``GetPrimaryPod``, as issue #39 quotes it): the pod whose job index and completion index are
both 0, whatever its replicated job. With a second replicated job (a two-image job's
``rollout``) two pods match, and the first by name order wins."""


def primary_pod_matches(pods: list[ExpandedPod]) -> list[str]:
    """The pods ``PRIMARY_POD_RULE`` matches (a PyTorchJob's: ``PYTORCHJOB.primary_labels``,
    its Master), by name order."""
    pytorchjob = any(PYTORCHJOB_LABELS["job"] in p.labels for p in pods)
    rule = dict(PYTORCHJOB.primary_labels) if pytorchjob else PRIMARY_POD_RULE
    return sorted(p.name for p in pods if rule.items() <= p.labels.items())


def cpu_cores(quantity: str | int | float | None) -> float | None:
    """A Kubernetes CPU quantity (``40``, ``500m``) in cores."""
    if quantity is None:
        return None
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def torchrun_omp_threads(env: dict[str, str], nproc_per_node: int) -> str:
    """``OMP_NUM_THREADS`` each rank of a torchrun agent gets: the pod's own, else ``1`` when
    the agent starts more than one process (``torch/distributed/run.py``, ``config_from_args``:
    ``if "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node > 1``), else unset."""
    if "OMP_NUM_THREADS" in env:
        return env["OMP_NUM_THREADS"]
    return "1" if nproc_per_node > 1 else ""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def controller_pods(job: dict, runtime: dict | None) -> list[ExpandedPod]:
    """The pods of ``job`` as the controller of its kind makes them: a PyTorchJob's as the
    Training Operator does, a TrainJob's as the Trainer and JobSet controllers do from
    ``runtime``, the (Cluster)TrainingRuntime it references."""
    if job.get("kind") == PYTORCHJOB.kind:
        return pytorchjob_pods(job)
    return jobset_pods(trainer_jobset(job, runtime), job)


class LocalCluster:
    """The emulated API and the controller thread (a context manager).

    Args:
        root: where the kubeconfig and the pods' logs go.
        pythons: image → the Python that runs its containers here.
        secrets: Secret name → its data (key → value), as the cluster would hold them.
        namespace: the namespace the steps create their jobs in.
        repo_root: the pods' working directory (the images hold the project installed).
        job_apis: the job APIs served: ``trainjob`` (Trainer v2 and JobSet) or ``pytorchjob``
            (Training Operator v1).
        thread_limit: the OpenMP threads each pod process may run (``OMP_THREAD_LIMIT``), its
            ``OMP_NUM_THREADS`` left as the pod's spec sets it; None: no limit. A node's
            ranks sized for its 180 CPUs (22 threads each) oversubscribe a small machine
            many times over: every parallel region then waits on threads that are not running.
    """

    def __init__(
        self,
        root: Path,
        pythons: dict[str, str],
        secrets: dict[str, dict[str, str]],
        repo_root: Path,
        namespace: str = "lingo",
        job_apis: tuple[str, ...] = ("trainjob",),
        thread_limit: int | None = None,
    ) -> None:
        unknown = set(job_apis) - {TRAINJOB.api, PYTORCHJOB.api}
        if unknown or not job_apis:
            raise LocalClusterError(f"job_apis {job_apis}: serve trainjob and/or pytorchjob")
        self.kinds = [k for k in (TRAINJOB, PYTORCHJOB) if k.api in job_apis]
        self.root = root
        self.pythons = pythons
        self.secrets = secrets
        self.repo_root = repo_root
        self.namespace = namespace
        self.thread_limit = thread_limit
        self.pods: list[PodRecord] = []
        self.expanded: dict[str, list[ExpandedPod]] = {}
        self.kubeconfig = root / "kubeconfig"
        self._state: dict = {}
        self._stop = threading.Event()
        self._handled: set[str] = set()
        self._lock = threading.Lock()
        self._processes: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> LocalCluster:
        try:
            import kmock
        except ImportError as error:
            raise LocalClusterError(
                "lingo rehearse serves its Kubernetes API with kmock: pip install 'lingo-rl[dev]'"
            ) from error
        from kubernetes import client as k8s

        self.root.mkdir(parents=True, exist_ok=True)
        started = threading.Event()

        class Emulator(kmock.KubernetesEmulator):
            """A ``SelfSubjectAccessReview`` is answered, not stored (the API server keeps
            none; kmock would refuse a second nameless review with 409)."""

            async def _handle(self, request):
                if request.url.path == SSAR_PATH:
                    return await super(kmock.KubernetesEmulator, self)._handle(request)
                return await super()._handle(request)

        async def serve() -> None:
            async with Emulator() as api, kmock.Server(api) as server:
                served = {
                    **(RESOURCES if TRAINJOB in self.kinds else {}),
                    **(PYTORCHJOB_RESOURCES if PYTORCHJOB in self.kinds else {}),
                }
                for resource, (kind, namespaced) in served.items():
                    api.resources[resource] = kmock.ResourceInfo(
                        kind=kind, namespaced=namespaced, verbs=VERBS, subresources={"status"}
                    )
                api.resources["v1/pods"] = kmock.ResourceInfo(
                    kind="Pod", namespaced=True, verbs=VERBS
                )
                api[f"post {SSAR_PATH}"] << access_review
                self._state.update(
                    url=str(server.url).rstrip("/"),
                    stop=asyncio.Event(),
                    loop=asyncio.get_running_loop(),
                    api=api,
                )
                started.set()
                await self._state["stop"].wait()

        self._server = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
        self._server.start()
        if not started.wait(30):
            raise LocalClusterError("the emulated Kubernetes API did not start in 30 s")
        configuration = k8s.Configuration()
        configuration.host = self._state["url"]
        self.api_client = k8s.ApiClient(configuration)
        self.custom = k8s.CustomObjectsApi(self.api_client)
        self.core = k8s.CoreV1Api(self.api_client)
        self._write_kubeconfig()
        self._controller = threading.Thread(target=self._control, daemon=True)
        self._controller.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._controller.join(30)
        for pod in self.pods:
            self._kill(pod)
        self._state["loop"].call_soon_threadsafe(self._state["stop"].set)
        self._server.join(10)

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "rehearsal", "cluster": {"server": self._state["url"]}}],
            "users": [{"name": "rehearsal", "user": {}}],
            "contexts": [
                {
                    "name": "rehearsal",
                    "context": {
                        "cluster": "rehearsal",
                        "user": "rehearsal",
                        "namespace": self.namespace,
                    },
                }
            ],
            "current-context": "rehearsal",
        }
        self.kubeconfig.write_text(json.dumps(config, indent=2))

    def install_runtime(self, runtime: dict) -> None:
        """Create a ClusterTrainingRuntime (what ``lingo cluster install-runtime`` does)."""
        group, version = runtime["apiVersion"].split("/")
        self.custom.create_cluster_custom_object(group, version, RUNTIME_PLURAL, runtime)

    # the controller ----------------------------------------------------------------------

    def _control(self) -> None:
        while not self._stop.wait(0.5):
            for kind in self.kinds:
                try:
                    jobs = self.custom.list_namespaced_custom_object(
                        kind.group, kind.version, self.namespace, kind.plural
                    )["items"]
                except Exception as error:  # noqa: BLE001 (the API is ours; keep controlling)
                    log.warning("local cluster: cannot list %ss: %s", kind.kind, error)
                    continue
                for job in jobs:
                    name = job["metadata"]["name"]
                    if name in self._handled:
                        continue
                    self._handled.add(name)
                    threading.Thread(
                        target=self._run_trainjob, args=(job, kind), daemon=True
                    ).start()

    def _runtime(self, trainjob: dict) -> dict:
        ref = trainjob["spec"]["runtimeRef"]
        if ref.get("kind") == "TrainingRuntime":
            return self.custom.get_namespaced_custom_object(
                TRAINJOB.group, TRAINJOB.version, self.namespace, JOB_RUNTIME_PLURAL, ref["name"]
            )
        return self.custom.get_cluster_custom_object(
            TRAINJOB.group, TRAINJOB.version, RUNTIME_PLURAL, ref["name"]
        )

    def expand(self, trainjob: dict) -> list[ExpandedPod]:
        """The pods of ``trainjob`` as the Trainer and JobSet controllers make them from the
        runtime it references (a PyTorchJob: as the Training Operator makes them)."""
        runtime = self._runtime(trainjob) if "runtimeRef" in trainjob["spec"] else None
        return controller_pods(trainjob, runtime)

    def _run_trainjob(self, trainjob: dict, kind: JobKind = TRAINJOB) -> None:
        name = trainjob["metadata"]["name"]
        try:
            pods = self.expand(trainjob)
        except Exception as error:  # noqa: BLE001 (reported on the job, as a controller does)
            self._set_status(
                name, "Failed", "JobSetCreationFailed", f"{type(error).__name__}: {error}", kind
            )
            return
        self.expanded[name] = pods
        port = free_port()
        records = [self._start_pod(name, trainjob, pod, port) for pod in pods]
        self._set_status(name, "Running", "Running", "the pods run as local processes", kind)
        failed = None
        while failed is None and any(r.returncode is None for r in records):
            for record in records:
                self._observe(record)
                process = self._processes.get(record.name)
                if record.returncode is None and process is not None:
                    code = process.poll()
                    if code is not None:
                        record.returncode = code
                        if code != 0:
                            failed = record
            if self._stop.wait(1.0):
                break
        for record in records:  # a failed pod ends the JobSet (its failure policy)
            self._kill(record)
        if failed is not None or any(r.returncode != 0 for r in records):
            failed = failed or next(r for r in records if r.returncode != 0)
            self._set_status(
                name,
                "Failed",
                "FailedJobs",
                f"pod {failed.name} exited with code {failed.returncode} (log {failed.log_path})",
                kind,
            )
        else:
            self._set_status(name, kind.succeeded, "JobsCompleted", "all pods succeeded", kind)

    def _start_pod(self, job: str, trainjob: dict, pod: ExpandedPod, port: int) -> PodRecord:
        container = pod.container
        substituted: list[str] = []
        env: dict[str, str] = {}
        missing = []
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
                continue
            ref = ((item.get("valueFrom") or {}).get("secretKeyRef")) or {}
            data = self.secrets.get(ref.get("name", ""), {})
            if ref.get("key") in data:
                env[item["name"]] = data[ref["key"]]
            elif not ref.get("optional"):
                missing.append(f"{item['name']} (Secret {ref.get('name')} key {ref.get('key')})")
        if env.get("PET_MASTER_ADDR"):
            substituted.append(
                f"rendezvous {env['PET_MASTER_ADDR']}:{env['PET_MASTER_PORT']} → 127.0.0.1:{port}"
            )
            env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"] = "127.0.0.1", str(port)
            if "MASTER_ADDR" in env:  # a PyTorchJob's pods carry both spellings
                env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(port)
        command = list(container["command"])
        if "--master-addr" in command:  # a two-image job's rollout pod spells it out
            at = command.index("--master-addr")
            substituted.append(f"rendezvous {command[at + 1]} → 127.0.0.1:{port}")
            command[at + 1] = "127.0.0.1"
            command[command.index("--master-port") + 1] = str(port)
        python = self.pythons.get(container["image"])
        if command[0] == "python" and python:
            substituted.append(f"image {container['image']} → {python}")
            command[0] = python
        resources = container.get("resources") or {}
        cpu = cpu_cores((resources.get("requests") or {}).get("cpu"))
        nproc = int(env.get("PET_NPROC_PER_NODE") or _flag(command, "--nproc-per-node") or 1)
        machine_env = _host_env()
        if self.thread_limit is not None:
            machine_env["OMP_THREAD_LIMIT"] = str(self.thread_limit)
            substituted.append(
                f"OpenMP threads: OMP_NUM_THREADS {env.get('OMP_NUM_THREADS', 'unset')} kept, "
                f"each process held to {self.thread_limit} (OMP_THREAD_LIMIT)"
            )
        record = PodRecord(
            pod.name, job, pod.replicated_job, pod.labels, env, command, cpu, nproc, substituted,
            log_path=self.root / "pods" / f"{pod.name}.log",
        )  # fmt: skip
        with self._lock:
            self.pods.append(record)
        self._create_pod_object(pod, container)
        problems = [f"Secret keys missing: {', '.join(missing)}"] if missing else []
        for mount in container.get("volumeMounts") or []:
            volume = next((v for v in pod.volumes if v["name"] == mount["name"]), {})
            if "persistentVolumeClaim" in volume and not Path(mount["mountPath"]).is_dir():
                problems.append(
                    f"volume {mount['name']} (PVC {volume['persistentVolumeClaim']['claimName']})"
                    f" at {mount['mountPath']}: no such directory here"
                )
        record.log_path.parent.mkdir(parents=True, exist_ok=True)
        if problems:
            record.log_path.write_text("\n".join(problems) + "\n")
            record.returncode = 126
            return record
        with record.log_path.open("wb") as out:
            self._processes[pod.name] = subprocess.Popen(
                command,
                env={**machine_env, **env},
                cwd=self.repo_root,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return record

    def _create_pod_object(self, pod: ExpandedPod, container: dict) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": self.namespace, "labels": pod.labels},
            "spec": {"containers": [{"name": container["name"], "image": container["image"]}]},
            "status": {"phase": "Running"},
        }
        try:
            self.core.create_namespaced_pod(self.namespace, body)
            path = self.root / "pods" / f"{pod.name}.log"
            api = self._state["api"]
            route = f"get /api/v1/namespaces/{self.namespace}/pods/{pod.name}/log"

            def register() -> None:
                api[route] << (lambda: path.read_bytes() if path.exists() else b"")

            self._state["loop"].call_soon_threadsafe(register)
        except Exception as error:  # noqa: BLE001 (pods in the API are for the launcher's logs)
            log.warning("local cluster: pod %s not recorded in the API: %s", pod.name, error)

    def _observe(self, record: PodRecord) -> None:
        """Record ``OMP_NUM_THREADS`` of the pod's rank processes (torchrun's children)."""
        process = self._processes.get(record.name)
        if process is None or process.poll() is not None:
            return
        try:
            import psutil

            for child in psutil.Process(process.pid).children(recursive=True):
                if child.pid in record.rank_env:
                    continue
                with contextlib.suppress(psutil.Error):
                    environ = child.environ()
                    if "LOCAL_RANK" in environ:  # a rank torchrun started
                        record.rank_env[child.pid] = environ.get("OMP_NUM_THREADS", "")
        except Exception:  # noqa: BLE001, S110 (the process ended between two looks)
            pass

    def _kill(self, record: PodRecord) -> None:
        process = self._processes.get(record.name)
        if process is None or process.poll() is not None:
            if process is not None and record.returncode is None:
                record.returncode = process.returncode
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if record.returncode is None:
            record.returncode = process.returncode

    def _set_status(
        self, name: str, condition: str, reason: str, message: str, kind: JobKind = TRAINJOB
    ) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "conditions": [
                {
                    "type": condition,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": now,
                }
            ]
        }
        try:
            self.custom.patch_namespaced_custom_object_status(
                kind.group, kind.version, self.namespace, kind.plural, name, {"status": status},
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001 (the step then times out, and says so)
            log.warning("local cluster: cannot set %s's status: %s", name, error)


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def _host_env() -> dict[str, str]:
    """What a container inherits here: this machine's PATH, HOME and locale only (a pod gets
    its image's environment and its spec's env, nothing of the node's)."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "HF_HOME", "HF_HUB_OFFLINE")
    return {k: os.environ[k] for k in keep if k in os.environ}


@contextlib.contextmanager
def local_cluster(*args, **kwargs) -> Iterator[LocalCluster]:
    """``with local_cluster(...) as cluster``: ``LocalCluster``'s arguments."""
    with LocalCluster(*args, **kwargs) as cluster:
        yield cluster
