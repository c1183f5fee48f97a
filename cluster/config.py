"""Where and how a training step runs on Kubernetes, as typed data (no Kubernetes SDK needed).

``ClusterJobConfig`` describes one PyTorchJob (pods, GPUs, volumes, secrets by name);
``ExecutionConfig`` says whether a pipeline step trains in its own process (``local``) or
launches such a job (``pytorchjob``). Both import only pydantic, so presets and the CLI can
use them without the ``cluster`` extra; ``cluster.pytorchjob`` turns them into a
manifest with the Kubeflow and Kubernetes SDKs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from cluster.hardware import job_fields, rollout_nodes
from core.config_model import ConfigModel

GPU_RESOURCE = "nvidia.com/gpu"
_SECRET_LIKE = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|API_KEY|CREDENTIAL", re.IGNORECASE)


class SecretEnv(ConfigModel):
    """One environment variable read from a key of a Kubernetes Secret (names only)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    secret: str
    key: str


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


class ClusterJobConfig(ConfigModel):
    """Where and how a training step runs as a PyTorchJob.

    Secrets are referenced by name only (``secret_env_from``, ``secret_env``); ``env`` holds
    plain settings and rejects names that look like credentials.
    """

    model_config = ConfigDict(extra="forbid")

    namespace: str = "default"
    image: str
    """The training image (a pipeline parameter); it must contain this package."""
    nodes: int = Field(1, ge=1)
    """Pods, one per node: a Master and ``nodes - 1`` Workers."""
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
    """Secrets whose keys all become environment variables (``envFrom``)."""
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

    @model_validator(mode="after")
    def _elastic_covers_nodes(self) -> ClusterJobConfig:
        if self.elastic and not self.elastic.min_nodes <= self.nodes <= self.elastic.max_nodes:
            raise ValueError(
                f"nodes={self.nodes} is outside elastic min_nodes..max_nodes "
                f"({self.elastic.min_nodes}..{self.elastic.max_nodes})"
            )
        return self

    @property
    def procs_per_node(self) -> int:
        """Processes per pod: ``nproc_per_node``, else one per GPU, else 1."""
        return self.nproc_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        """Training processes in the whole job."""
        return self.nodes * self.procs_per_node


GPU_TOLERATION = Toleration(key=GPU_RESOURCE)

REFERENCE_LAYOUTS: dict[str, dict] = {
    # 6 nodes of 4× A10G (24 GB), 48 vCPU, 192 GiB: training takes 4 (Master + 3 Workers),
    # the other two stay free for rollout engines and evaluation.
    "g5.12xlarge": {"nodes": 4, **job_fields("g5.12xlarge")},
    # 8× H200 (141 GB), 192 vCPU, 2 TiB per node.
    "p5en.48xlarge": {"nodes": 2, **job_fields("p5en.48xlarge")},
}
"""A PyTorchJob per node type (``cluster.hardware.NODE_TYPES``), with a default node
count; ``Hardware.execution`` sets the nodes a preset's step takes."""


def reference_layout(
    instance_type: Literal["g5.12xlarge", "p5en.48xlarge"], image: str, **overrides
) -> ClusterJobConfig:
    """The ``ClusterJobConfig`` of a reference cluster layout, with ``overrides`` applied.

    Raises:
        KeyError: ``instance_type`` is not one of ``REFERENCE_LAYOUTS``.
    """
    if instance_type not in REFERENCE_LAYOUTS:
        raise KeyError(f"no reference layout {instance_type!r}; known: {sorted(REFERENCE_LAYOUTS)}")
    return ClusterJobConfig(image=image, **{**REFERENCE_LAYOUTS[instance_type], **overrides})


class ExecutionConfig(ConfigModel):
    """How a training step (SFT, GRPO) runs: in the pipeline step's own pod, or as a PyTorchJob.

    ``local``: the step's process trains (``torchrun`` on its own GPUs when ``nproc`` > 1).
    ``pytorchjob``: the step stages its inputs on the shared volume, launches a PyTorchJob of
    ``reference`` (a ``REFERENCE_LAYOUTS`` name) with ``job`` on top (``ClusterJobConfig``
    fields), follows it, and copies the results back into its output artifacts. ``image``
    defaults to the step's own image and ``namespace`` to the namespace of the step's pod.
    """

    model_config = ConfigDict(extra="forbid")

    mode: Literal["local", "pytorchjob"] = "local"
    reference: str | None = None
    """A reference layout to start from (``g5.12xlarge``, ``p5en.48xlarge``)."""
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

    def cluster(self, nproc: int, rollout_processes: int = 0) -> tuple[int, int]:
        """``(nodes, processes per node)`` the step's training processes fill: its PyTorchJob
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
                f"the PyTorchJob's {job.get('nodes', 1)} node(s) of {per_node} leave no node for "
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

    def cluster_job(self, default_image: str, default_namespace: str) -> ClusterJobConfig:
        """The job's ``ClusterJobConfig``: the reference layout, then ``job``, then defaults."""
        fields = {**REFERENCE_LAYOUTS.get(self.reference or "", {}), **self.job}
        fields.setdefault("image", default_image)
        fields.setdefault("namespace", default_namespace)
        return ClusterJobConfig.model_validate(fields)

    def shared_dir(self, cluster: ClusterJobConfig) -> str:
        """Where this step's staged files live on the shared volume."""
        return self.work_root or f"{cluster.shared_mount.rstrip('/')}/lingo-rl-jobs"


@dataclass(frozen=True)
class JobLaunch:
    """What a pipeline step needs to run its training as a PyTorchJob (``mode='pytorchjob'``).

    Attributes:
        execution: the step's execution settings.
        run_id: the pipeline run's id (job name and labels).
        manifest_path: where the job's YAML is written (an output artifact).
        image: the default training image (the step's own).
    """

    execution: ExecutionConfig
    run_id: str
    manifest_path: str
    image: str

    @classmethod
    def for_step(cls, execution: dict, run_id: str, manifest_path: str, image: str) -> JobLaunch:
        """A pipeline step's launch from its ``execution`` parameter. The job-manifest
        artifact always gets a file: the job's YAML later, or (in ``local`` mode) a line
        saying that the step trained in its own pod."""
        launch = cls(ExecutionConfig.model_validate(execution), run_id, manifest_path, image)
        if not launch.as_job:
            Path(manifest_path).write_text("# trained in the pipeline step's own pod\n")
        return launch

    @property
    def as_job(self) -> bool:
        """True when the training runs as a PyTorchJob."""
        return self.execution.mode == "pytorchjob"
