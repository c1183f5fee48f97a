"""Where and how a training step runs on Kubernetes, as typed data (no Kubernetes SDK needed).

``ClusterConfig`` says how jobs are submitted (which job API, the Trainer runtime, the Kueue
queue, progress tracking; a preset's ``cluster`` section); ``ClusterJobConfig`` adds one job's
machines (pods, GPUs, volumes, secrets by name); ``ExecutionConfig`` says whether a pipeline
step trains in its own process (``local``) or launches such a job (``job``). They import only
pydantic, so presets and the CLI can use them without the ``cluster`` extra;
``cluster.pytorchjob`` and ``cluster.trainjob`` turn them into manifests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from cluster.jobs import AUTO, PYTORCHJOB, wanted_job_apis
from cluster.nodes import OMP_THREADS_ENV, cpu_cores, job_fields, omp_threads, rollout_nodes
from core.config_model import ConfigModel

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_RUNTIME = "lingo-rl"
"""The ClusterTrainingRuntime lingo-rl ships (``deploy/``, ``lingo cluster install-runtime``)."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The label Kueue admits a job by: the name of a LocalQueue in the job's namespace."""
PROGRESS_PORT_ENV = "LINGO_PROGRESS_PORT"
"""Set in a TrainJob's training container when progress tracking is on: the port on which the
primary training process (global rank 0) serves its progress object."""
PROGRESS_TRACKING_ANNOTATION = "trainer.opendatahub.io/progression-tracking"
PROGRESS_PORT_ANNOTATION = "trainer.opendatahub.io/metrics-port"
PROGRESS_POLL_ANNOTATION = "trainer.opendatahub.io/metrics-poll-interval"
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""A Kubernetes object name (``metadata.name``): an RFC 1123 subdomain, at most 253 long."""
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_SECRET_LIKE = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|API_KEY|CREDENTIAL", re.IGNORECASE)


class SecretEnv(ConfigModel):
    """One environment variable read from a key of a Kubernetes Secret (names only)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    secret: str
    key: str
    optional: bool = False
    """The pod starts without the variable when the Secret or its key is missing (else the
    kubelet refuses to start it)."""


class Toleration(ConfigModel):
    """A pod toleration (see the Kubernetes ``Toleration`` type)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = "NoSchedule"


class ElasticSettings(ConfigModel):
    """torchrun elastic rendezvous (c10d): the job keeps running between min and max nodes."""

    model_config = ConfigDict(extra="forbid")

    min_nodes: int = Field(1, ge=1)
    max_nodes: int = Field(1, ge=1)
    max_restarts: int = Field(3, ge=0)


class ClusterConfig(ConfigModel):
    """How the training steps' jobs are submitted (a preset's ``cluster`` section; every
    step's job takes it, ``pipelines.presets.step_execution``).

    The progress settings follow OpenShift AI's contract for TrainJobs: the job carries the
    annotations ``trainer.opendatahub.io/progression-tracking: "true"``, ``…/metrics-port``
    and ``…/metrics-poll-interval``, and its training container the variable
    ``LINGO_PROGRESS_PORT``, on which the primary training process serves its progress.
    """

    model_config = ConfigDict(extra="forbid")

    job_api: str = AUTO
    """A job API of ``cluster.jobs.JOB_KINDS``: ``trainjob``, Kubeflow Trainer v2
    (``trainer.kubeflow.org/v1alpha1``); ``pytorchjob``, Training Operator v1
    (``kubeflow.org/v1``); or ``auto``: the one the API server serves, TrainJob when it serves
    both (``cluster.jobs.resolve_job_api``)."""
    runtime: str = DEFAULT_RUNTIME
    """The ClusterTrainingRuntime a TrainJob references."""
    queue: str | None = None
    """A Kueue LocalQueue: the job gets the label ``kueue.x-k8s.io/queue-name`` and waits,
    suspended, until Kueue admits it."""
    progress_tracking: bool = True
    """TrainJobs ask OpenShift AI to poll the training's progress (annotations + port)."""
    progress_port: int = Field(28080, ge=1024, le=65535)
    """Where rank 0 serves its progress (the platform refuses ports below 1024)."""
    progress_poll_interval_s: int = Field(30, ge=5, le=300)
    """How often the platform polls it (it clamps to 5..300 s)."""

    @field_validator("job_api")
    @classmethod
    def _known_job_api(cls, value: str) -> str:
        wanted_job_apis(value)
        return value

    @field_validator("runtime")
    @classmethod
    def _runtime_is_a_resource_name(cls, runtime: str) -> str:
        if len(runtime) > 253 or not _DNS_SUBDOMAIN.fullmatch(runtime):
            raise ValueError(
                f"runtime {runtime!r} is not a Kubernetes resource name (DNS-1123 subdomain: "
                "up to 253 characters of lowercase letters, digits, '-' and '.', alphanumeric "
                "at both ends): name the ClusterTrainingRuntime, e.g. lingo-rl-torch"
            )
        return runtime

    @field_validator("queue")
    @classmethod
    def _queue_is_a_label_value(cls, queue: str | None) -> str | None:
        if queue is not None and (not queue or not _LABEL_VALUE.match(queue)):
            raise ValueError(
                f"queue {queue!r} is not a Kubernetes label value (63 characters of "
                "[A-Za-z0-9._-], alphanumeric at both ends): name the Kueue LocalQueue"
            )
        return queue

    def queue_labels(self) -> dict[str, str]:
        """The job's Kueue label (none without a ``queue``)."""
        return {QUEUE_LABEL: self.queue} if self.queue else {}

    def progress_annotations(self) -> dict[str, str]:
        """The annotations that ask OpenShift AI to poll a TrainJob's progress (none when
        ``progress_tracking`` is off)."""
        if not self.progress_tracking:
            return {}
        return {
            PROGRESS_TRACKING_ANNOTATION: "true",
            PROGRESS_PORT_ANNOTATION: str(self.progress_port),
            PROGRESS_POLL_ANNOTATION: str(self.progress_poll_interval_s),
        }


class ClusterJobConfig(ClusterConfig):
    """Where and how a training step runs as a job (TrainJob or PyTorchJob).

    Secrets are referenced by name only (``secret_env_from``, ``secret_env``); ``env`` holds
    plain settings and rejects names that look like credentials. A variable named both in
    ``env`` and in ``secret_env`` takes the Secret (``job_env``).
    """

    model_config = ConfigDict(extra="forbid")

    namespace: str = "default"
    image: str
    """The training image (a pipeline parameter); it must contain this package."""
    nodes: int = Field(1, ge=1)
    """Pods, one per node (a PyTorchJob's Master and ``nodes - 1`` Workers, a TrainJob's
    ``numNodes``), the rollout-only nodes included."""
    rollout_nodes: int = Field(0, ge=0)
    """The job's last nodes, whose processes only roll out (GRPO's dedicated engines,
    ``trainer.placement``); set from the step's config when the job is built."""
    rollout_image: str | None = None
    """The image of the rollout-only nodes; ``None``: ``image``. A Megatron GRPO job rolls out
    with vLLM, which the Megatron image cannot hold: its engines run the GPU image
    (``two_images``)."""
    gpus_per_node: int = Field(0, ge=0)
    nproc_per_node: int | None = Field(None, ge=1)
    """Processes per pod (``torchrun --nproc_per_node``); default one per GPU (1 on CPU)."""
    cpu: str = "4"
    memory: str = "16Gi"
    shm_size: str = "8Gi"
    """Size of the memory-backed ``/dev/shm`` (NCCL and data loaders use it)."""
    shared_pvc: str = "lingo-rl-shared"
    """PersistentVolumeClaim (ReadWriteMany) for weights, checkpoints and metrics."""
    shared_mount: str = "/mnt/shared"
    env: dict[str, str] = Field(default_factory=dict)
    secret_env_from: list[str] = Field(default_factory=list)
    """Secrets whose keys all become environment variables (``envFrom``; PyTorchJobs only: a
    TrainJob takes Secrets key by key, ``secret_env``)."""
    secret_env: list[SecretEnv] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    service_account: str | None = None
    elastic: ElasticSettings | None = None
    backoff_limit: int = Field(0, ge=0)
    """Pod restarts before the job fails; 0 lets the pipeline decide about retries."""
    active_deadline_seconds: int | None = Field(None, ge=1)

    @field_validator("env")
    @classmethod
    def _no_secret_values(cls, env: dict[str, str]) -> dict[str, str]:
        leaked = sorted(name for name in env if _SECRET_LIKE.search(name))
        if leaked:
            raise ValueError(
                f"env {leaked} look like credentials: put them in a Secret and reference it "
                "with secret_env or secret_env_from"
            )
        return env

    @field_validator("cpu")
    @classmethod
    def _cpu_quantity(cls, cpu: str) -> str:
        cpu_cores(cpu)  # a pod's processes share it (``OMP_NUM_THREADS``, ``job_env``)
        return cpu

    @field_validator("secret_env")
    @classmethod
    def _one_secret_per_variable(cls, secret_env: list[SecretEnv]) -> list[SecretEnv]:
        names = [item.name for item in secret_env]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"secret_env sets {twice} from several Secrets: keep one each")
        return secret_env

    @model_validator(mode="after")
    def _elastic_covers_nodes(self) -> ClusterJobConfig:
        if self.elastic and not self.elastic.min_nodes <= self.nodes <= self.elastic.max_nodes:
            raise ValueError(
                f"nodes={self.nodes} is outside elastic min_nodes..max_nodes "
                f"({self.elastic.min_nodes}..{self.elastic.max_nodes})"
            )
        return self

    @model_validator(mode="after")
    def _training_node_left(self) -> ClusterJobConfig:
        if self.rollout_nodes >= self.nodes:
            raise ValueError(
                f"rollout_nodes={self.rollout_nodes} leaves none of the job's {self.nodes} "
                "node(s) for training: raise nodes"
            )
        return self

    @property
    def training_nodes(self) -> int:
        """Nodes whose processes train (the first ones): ``nodes - rollout_nodes``."""
        return self.nodes - self.rollout_nodes

    @property
    def two_images(self) -> bool:
        """True when the rollout-only nodes run another image than the training nodes."""
        return bool(self.rollout_nodes) and self.rollout_image not in (None, self.image)

    def resources(self) -> tuple[dict[str, str], dict[str, str]]:
        """A node's container ``(requests, limits)``: CPU and memory as both, the node's GPUs
        as a limit."""
        requests = {"cpu": self.cpu, "memory": self.memory}
        limits = dict(requests)
        if self.gpus_per_node:
            limits[GPU_RESOURCE] = str(self.gpus_per_node)
        return requests, limits

    @property
    def procs_per_node(self) -> int:
        """Processes per pod: ``nproc_per_node``, else one per GPU, else 1."""
        return self.nproc_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        """Training processes in the whole job."""
        return self.nodes * self.procs_per_node

    def job_env(self) -> list[tuple[str, str | SecretEnv]]:
        """The training container's environment, one entry per variable: ``env`` (sorted by
        name), then ``secret_env``. A Secret wins over a plain value of the same name (the
        plain one is dropped): an API server refuses a container whose ``env`` names a
        variable twice (``x-kubernetes-list-type: map`` keyed on ``name``).
        ``OMP_NUM_THREADS`` is the pod's CPU request shared by its processes
        (``cluster.nodes.omp_threads``) unless ``env`` sets it."""
        secrets = {item.name for item in self.secret_env}
        threads = {OMP_THREADS_ENV: str(omp_threads(self.cpu, self.procs_per_node))}
        env = {**threads, **self.env}
        plain = [(name, value) for name, value in sorted(env.items()) if name not in secrets]
        return [*plain, *((item.name, item) for item in self.secret_env)]


GPU_TOLERATION = Toleration(key=GPU_RESOURCE)

REFERENCE_LAYOUTS: dict[str, dict] = {
    # 6 nodes of 4× A10G (24 GB), 48 vCPU, 192 GiB: training takes 4 (Master + 3 Workers),
    # the other two stay free for rollout engines and evaluation.
    "g5.12xlarge": {"nodes": 4, **job_fields("g5.12xlarge")},
    # 8× H100 (80 GB), 192 vCPU, 2 TiB per node.
    "p5.48xlarge": {"nodes": 1, **job_fields("p5.48xlarge")},
    # 8× H200 (141 GB), 192 vCPU, 2 TiB per node.
    "p5en.48xlarge": {"nodes": 2, **job_fields("p5en.48xlarge")},
}
"""A training job per node type (``cluster.nodes.NODE_TYPES``), with a default node
count; ``Hardware.execution`` sets the nodes a preset's step takes."""


def reference_layout(
    instance_type: Literal["g5.12xlarge", "p5.48xlarge", "p5en.48xlarge"],
    image: str,
    **overrides,
) -> ClusterJobConfig:
    """The ``ClusterJobConfig`` of a reference cluster layout, with ``overrides`` applied.

    Raises:
        KeyError: ``instance_type`` is not one of ``REFERENCE_LAYOUTS``.
    """
    if instance_type not in REFERENCE_LAYOUTS:
        raise KeyError(f"no reference layout {instance_type!r}; known: {sorted(REFERENCE_LAYOUTS)}")
    return ClusterJobConfig(image=image, **{**REFERENCE_LAYOUTS[instance_type], **overrides})


class ExecutionConfig(ConfigModel):
    """How a training step (SFT, GRPO) runs: in the pipeline step's own pod, or as a job.

    ``local``: the step's process trains (``torchrun`` on its own GPUs when ``nproc`` > 1).
    ``job``: the step stages its inputs on the shared volume, launches a TrainJob or a
    PyTorchJob (``job.job_api``) of ``reference`` (a ``REFERENCE_LAYOUTS`` name) with ``job``
    on top (``ClusterJobConfig`` fields), follows it, and copies the results back into its
    output artifacts. ``image`` defaults to the step's own image and ``namespace`` to the
    namespace of the step's pod. ``pytorchjob``, the mode's name before TrainJobs, still
    reads as ``job`` with ``job.job_api = pytorchjob`` (runs scheduled with it keep working).
    """

    model_config = ConfigDict(extra="forbid")

    mode: Literal["local", "job"] = "local"
    reference: str | None = None
    """A reference layout to start from (``g5.12xlarge``, ``p5.48xlarge``, ``p5en.48xlarge``)."""
    job: dict = Field(default_factory=dict)
    """``ClusterJobConfig`` fields that override the reference layout."""
    timeout_s: int = Field(7 * 24 * 3600, ge=1)
    """How long the step waits for the job before failing."""
    poll_s: float = Field(15.0, gt=0)
    work_root: str | None = None
    """Directory on the shared volume for staged inputs and outputs; default
    ``<shared_mount>/lingo-rl-jobs``."""
    delete_on_success: bool = True
    """Delete a job that succeeded (its manifest stays an output artifact); a failed job is kept
    for ``kubectl describe`` until the pipeline's exit handler deletes it."""

    @model_validator(mode="before")
    @classmethod
    def _pytorchjob_mode_is_a_job(cls, data):
        if isinstance(data, dict) and data.get("mode") == PYTORCHJOB.api:
            job = {"job_api": PYTORCHJOB.api, **(data.get("job") or {})}
            return {**data, "mode": "job", "job": job}
        return data

    def cluster(self, nproc: int, rollout_processes: int = 0) -> tuple[int, int]:
        """``(nodes, processes per node)`` the step's training processes fill: its job
        (reference layout, then ``job`` overrides) less the nodes that ``rollout_processes``
        (dedicated rollout engines, placed after the training processes) take, or one node of
        ``nproc`` processes (``local``).

        Raises:
            ValueError: the job has no node left for training processes.
        """
        if self.mode == "local":
            return 1, nproc
        job = {**REFERENCE_LAYOUTS.get(self.reference or "", {}), **self.job}
        per_node = int(job.get("nproc_per_node") or job.get("gpus_per_node") or 1)
        nodes = int(job.get("nodes", 1)) - rollout_nodes(rollout_processes, per_node)
        if nodes < 1:
            raise ValueError(
                f"the job's {job.get('nodes', 1)} node(s) of {per_node} leave no node for "
                f"training beside {rollout_processes} rollout-only processes; raise job.nodes"
            )
        return nodes, per_node

    @model_validator(mode="after")
    def _job_is_valid(self) -> ExecutionConfig:
        if self.mode == "local":
            if self.reference or self.job:
                raise ValueError("execution mode 'local' takes no reference layout or job settings")
            return self
        if self.reference is not None and self.reference not in REFERENCE_LAYOUTS:
            raise ValueError(
                f"unknown reference layout {self.reference!r}; known: {sorted(REFERENCE_LAYOUTS)}"
            )
        self.cluster_job(default_image="validate", default_namespace="validate")
        return self

    def cluster_job(
        self, default_image: str, default_namespace: str, default_rollout_image: str | None = None
    ) -> ClusterJobConfig:
        """The job's ``ClusterJobConfig``: the reference layout, then ``job``, then defaults
        (``default_rollout_image`` for the rollout-only nodes, when ``job`` names none)."""
        fields = {**REFERENCE_LAYOUTS.get(self.reference or "", {}), **self.job}
        fields.setdefault("image", default_image)
        fields.setdefault("namespace", default_namespace)
        if default_rollout_image is not None:
            fields.setdefault("rollout_image", default_rollout_image)
        return ClusterJobConfig.model_validate(fields)

    def shared_dir(self, cluster: ClusterJobConfig) -> str:
        """Where this step's staged files live on the shared volume."""
        return self.work_root or f"{cluster.shared_mount.rstrip('/')}/lingo-rl-jobs"


@dataclass(frozen=True)
class JobLaunch:
    """What a pipeline step needs to run its training as a job (``mode='job'``).

    Attributes:
        execution: the step's execution settings.
        run_id: the pipeline run's id (job name and labels).
        manifest_path: where the job's YAML is written (an output artifact).
        image: the default training image (the step's own).
        rollout_image: the default image of the job's rollout-only nodes (GRPO's dedicated
            engines); ``None``: ``image``.
    """

    execution: ExecutionConfig
    run_id: str
    manifest_path: str
    image: str
    rollout_image: str | None = None

    @classmethod
    def for_step(
        cls,
        execution: dict,
        run_id: str,
        manifest_path: str,
        image: str,
        rollout_image: str | None = None,
    ) -> JobLaunch:
        """A pipeline step's launch from its ``execution`` parameter. The job-manifest
        artifact always gets a file: the job's YAML later, or (in ``local`` mode) a line
        saying that the step trained in its own pod."""
        execution_config = ExecutionConfig.model_validate(execution)
        launch = cls(execution_config, run_id, manifest_path, image, rollout_image)
        if not launch.as_job:
            Path(manifest_path).write_text("# trained in the pipeline step's own pod\n")
        return launch

    @property
    def as_job(self) -> bool:
        """True when the training runs as a job (TrainJob or PyTorchJob)."""
        return self.execution.mode == "job"
