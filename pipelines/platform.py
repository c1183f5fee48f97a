"""Kubernetes platform settings for the pipeline's tasks (issue #7, platform config).

``ClusterSettings`` says, as typed data, where and how each step runs on a cluster: the shared
workspace volume, which Kubernetes Secrets become environment variables, GPUs, node selectors,
tolerations, CPU/memory, caching and retries. ``apply_platform(task, step, settings)`` turns it
into ``kfp.kubernetes`` calls and the task's own resource/caching/retry setters at compile time.

Secret *names* are compile-time constants from the settings, never pipeline parameters
(kubeflow/pipelines#11395); secret *values* are never read: only the name, the key and the
environment variable they land in are written into the compiled YAML.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from cluster.nodes import NODE_TYPES, OMP_THREADS_ENV, cpu_cores, omp_threads
from core.config_model import ConfigModel

if TYPE_CHECKING:
    from kfp.dsl import PipelineTask

STEPS = (
    "configure",
    "start-tracking",
    "data-prep",
    "data-check",
    "base-model",
    "capacity-check",
    "sft",
    "grpo",
    "convert-megatron",
    "export-hf",
    "champion",
    "evaluate",
    "gate",
    "register",
    "publish",
    "deploy",
    "finalize",
)
"""The task names of ``lingo_pipeline``; ``apply_platform`` refuses any other step."""


class SecretEnv(ConfigModel):
    """One Kubernetes Secret exposed as environment variables (by name and key only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret_name: str
    key_to_env: dict[str, str]
    """Secret data key → environment variable name, e.g. ``{"token": "HF_TOKEN"}``."""
    steps: tuple[str, ...] | None = None
    """Steps that get this secret; ``None`` means every step."""
    optional: bool = False
    """The task (and its job) starts without the variables when the Secret or a key is
    missing; a step that needs them fails naming them (kfp-kubernetes ``use_secret_as_env``
    ``optional``, a ``secretKeyRef.optional`` in the pod)."""


class Toleration(ConfigModel):
    """A pod toleration (Kubernetes ``Toleration``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class StepResources(ConfigModel):
    """Resources and placement of one class of steps (CPU steps or GPU steps)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_request: str | None = None
    cpu_limit: str | None = None
    memory_request: str | None = None
    memory_limit: str | None = None
    accelerator_type: str | None = None
    """Resource name of the accelerator, e.g. ``nvidia.com/gpu``."""
    accelerator_count: int = Field(default=0, ge=0)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()

    @field_validator("cpu_request", "cpu_limit")
    @classmethod
    def _cpu_quantity(cls, cpu: str | None) -> str | None:
        if cpu is not None:
            cpu_cores(cpu)
        return cpu

    @model_validator(mode="after")
    def _accelerator_pair(self) -> StepResources:
        if (self.accelerator_type is None) != (self.accelerator_count == 0):
            raise ValueError(
                "accelerator_type and accelerator_count go together: set both "
                f"(got type={self.accelerator_type!r}, count={self.accelerator_count})"
            )
        return self


class RetryPolicy(ConfigModel):
    """KFP task retries for the steps that talk to the network."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: tuple[str, ...] = ()
    num_retries: int = Field(default=3, ge=1)
    backoff_duration: str = "30s"
    backoff_factor: float = 2.0
    backoff_max_duration: str = "600s"


class ClusterSettings(ConfigModel):
    """Where and how every step runs on Kubernetes. The defaults apply nothing (``local``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    workspace_pvc: str | None = None
    """Existing ReadWriteMany PVC for weights and checkpoints shared between steps."""
    workspace_mount: str = "/mnt/shared"
    secrets: tuple[SecretEnv, ...] = ()
    gpu_steps: tuple[str, ...] = ()
    """Steps that get ``gpu`` resources; every other step gets ``cpu``."""
    cpu: StepResources = StepResources()
    gpu: StepResources = StepResources()
    caching: dict[str, bool] = Field(default_factory=dict)
    """Step → KFP caching on/off; steps not listed keep the compiler's default."""
    retry: RetryPolicy = RetryPolicy()
    image_pull_policy: Literal["Always", "Never", "IfNotPresent"] | None = None
    training_jobs: bool = False
    """SFT and GRPO launch training jobs (``ExecutionConfig`` mode ``job``): their pipeline
    pods only orchestrate and get ``cpu`` resources; the exit handler deletes the run's jobs
    that are still active."""

    @model_validator(mode="after")
    def _known_steps(self) -> ClusterSettings:
        named = {
            "gpu_steps": self.gpu_steps,
            "caching": tuple(self.caching),
            "retry.steps": self.retry.steps,
        }
        for secret in self.secrets:
            named[f"secrets[{secret.secret_name}].steps"] = secret.steps or ()
        for field, steps in named.items():
            unknown = sorted(set(steps) - set(STEPS))
            if unknown:
                raise ValueError(f"{field} names unknown steps {unknown}; known: {list(STEPS)}")
        return self


def apply_platform(task: PipelineTask, step: str, settings: ClusterSettings) -> PipelineTask:
    """Apply the cluster settings of ``step`` to a pipeline task.

    Args:
        task: The task, as returned by calling a component inside the pipeline function.
        step: The step's name in ``STEPS`` (the task name, e.g. ``"sft"``).
        settings: The cluster settings; ``PLATFORM_PRESETS["local"]`` changes nothing.

    Returns:
        The same task, for chaining.

    Raises:
        ValueError: If ``step`` is not one of ``STEPS``.
    """
    from kfp import kubernetes  # compile time only: a step's runtime kfp has no kfp.kubernetes

    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}: apply_platform knows {list(STEPS)}")
    if settings.workspace_pvc:
        kubernetes.mount_pvc(
            task, pvc_name=settings.workspace_pvc, mount_path=settings.workspace_mount
        )
    for secret in settings.secrets:
        if secret.steps is None or step in secret.steps:
            kubernetes.use_secret_as_env(
                task,
                secret_name=secret.secret_name,
                secret_key_to_env=dict(secret.key_to_env),
                optional=secret.optional,
            )
    on_gpu = step in settings.gpu_steps and not (settings.training_jobs and step in JOB_STEPS)
    _apply_resources(task, settings.gpu if on_gpu else settings.cpu)
    if step in settings.caching:
        task.set_caching_options(enable_caching=settings.caching[step])
    if step in settings.retry.steps:
        task.set_retry(
            num_retries=settings.retry.num_retries,
            backoff_duration=settings.retry.backoff_duration,
            backoff_factor=settings.retry.backoff_factor,
            backoff_max_duration=settings.retry.backoff_max_duration,
        )
    if settings.image_pull_policy:
        kubernetes.set_image_pull_policy(task, settings.image_pull_policy)
    return task


def job_defaults(settings: ClusterSettings, step: str) -> dict:
    """``ClusterJobConfig`` fields a training job of ``step`` takes from the platform: the same
    workspace volume (so staged inputs are visible) and the same Secrets, by name (optional
    where the platform's are)."""
    if not settings.workspace_pvc:
        return {}
    secret_env = [
        {"name": env, "secret": secret.secret_name, "key": key, "optional": secret.optional}
        for secret in settings.secrets
        if secret.steps is None or step in secret.steps
        for key, env in secret.key_to_env.items()
    ]
    return {
        "shared_pvc": settings.workspace_pvc,
        "shared_mount": settings.workspace_mount,
        "secret_env": secret_env,
    }


def with_platform(settings: ClusterSettings) -> Callable[[PipelineTask, str], PipelineTask]:
    """Bind the settings once, so the pipeline writes ``platform(task, "sft")`` per task.

    Args:
        settings: The cluster settings to apply.

    Returns:
        A function ``(task, step) -> task`` that calls ``apply_platform``.
    """

    def platform(task: PipelineTask, step: str) -> PipelineTask:
        return apply_platform(task, step, settings)

    return platform


def _apply_resources(task: PipelineTask, resources: StepResources) -> None:
    from kfp import kubernetes

    if resources.cpu_request:
        task.set_cpu_request(resources.cpu_request)
        # a pipeline pod runs one process: its thread pools get the CPUs it requested (a
        # step that starts torchrun itself divides them, ``cluster.torchrun``)
        task.set_env_variable(OMP_THREADS_ENV, str(omp_threads(resources.cpu_request, 1)))
    if resources.cpu_limit:
        task.set_cpu_limit(resources.cpu_limit)
    if resources.memory_request:
        task.set_memory_request(resources.memory_request)
    if resources.memory_limit:
        task.set_memory_limit(resources.memory_limit)
    if resources.accelerator_type:
        task.set_accelerator_type(resources.accelerator_type)
        task.set_accelerator_limit(resources.accelerator_count)
    for label, value in resources.node_selector.items():
        kubernetes.add_node_selector(task, label_key=label, label_value=value)
    for toleration in resources.tolerations:
        kubernetes.add_toleration(
            task,
            key=toleration.key,
            operator=toleration.operator,
            value=toleration.value,
            effect=toleration.effect,
        )


# Secret names and keys are conventions of our clusters; values live only in the cluster. All
# optional: a run that reads no S3, tracks to no MLflow server and pulls no gated model needs
# none of them (`lingo cluster setup` creates those whose variables are set where it runs).
DEFAULT_SECRETS = (
    SecretEnv(
        secret_name="lingo-s3",
        key_to_env={
            "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
            "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL",
        },
        optional=True,
    ),
    SecretEnv(
        secret_name="lingo-mlflow",
        key_to_env={
            "MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI",
            "MLFLOW_TRACKING_TOKEN": "MLFLOW_TRACKING_TOKEN",
        },
        optional=True,
    ),
    SecretEnv(
        secret_name="lingo-hf",
        key_to_env={"HF_TOKEN": "HF_TOKEN"},
        steps=("data-prep", "base-model", "evaluate"),
        optional=True,
    ),
)
GPU_STEPS = ("sft", "grpo", "convert-megatron", "export-hf", "evaluate")
JOB_STEPS = ("sft", "grpo")
"""Steps that can run their training as a job (TrainJob or PyTorchJob)."""
NETWORK_STEPS = (
    "start-tracking", "data-prep", "data-check", "base-model", "champion", "evaluate",
    "register", "publish",
)  # fmt: skip
# the capacity check is a pure function of its inputs; data prep reads a source that can
# change under the same name (a hub id, an S3 prefix, a folder), the data check and the
# champion read the registry's alias, training, eval, the gate (reads the current champion)
# and register (side effects): these always run
CLUSTER_CACHING = {
    "configure": True,
    "data-prep": False,
    "data-check": False,
    "champion": False,
    "capacity-check": True,
    "base-model": False,
    "sft": False,
    "grpo": False,
    "convert-megatron": True,
    "export-hf": False,
    "evaluate": False,
    "gate": False,
    "register": False,
    "start-tracking": False,
    "publish": False,
    "deploy": False,
    "finalize": False,
}
CPU_STEP = StepResources(cpu_request="2", cpu_limit="8", memory_request="8Gi", memory_limit="32Gi")
GPU_TOLERATION = Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


def _aws_gpu_preset(
    instance_type: str, cpu: tuple[str, str], memory: tuple[str, str]
) -> ClusterSettings:
    """The platform of a GPU node type (``cluster.nodes.NODE_TYPES``)."""
    node = NODE_TYPES[instance_type]
    gpu_product, gpus = node.gpu_product, node.gpus
    return ClusterSettings(
        name=instance_type,
        description=(
            f"{gpus}x {gpu_product} per node ({instance_type}); SFT and GRPO run as "
            "TrainJobs or PyTorchJobs over several nodes, eval takes a node."
        ),
        workspace_pvc="lingo-workspace",
        secrets=DEFAULT_SECRETS,
        gpu_steps=GPU_STEPS,
        cpu=CPU_STEP,
        gpu=StepResources(
            cpu_request=cpu[0],
            cpu_limit=cpu[1],
            memory_request=memory[0],
            memory_limit=memory[1],
            accelerator_type="nvidia.com/gpu",
            accelerator_count=gpus,
            node_selector={
                "nvidia.com/gpu.product": gpu_product,
                "node.kubernetes.io/instance-type": instance_type,
            },
            tolerations=(GPU_TOLERATION,),
        ),
        caching=CLUSTER_CACHING,
        retry=RetryPolicy(steps=NETWORK_STEPS),
        image_pull_policy="IfNotPresent",
        training_jobs=True,
    )


PLATFORM_PRESETS: dict[str, ClusterSettings] = {
    "local": ClusterSettings(name="local", description="kfp.local / laptop: applies nothing."),
    # 48 vCPU, 192 GiB, 4x A10G 24 GB: leave room for the kubelet and daemonsets
    "g5.12xlarge": _aws_gpu_preset("g5.12xlarge", ("40", "46"), ("160Gi", "180Gi")),
    # 192 vCPU, 2 TiB, 8x H100 80 GB
    "p5.48xlarge": _aws_gpu_preset("p5.48xlarge", ("176", "188"), ("1800Gi", "1900Gi")),
    # 192 vCPU, 2 TiB, 8x H200 141 GB
    "p5en.48xlarge": _aws_gpu_preset("p5en.48xlarge", ("176", "188"), ("1800Gi", "1900Gi")),
}


def get_platform(name: str) -> ClusterSettings:
    """Return the named platform preset.

    Args:
        name: One of ``PLATFORM_PRESETS``.

    Returns:
        The settings.

    Raises:
        KeyError: If no preset has that name (the message lists the known ones).
    """
    if name not in PLATFORM_PRESETS:
        raise KeyError(f"unknown platform preset {name!r}; known: {sorted(PLATFORM_PRESETS)}")
    return PLATFORM_PRESETS[name]
