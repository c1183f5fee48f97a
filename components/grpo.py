"""KFP components: GRPO on the SFT-merged model (``grpo``), and the same function in the
Megatron image (``grpo_megatron``) for the pipeline's Megatron branch."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from components.images import GPU_IMAGE, MEGATRON_IMAGE


@dsl.component(base_image=GPU_IMAGE, install_kfp_package=False)
def grpo(
    train_data: Input[Dataset],
    eval_data: Input[Dataset],
    sft_model: Input[Model],
    config: dict,
    model: Output[Model],
    metrics: Output[Metrics],
    report: Output[HTML],
    training_log: Output[Artifact],
    job_manifest: Output[Artifact],
    execution: dict = {},  # noqa: B006 (KFP reads the default; never mutated)
    pipeline_run_id: str = "",
    mlflow_tracking_uri: str = "",
    mlflow_parent_run_id: str = "",
    backend: str = "",
    megatron_checkpoint: Input[Model] = None,
    megatron_layout: dict = {},  # noqa: B006 (KFP reads the default; never mutated)
    megatron_optim: dict = {},  # noqa: B006 (KFP reads the default; never mutated)
    gpu_image: str = "",
    megatron_image: str = "",
):
    """GRPO with the language-compliance reward. Trains in this pod, or as a TrainJob or a
    PyTorchJob (``execution.mode = job``; YAML in ``job_manifest``).

    ``backend`` overrides ``config.optim.backend``. With ``megatron``, the actor starts from
    ``megatron_checkpoint`` (``convert_megatron``'s output) with ``megatron_layout`` (unless
    the config names one), ``megatron_optim`` (when given) is the optimizer block in place of
    the config's DeepSpeed one (``trainer.grpo.config.branch_config``), and ``model``
    is the policy's Megatron checkpoint, for ``export_hf``; otherwise ``model`` is the policy
    as a HF directory.

    A job's trainers run ``megatron_image`` on Megatron, else ``gpu_image``, and dedicated
    rollout engines ``gpu_image`` (defaults: ``components.images``).
    """
    from pathlib import Path

    from cluster.config import JobLaunch
    from components.images import GPU_IMAGE, MEGATRON_IMAGE
    from core.processes import start_step_process
    from core.tracking import configure_tracking
    from trainer.grpo.config import GRPOConfig, branch_config
    from trainer.grpo.step import grpo_metrics, render_grpo_html, run_grpo_step

    start_step_process()  # dies with its parent; every log line redacted
    configure_tracking(mlflow_tracking_uri, mlflow_parent_run_id)
    checkpoint = megatron_checkpoint.path if megatron_checkpoint is not None else None
    config = branch_config(config, backend, megatron_layout, checkpoint, megatron_optim)
    cfg = GRPOConfig.model_validate(config)
    trainer = cfg.optim.trainer
    if trainer.needs_conversion and checkpoint is None:
        raise ValueError(f"backend {trainer.name!r} needs megatron_checkpoint (convert_megatron's)")
    gpu_image = gpu_image or GPU_IMAGE
    # by plan.TrainerSpec.image, as components.images.TRAINER_IMAGES with this run's images
    image = {"gpu": gpu_image, "megatron": megatron_image or MEGATRON_IMAGE}[trainer.image]
    # dedicated engines run vLLM, which only the GPU image holds (docs/megatron.md)
    launch = JobLaunch.for_step(execution, pipeline_run_id, job_manifest.path, image, gpu_image)
    result = run_grpo_step(
        cfg, sft_model.path, train_data.path, eval_data.path, model.path, training_log.path,
        launch,
    )  # fmt: skip
    for name, value in grpo_metrics(result).items():
        metrics.log_metric(name, value)
    Path(report.path).write_text(render_grpo_html(result))
    model.metadata.update(format=trainer.weight_format, exported_step=result.exported_step)
    job_manifest.metadata.update(mode=launch.execution.mode)


grpo_megatron = dsl.component(base_image=MEGATRON_IMAGE, install_kfp_package=False)(
    grpo.python_func
)
"""``grpo`` in the Megatron image (its tasks are named ``grpo-2``… by the compiler)."""
