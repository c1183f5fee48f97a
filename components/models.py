"""KFP components: the base model, and SFT (LoRA + merge)."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from components.images import CPU_IMAGE, GPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def base_model(source: str, tiny_config: dict, model: Output[Model]):
    """The base model as a HF directory: the tiny GPT-OSS, a local copy, an ``s3://`` prefix
    (``AWS_ENDPOINT_URL`` for S3-compatible stores) or a hub download."""
    from core.processes import start_step_process
    from trainer.base_model import materialize_base_model
    from trainer.tiny_model import TinyModelConfig

    start_step_process()  # dies with its parent; every log line redacted
    materialize_base_model(source, model.path, TinyModelConfig.model_validate(tiny_config))
    model.metadata.update(source=source, format="huggingface")


@dsl.component(base_image=GPU_IMAGE, install_kfp_package=False)
def sft(
    train_data: Input[Dataset],
    eval_data: Input[Dataset],
    base_model: Input[Model],
    config: dict,
    model: Output[Model],
    metrics: Output[Metrics],
    loss_plot: Output[HTML],
    training_log: Output[Artifact],
    job_manifest: Output[Artifact],
    execution: dict = {},  # noqa: B006 (KFP reads the default; never mutated)
    pipeline_run_id: str = "",
    mlflow_tracking_uri: str = "",
    mlflow_parent_run_id: str = "",
    gpu_image: str = "",
):
    """LoRA (or full) SFT on the train split, merged into the base weights; in this pod, or
    as a TrainJob or a PyTorchJob (``execution.mode = job``; its YAML is ``job_manifest``) of
    ``gpu_image`` (default: ``components.images.GPU_IMAGE``)."""
    from pathlib import Path

    from cluster.config import JobLaunch
    from components.images import GPU_IMAGE
    from core.processes import start_step_process
    from core.tracking import configure_tracking
    from trainer.sft.config import SFTConfig
    from trainer.sft.step import render_sft_html, run_sft_step, sft_metrics

    start_step_process()  # dies with its parent; every log line redacted
    configure_tracking(mlflow_tracking_uri, mlflow_parent_run_id)
    cfg = SFTConfig.model_validate(config)
    image = gpu_image or GPU_IMAGE
    launch = JobLaunch.for_step(execution, pipeline_run_id, job_manifest.path, image)
    result = run_sft_step(
        cfg, base_model.path, train_data.path, eval_data.path, model.path, training_log.path,
        launch,
    )  # fmt: skip
    for name, value in sft_metrics(result).items():
        metrics.log_metric(name, value)
    Path(loss_plot.path).write_text(render_sft_html(result))
    model.metadata.update(format="huggingface", merged_adapter=result.merge["merged_adapter"])
    job_manifest.metadata.update(mode=launch.execution.mode)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def capacity_check(
    base_model: Input[Model],
    hardware: dict,
    overrides: dict,
    sft_config: dict,
    grpo_config: dict,
    sft_execution: dict,
    grpo_execution: dict,
    report: Output[Markdown],
    backend: str = "",
    megatron_layout: dict = {},  # noqa: B006 (KFP reads the default; never mutated)
    megatron_optim: dict = {},  # noqa: B006 (KFP reads the default; never mutated)
):
    """Fail fast, before any heavy step, when the run cannot fit: SFT and GRPO as configured
    (processes, placement plan, batch, lengths) on ``hardware`` (a ``Hardware``) (the tables and the
    GRPO placement plan are in the report, the tables in the error); GRPO as the pipeline's
    ``backend`` branch runs it (``megatron``: Megatron-Core with ``megatron_layout`` and
    ``megatron_optim``)."""
    from pathlib import Path

    from capacity import LayoutDoesNotFit
    from core.processes import start_step_process
    from trainer.capacity_check import check_run

    start_step_process()  # dies with its parent; every log line redacted
    text, failing = check_run(
        base_model.path, hardware, sft_config, grpo_config, sft_execution, grpo_execution,
        {k: str(v) for k, v in overrides.items()}, backend, megatron_layout, megatron_optim,
    )  # fmt: skip
    Path(report.path).write_text(text)
    if failing is not None:
        raise LayoutDoesNotFit(failing, text)
