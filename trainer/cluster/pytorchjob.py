"""Build a Kubeflow PyTorchJob manifest for one training step.

The job has a Master and ``nodes - 1`` Workers, one pod per node. Each pod runs
``python -m torch.distributed.run -m <module> <args…>``: torchrun reads its rendezvous settings
from the ``PET_*`` variables the training operator sets (``PET_NNODES``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, and ``PET_NPROC_PER_NODE`` from
``spec.nprocPerNode``, a string, training-operator v1.7+), so the command line carries only the
entry point and its arguments. The manifest is built with the ``kubeflow-training`` SDK models
and the Kubernetes client's pod models, then serialized to a plain dict.
"""

from __future__ import annotations

import re
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

try:
    from kubeflow.training import models as kf
    from kubernetes import client as k8s
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "trainer.cluster needs the Kubernetes SDKs: pip install 'lingo-rl[cluster]'"
    ) from error

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
CONTAINER_NAME = "pytorch"
"""The training operator finds the training container by this name."""
ISTIO_INJECT_ANNOTATION = "sidecar.istio.io/inject"
GPU_RESOURCE = "nvidia.com/gpu"
_SECRET_LIKE = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|API_KEY|CREDENTIAL", re.IGNORECASE)


class SecretEnv(BaseModel):
    """One environment variable read from a key of a Kubernetes Secret (names only)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    secret: str
    key: str


class Toleration(BaseModel):
    """A pod toleration (see the Kubernetes ``Toleration`` type)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = "NoSchedule"


class ElasticSettings(BaseModel):
    """torchrun elastic rendezvous (c10d): the job keeps running between min and max nodes."""

    model_config = ConfigDict(extra="forbid")

    min_nodes: int = Field(1, ge=1)
    max_nodes: int = Field(1, ge=1)
    max_restarts: int = Field(3, ge=0)


GPU_TOLERATION = Toleration(key=GPU_RESOURCE)


class ClusterJobConfig(BaseModel):
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


def _instance(instance_type: str) -> dict[str, str]:
    return {"node.kubernetes.io/instance-type": instance_type}


REFERENCE_LAYOUTS: dict[str, dict] = {
    # 6 nodes of 4× A10G (24 GB), 48 vCPU, 192 GiB: training takes 4 (Master + 3 Workers),
    # the other two stay free for rollout engines and evaluation.
    "g5.12xlarge": dict(
        nodes=4,
        gpus_per_node=4,
        cpu="44",
        memory="160Gi",
        shm_size="32Gi",
        node_selector=_instance("g5.12xlarge"),
        tolerations=[GPU_TOLERATION],
    ),
    # 8× H200 (141 GB), 192 vCPU, 2 TiB per node.
    "p5en.48xlarge": dict(
        nodes=2,
        gpus_per_node=8,
        cpu="180",
        memory="1800Gi",
        shm_size="256Gi",
        node_selector=_instance("p5en.48xlarge"),
        tolerations=[GPU_TOLERATION],
    ),
}


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


def entry_point_command(module: str, args: list[str]) -> list[str]:
    """The container command: torchrun (settings from the operator's ``PET_*``) on ``module``."""
    return ["python", "-m", "torch.distributed.run", "-m", module, *args]


def _container(cluster: ClusterJobConfig, command: list[str]) -> k8s.V1Container:
    resources = {"cpu": cluster.cpu, "memory": cluster.memory}
    limits = dict(resources)
    if cluster.gpus_per_node:
        limits[GPU_RESOURCE] = str(cluster.gpus_per_node)
    env = [k8s.V1EnvVar(name=name, value=value) for name, value in sorted(cluster.env.items())]
    env += [
        k8s.V1EnvVar(
            name=item.name,
            value_from=k8s.V1EnvVarSource(
                secret_key_ref=k8s.V1SecretKeySelector(name=item.secret, key=item.key)
            ),
        )
        for item in cluster.secret_env
    ]
    return k8s.V1Container(
        name=CONTAINER_NAME,
        image=cluster.image,
        command=command,
        env=env or None,
        env_from=[
            k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=name))
            for name in cluster.secret_env_from
        ]
        or None,
        resources=k8s.V1ResourceRequirements(requests=resources, limits=limits),
        volume_mounts=[
            k8s.V1VolumeMount(name="shared", mount_path=cluster.shared_mount),
            k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
        ],
    )


def _pod_template(cluster: ClusterJobConfig, command: list[str]) -> k8s.V1PodTemplateSpec:
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(annotations={ISTIO_INJECT_ANNOTATION: "false"}),
        spec=k8s.V1PodSpec(
            containers=[_container(cluster, command)],
            volumes=[
                k8s.V1Volume(
                    name="shared",
                    persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                        claim_name=cluster.shared_pvc
                    ),
                ),
                k8s.V1Volume(
                    name="dshm",
                    empty_dir=k8s.V1EmptyDirVolumeSource(
                        medium="Memory", size_limit=cluster.shm_size
                    ),
                ),
            ],
            node_selector=cluster.node_selector or None,
            tolerations=[k8s.V1Toleration(**t.model_dump()) for t in cluster.tolerations] or None,
            service_account_name=cluster.service_account,
        ),
    )


def build_pytorchjob(name: str, cluster: ClusterJobConfig, module: str, args: list[str]) -> dict:
    """The PyTorchJob manifest that runs ``python -m module args…`` on the cluster layout.

    Args:
        name: the job's name (a DNS label; the pods are named after it).
        cluster: where and how to run.
        module: the entry point, e.g. ``trainer.sft``.
        args: its arguments; paths must point into ``cluster.shared_mount``.

    Returns:
        The manifest as a JSON-ready dict (see ``manifest_yaml``).
    """
    template = _pod_template(cluster, entry_point_command(module, args))
    restart = "OnFailure" if cluster.backoff_limit else "Never"
    replicas = {
        "Master": kf.KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy=restart, template=template)
    }
    if cluster.nodes > 1:
        replicas["Worker"] = kf.KubeflowOrgV1ReplicaSpec(
            replicas=cluster.nodes - 1, restart_policy=restart, template=template
        )
    elastic = None
    if cluster.elastic:
        elastic = kf.KubeflowOrgV1ElasticPolicy(
            min_replicas=cluster.elastic.min_nodes,
            max_replicas=cluster.elastic.max_nodes,
            max_restarts=cluster.elastic.max_restarts,
            rdzv_backend="c10d",
        )
    job = kf.KubeflowOrgV1PyTorchJob(
        api_version=API_VERSION,
        kind=KIND,
        metadata=k8s.V1ObjectMeta(name=name, namespace=cluster.namespace),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(cluster.procs_per_node),
            elastic_policy=elastic,
            pytorch_replica_specs=replicas,
            run_policy=kf.KubeflowOrgV1RunPolicy(
                backoff_limit=cluster.backoff_limit,
                clean_pod_policy="None",
                active_deadline_seconds=cluster.active_deadline_seconds,
            ),
        ),
    )
    return k8s.ApiClient().sanitize_for_serialization(job)


def manifest_yaml(manifest: dict) -> str:
    """The manifest as YAML text, for an artifact or ``kubectl apply -f``."""
    return yaml.safe_dump(manifest, sort_keys=False)
