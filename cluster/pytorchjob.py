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

import yaml

try:
    from kubeflow.training import models as kf
    from kubernetes import client as k8s
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "cluster needs the Kubernetes SDKs: pip install 'lingo-rl[cluster]'"
    ) from error

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
CONTAINER_NAME = "pytorch"
"""The training operator finds the training container by this name."""
ISTIO_INJECT_ANNOTATION = "sidecar.istio.io/inject"

from cluster.config import (  # noqa: E402 (after the SDK check) - re-exported
    GPU_TOLERATION,
    REFERENCE_LAYOUTS,
    ClusterJobConfig,
    ElasticSettings,
    SecretEnv,
    Toleration,
    reference_layout,
)
from cluster.torchrun import entry_point_command  # noqa: E402 (after the SDK check)

__all__ = [
    "GPU_TOLERATION",
    "REFERENCE_LAYOUTS",
    "ClusterJobConfig",
    "ElasticSettings",
    "SecretEnv",
    "Toleration",
    "build_pytorchjob",
    "manifest_yaml",
    "reference_layout",
]


def _container(cluster: ClusterJobConfig, command: list[str]) -> k8s.V1Container:
    resources, limits = cluster.resources()
    env = [
        k8s.V1EnvVar(name=name, value=value)
        if isinstance(value, str)
        else k8s.V1EnvVar(
            name=name,
            value_from=k8s.V1EnvVarSource(
                secret_key_ref=k8s.V1SecretKeySelector(
                    name=value.secret, key=value.key, optional=value.optional or None
                )
            ),
        )
        for name, value in cluster.job_env()
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


def _refuse_two_images(cluster: ClusterJobConfig) -> None:
    """A PyTorchJob has two pod templates, the Master's (node rank 0) and the Workers' (node
    ranks 1..n-1, in Worker index order; training-operator v1.9.0
    ``pkg/controller.v1/pytorch/envvar.go`` lines 80-95: ``PET_NODE_RANK`` = the Worker's index
    + 1; lines 117-121: ``PET_NNODES`` = all replicas; ``master.go`` line 42: ``PET_MASTER_ADDR``
    = the Master pod). So two images fit only when training fills the Master: Master the
    training image, Workers the rollout image. Elastic rendezvous gives node ranks in arrival
    order, which would mix them."""
    if cluster.training_nodes > 1:
        raise ValueError(
            f"a PyTorchJob has one pod template for the Master and one for the Workers, so its "
            f"{cluster.training_nodes} training nodes ({cluster.image}) and {cluster.rollout_nodes}"
            f" rollout-only nodes ({cluster.rollout_image}) cannot run two images: set "
            "cluster.job_api=trainjob, or train on one node (hardware.grpo_nodes=1)"
        )
    if cluster.elastic:
        raise ValueError(
            "elastic: a PyTorchJob with two images needs fixed node ranks (elastic rendezvous "
            "orders nodes as they join); unset elastic or set cluster.job_api=trainjob"
        )


def build_pytorchjob(name: str, cluster: ClusterJobConfig, module: str, args: list[str]) -> dict:
    """The PyTorchJob manifest that runs ``python -m module args…`` on the cluster layout
    (labelled for Kueue when ``cluster.queue`` is set). With two images
    (``cluster.two_images``: GRPO's rollout-only nodes in ``cluster.rollout_image``) the Master
    runs the training image and the Workers the rollout image (``_refuse_two_images``).

    Args:
        name: the job's name (a DNS label; the pods are named after it).
        cluster: where and how to run.
        module: the entry point, e.g. ``trainer.sft``.
        args: its arguments; paths must point into ``cluster.shared_mount``.

    Returns:
        The manifest as a JSON-ready dict (see ``manifest_yaml``).

    Raises:
        ValueError: two images on more than one training node, or with ``elastic``.
    """
    command = entry_point_command(module, args)
    template = worker_template = _pod_template(cluster, command)
    if cluster.two_images:
        _refuse_two_images(cluster)
        rollout = cluster.model_copy(update={"image": cluster.rollout_image})
        worker_template = _pod_template(rollout, command)
    restart = "OnFailure" if cluster.backoff_limit else "Never"
    replicas = {
        "Master": kf.KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy=restart, template=template)
    }
    if cluster.nodes > 1:
        replicas["Worker"] = kf.KubeflowOrgV1ReplicaSpec(
            replicas=cluster.nodes - 1, restart_policy=restart, template=worker_template
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
        metadata=k8s.V1ObjectMeta(
            name=name, namespace=cluster.namespace, labels=cluster.queue_labels() or None
        ),
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
