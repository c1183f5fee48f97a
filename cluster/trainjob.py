"""Build a Kubeflow Trainer v2 TrainJob for one training step, and the ClusterTrainingRuntime
it references.

The runtime (``lingo-rl``, shipped as ``deploy/cluster-training-runtime.yaml`` and installed
by ``lingo cluster install-runtime``) is a JobSet of one replicated job ``node``: its pods run
our training image with the torch ML policy, so the Trainer controller sets the ``PET_*``
variables torchrun reads (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR``, ``PET_MASTER_PORT``; kubeflow/trainer v2.3.0
``pkg/runtime/framework/plugins/torch/torch.go``, ``EnforceMLPolicy``). It mounts the shared
PVC at ``/mnt/shared`` and a memory-backed ``/dev/shm``, keeps Istio's sidecar out, and never
restarts a failed pod (retries are the pipeline's).

Each TrainJob sets what changes per step: the command (the same ``python -m
torch.distributed.run -m trainer.<step> …`` a PyTorchJob runs), image, ``numNodes``,
``numProcPerNode``, ``resourcesPerNode`` and ``env`` (plain values and Secrets key by key:
``spec.trainer.env`` is where the controller takes the training container's variables, and the
webhook refuses env in a patch of the ``node`` container); and, as a runtime patch, the PVC's
claim, ``/dev/shm``'s size, node selector, tolerations and service account. Built with the
``kubeflow-trainer-api`` models (its own top-level package, ``kubeflow_trainer_api``: it does
not share ``kubeflow/`` with ``kubeflow-training``) and serialized to a plain dict.

A GRPO job whose rollout-only nodes run another image (``ClusterJobConfig.two_images``: a
Megatron trainer beside vLLM engines) cannot use the shared runtime: a runtime patch cannot set
a container's image or command. It gets its own namespaced TrainingRuntime
(``build_job_runtime``): the same ``node`` job for the trainers plus a ``rollout`` job of the
rollout image, whose pods join the trainers' rendezvous (``cluster.rollout_node``).
"""

from __future__ import annotations

try:
    from kubeflow_trainer_api import models as kt
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "TrainJobs need the Kubeflow Trainer API models: pip install 'lingo-rl[cluster]'"
    ) from error

from cluster.config import PROGRESS_PORT_ENV, ClusterJobConfig
from cluster.jobs import JOB_RUNTIME_KIND, RUNTIME_OF_LABEL, TRAINJOB
from cluster.rollout_node import RolloutLayout
from cluster.torchrun import entry_point_command

NODE = "node"
"""The runtime's replicated job and training container; the torch plugin injects ``PET_*``
into the container of this name in the replicated job labelled as the trainer."""
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
RUNTIME_KIND = "ClusterTrainingRuntime"
RUNTIME_PLURAL = TRAINJOB.cluster_runtime_plural
ROLLOUT = "rollout"
"""A two-image job's replicated job and container of the rollout-only nodes. Its pods sort
after the trainers' (``sorts_after_trainers``: OpenShift AI's progress polling relies on it).
It has no trainer ancestor label, so the Trainer keeps the runtime's image, command and pod
count for it (v2.3.0 ``plugins/jobset/builder.go`` ``Trainer``: image, command and env only
where the ancestor is ``trainer``; ``pkg/runtime/core/trainingruntime.go`` line 189: its pod
count is the job's ``parallelism``)."""
TORCH_MASTER_PORT = 29500
"""The torch plugin's ``PET_MASTER_PORT`` (v2.3.0 ``pkg/constants/constants.go`` line 72,
``ContainerTrainerPort``)."""
PATCH_MANAGER = "lingo-rl/step-job"
"""The owner of our runtime patch (the webhook wants a domain-prefixed path)."""
SHARED_VOLUME, SHM_VOLUME = "shared", "dshm"
ISTIO_INJECT_ANNOTATION = "sidecar.istio.io/inject"


def _quantities(values: dict[str, str]) -> dict[str, kt.IoK8sApimachineryPkgApiResourceQuantity]:
    return {k: kt.IoK8sApimachineryPkgApiResourceQuantity(v) for k, v in values.items()}


def _env(cluster: ClusterJobConfig) -> list[kt.IoK8sApiCoreV1EnvVar]:
    env = []
    for name, value in cluster.job_env():
        if isinstance(value, str):
            env.append(kt.IoK8sApiCoreV1EnvVar(name=name, value=value))
            continue
        selector = kt.IoK8sApiCoreV1SecretKeySelector(
            name=value.secret, key=value.key, optional=value.optional or None
        )
        source = kt.IoK8sApiCoreV1EnvVarSource(secret_key_ref=selector)
        env.append(kt.IoK8sApiCoreV1EnvVar(name=name, value_from=source))
    if cluster.progress_tracking and PROGRESS_PORT_ENV not in {e.name for e in env}:
        env.append(
            kt.IoK8sApiCoreV1EnvVar(name=PROGRESS_PORT_ENV, value=str(cluster.progress_port))
        )
    return env


def _volumes(cluster: ClusterJobConfig, shm_size: str | None) -> list[kt.IoK8sApiCoreV1Volume]:
    claim = kt.IoK8sApiCoreV1PersistentVolumeClaimVolumeSource(claim_name=cluster.shared_pvc)
    shm = kt.IoK8sApiCoreV1EmptyDirVolumeSource(
        medium="Memory",
        size_limit=kt.IoK8sApimachineryPkgApiResourceQuantity(shm_size) if shm_size else None,
    )
    return [
        kt.IoK8sApiCoreV1Volume(name=SHARED_VOLUME, persistent_volume_claim=claim),
        kt.IoK8sApiCoreV1Volume(name=SHM_VOLUME, empty_dir=shm),
    ]


def _mounts(cluster: ClusterJobConfig) -> list[kt.IoK8sApiCoreV1VolumeMount]:
    return [
        kt.IoK8sApiCoreV1VolumeMount(name=SHARED_VOLUME, mount_path=cluster.shared_mount),
        kt.IoK8sApiCoreV1VolumeMount(name=SHM_VOLUME, mount_path="/dev/shm"),
    ]


def _refuse_pytorchjob_only(cluster: ClusterJobConfig) -> None:
    """Settings a TrainJob cannot carry: fail with the fix rather than drop them."""
    unsupported = {
        "elastic": "elastic training (the Trainer v2.3 torch policy has no elastic policy)",
        "secret_env_from": "whole Secrets as envFrom (a TrainJob takes Secrets key by key: "
        "secret_env)",
        "backoff_limit": "pod restarts (the runtime's Job has backoffLimit 0)",
    }
    for field, what in unsupported.items():
        if getattr(cluster, field):
            raise ValueError(
                f"{field}: a TrainJob cannot carry {what}; unset it or set "
                "cluster.job_api=pytorchjob"
            )


def build_trainjob(name: str, cluster: ClusterJobConfig, module: str, args: list[str]) -> dict:
    """The TrainJob that runs ``python -m module args…`` on ``cluster``'s nodes with the
    ClusterTrainingRuntime ``cluster.runtime``, labelled for Kueue when ``cluster.queue`` is
    set and annotated for OpenShift AI's progress polling when ``cluster.progress_tracking``.

    With two images (``cluster.two_images``) the job references its own TrainingRuntime,
    ``name`` (``build_job_runtime``, created first): ``numNodes`` is the training nodes, whose
    torchrun takes ``--nnodes`` of the whole job; the rollout-only nodes are the runtime's.

    Args:
        name: the job's name (an RFC 1035 label of at most 63 characters; the JobSet and its
            pods are named after it).
        cluster: where and how to run.
        module: the entry point, e.g. ``trainer.sft``.
        args: its arguments; paths must point into ``cluster.shared_mount``.

    Returns:
        The manifest as a JSON-ready dict.

    Raises:
        ValueError: ``cluster`` sets something only a PyTorchJob carries.
    """
    _refuse_pytorchjob_only(cluster)
    pod = kt.TrainerV1alpha1PodSpecPatch(
        containers=[kt.TrainerV1alpha1ContainerPatch(name=NODE, volume_mounts=_mounts(cluster))],
        volumes=_volumes(cluster, cluster.shm_size),
        node_selector=cluster.node_selector or None,
        tolerations=_tolerations(cluster),
        service_account_name=cluster.service_account,
    )
    own_runtime = cluster.two_images
    patch = kt.TrainerV1alpha1RuntimePatch(
        manager=PATCH_MANAGER,
        training_runtime_spec=kt.TrainerV1alpha1TrainingRuntimeSpecPatch(
            template=kt.TrainerV1alpha1JobSetTemplatePatch(
                spec=kt.TrainerV1alpha1JobSetSpecPatch(
                    replicated_jobs=[
                        kt.TrainerV1alpha1ReplicatedJobPatch(
                            name=NODE,
                            template=kt.TrainerV1alpha1JobTemplatePatch(
                                spec=kt.TrainerV1alpha1JobSpecPatch(
                                    template=kt.TrainerV1alpha1PodTemplatePatch(spec=pod)
                                )
                            ),
                        )
                    ]
                )
            )
        ),
    )
    job = kt.TrainerV1alpha1TrainJob(
        api_version=TRAINJOB.api_version,
        kind=TRAINJOB.kind,
        metadata=kt.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=name,
            namespace=cluster.namespace,
            labels=cluster.queue_labels() or None,
            annotations=cluster.progress_annotations() or None,
        ),
        spec=kt.TrainerV1alpha1TrainJobSpec(
            runtime_ref=kt.TrainerV1alpha1RuntimeRef(
                name=name if own_runtime else cluster.runtime,
                kind=JOB_RUNTIME_KIND if own_runtime else RUNTIME_KIND,
                api_group=TRAINJOB.group,
            ),
            trainer=kt.TrainerV1alpha1Trainer(
                image=cluster.image,
                command=entry_point_command(
                    module, args, nnodes=cluster.nodes if own_runtime else None
                ),
                num_nodes=cluster.training_nodes if own_runtime else cluster.nodes,
                num_proc_per_node=cluster.procs_per_node,
                resources_per_node=_resources(cluster),
                env=_env(cluster) or None,
            ),
            runtime_patches=[patch],
            active_deadline_seconds=cluster.active_deadline_seconds,
        ),
    )
    return job.to_dict()


def _resources(cluster: ClusterJobConfig) -> kt.IoK8sApiCoreV1ResourceRequirements:
    """A node's requests and limits (``ClusterJobConfig.resources``)."""
    requests, limits = cluster.resources()
    return kt.IoK8sApiCoreV1ResourceRequirements(
        requests=_quantities(requests), limits=_quantities(limits)
    )


def _tolerations(cluster: ClusterJobConfig) -> list[kt.IoK8sApiCoreV1Toleration] | None:
    return [kt.IoK8sApiCoreV1Toleration(**t.model_dump()) for t in cluster.tolerations] or None


def _node_job(cluster: ClusterJobConfig) -> kt.JobsetV1alpha2ReplicatedJob:
    """The trainers' replicated job ``node``: labelled as the trainer ancestor, so the Trainer
    gives it the TrainJob's image, command, env, resources, ``numNodes`` and ``PET_*``."""
    container = kt.IoK8sApiCoreV1Container(
        name=NODE,
        image=cluster.image,
        command=["python", "-m", "torch.distributed.run"],
        volume_mounts=_mounts(cluster),
    )
    pod = kt.IoK8sApiCoreV1PodTemplateSpec(
        metadata=kt.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            annotations={ISTIO_INJECT_ANNOTATION: "false"}
        ),
        spec=kt.IoK8sApiCoreV1PodSpec(
            containers=[container], volumes=_volumes(cluster, None), restart_policy="Never"
        ),
    )
    return kt.JobsetV1alpha2ReplicatedJob(
        name=NODE,
        template=kt.IoK8sApiBatchV1JobTemplateSpec(
            metadata=kt.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
                labels={ANCESTOR_LABEL: "trainer"}
            ),
            spec=kt.IoK8sApiBatchV1JobSpec(backoff_limit=0, template=pod),
        ),
    )


def sorts_after_trainers(replicated_job: str) -> bool:
    """True when the first pod of ``replicated_job`` sorts after the trainers' first pod,
    ``<job>-node-0-0-<suffix>``, whatever the job's name and the pods' random suffixes.

    OpenShift AI polls a TrainJob's progress from the first pod the API server lists (in
    name order) that is running, ready and has an IP, among those labelled
    ``jobset.sigs.k8s.io/job-index: "0"`` and ``batch.kubernetes.io/job-completion-index:
    "0"`` (opendatahub-io/trainer ``pkg/rhai/progression/progression.go``, ``GetPrimaryPod``,
    lines 116-121 and 155-158). Every replicated job's first pod carries both labels, so the
    trainers' pod must come first by name: JobSet names a pod ``<job>-<replicated job>-<job
    index>-<pod index>-<suffix>``, and the shared ``<job>-`` and the suffix cannot reorder two
    prefixes of which neither starts the other."""
    ours, theirs = f"{NODE}-0-0-", f"{replicated_job}-0-0-"
    return theirs > ours and not theirs.startswith(ours)


def _runtime_spec(
    jobs: list[kt.JobsetV1alpha2ReplicatedJob],
) -> kt.TrainerV1alpha1TrainingRuntimeSpec:
    """The runtime of ``jobs``, the trainers' ``node`` job first.

    Raises:
        ValueError: another job's pods would sort before the trainers' (``sorts_after_trainers``).
    """
    for job in jobs[1:]:
        if not sorts_after_trainers(job.name):
            raise ValueError(
                f"replicated job {job.name!r}: its first pod would sort before the trainers' "
                f"({NODE!r}), so OpenShift AI would poll its progress there; name it so that "
                f"'{job.name}-0-0-' sorts after '{NODE}-0-0-'"
            )
    return kt.TrainerV1alpha1TrainingRuntimeSpec(
        ml_policy=kt.TrainerV1alpha1MLPolicy(
            num_nodes=1, torch=kt.TrainerV1alpha1TorchMLPolicySource()
        ),
        template=kt.TrainerV1alpha1JobSetTemplateSpec(
            spec=kt.JobsetV1alpha2JobSetSpec(replicated_jobs=jobs)
        ),
    )


def build_training_runtime(cluster: ClusterJobConfig) -> dict:
    """The ClusterTrainingRuntime ``cluster.runtime``: torch policy, one replicated job
    ``node`` of ``cluster.image`` with the shared PVC ``cluster.shared_pvc`` at
    ``cluster.shared_mount`` and a memory-backed ``/dev/shm`` (each TrainJob patches the
    claim and the size); no Secrets (each TrainJob names its own, key by key)."""
    runtime = kt.TrainerV1alpha1ClusterTrainingRuntime(
        api_version=TRAINJOB.api_version,
        kind=RUNTIME_KIND,
        metadata=kt.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=cluster.runtime, labels={"trainer.kubeflow.org/framework": "torch"}
        ),
        spec=_runtime_spec([_node_job(cluster)]),
    )
    return runtime.to_dict()


def master_addr(name: str) -> str:
    """The DNS name of TrainJob ``name``'s first training pod, as the torch plugin gives it in
    ``PET_MASTER_ADDR`` (v2.3.0 ``plugins/torch/torch.go`` line 162: ``<job>-node-0-0.<job>``;
    the JobSet's pods are ``<job>-<replicated job>-<job index>-<pod index>`` under the
    subdomain ``<job>``, ``plugins/jobset/jobset.go`` lines 281 and 291)."""
    return f"{name}-{NODE}-0-0.{name}"


def _rollout_job(
    name: str, cluster: ClusterJobConfig, module: str, args: list[str]
) -> kt.JobsetV1alpha2ReplicatedJob:
    """The rollout-only nodes' replicated job: ``cluster.rollout_nodes`` pods of an Indexed
    Job, the rollout image, the training nodes' resources, env, volumes and placement, each
    pod joining the training pods' rendezvous (``cluster.rollout_node``)."""
    layout = RolloutLayout(
        cluster.training_nodes, cluster.rollout_nodes, cluster.procs_per_node,
        master_addr(name), TORCH_MASTER_PORT,
    )  # fmt: skip
    container = kt.IoK8sApiCoreV1Container(
        name=ROLLOUT,
        image=cluster.rollout_image,
        command=layout.command(["-m", module, *args]),
        env=_env(cluster) or None,
        resources=_resources(cluster),
        volume_mounts=_mounts(cluster),
    )
    pod = kt.IoK8sApiCoreV1PodTemplateSpec(
        metadata=kt.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            annotations={ISTIO_INJECT_ANNOTATION: "false"}
        ),
        spec=kt.IoK8sApiCoreV1PodSpec(
            containers=[container],
            volumes=_volumes(cluster, cluster.shm_size),
            restart_policy="Never",
            node_selector=cluster.node_selector or None,
            tolerations=_tolerations(cluster),
            service_account_name=cluster.service_account,
        ),
    )
    nodes = cluster.rollout_nodes
    return kt.JobsetV1alpha2ReplicatedJob(
        name=ROLLOUT,
        replicas=1,
        template=kt.IoK8sApiBatchV1JobTemplateSpec(
            spec=kt.IoK8sApiBatchV1JobSpec(
                backoff_limit=0,
                completion_mode="Indexed",
                completions=nodes,
                parallelism=nodes,
                template=pod,
            ),
        ),
    )


def build_job_runtime(name: str, cluster: ClusterJobConfig, module: str, args: list[str]) -> dict:
    """The TrainingRuntime of a two-image TrainJob ``name`` (same name, its namespace): the
    trainers' ``node`` job as in the shipped runtime (the TrainJob patches it as usual) and the
    ``rollout`` job of ``cluster.rollout_image`` (``_rollout_job``). A TrainJob cannot give a
    replicated job its own image or command (a runtime patch's container takes only env,
    name, securityContext and volumeMounts: the TrainJob CRD's ``ContainerPatch``), so the
    rollout pods' image and command live here, one runtime per job.

    Raises:
        ValueError: ``cluster`` has no second image (``two_images``).
    """
    if not cluster.two_images:
        raise ValueError(
            f"{name}: a job's own runtime is for two images; rollout_image is "
            f"{cluster.rollout_image!r} beside image {cluster.image!r} on "
            f"{cluster.rollout_nodes} rollout-only node(s)"
        )
    runtime = kt.TrainerV1alpha1TrainingRuntime(
        api_version=TRAINJOB.api_version,
        kind=JOB_RUNTIME_KIND,
        metadata=kt.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=name,
            namespace=cluster.namespace,
            labels={"trainer.kubeflow.org/framework": "torch", RUNTIME_OF_LABEL: name},
        ),
        spec=_runtime_spec([_node_job(cluster), _rollout_job(name, cluster, module, args)]),
    )
    return runtime.to_dict()
