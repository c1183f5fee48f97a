"""KFP component: GRPO on the SFT-merged model."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from components.images import GPU_IMAGE


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
):
    """GRPO with the language-compliance reward; exports the policy as a HF directory. Trains
    in this pod, or as a PyTorchJob (``execution.mode = pytorchjob``; YAML in ``job_manifest``)."""
    import logging
    from pathlib import Path

    from components.images import GPU_IMAGE
    from trainer.cluster.config import ExecutionConfig, JobLaunch
    from trainer.grpo.config import GRPOConfig
    from trainer.grpo.step import grpo_metrics, render_grpo_html, run_grpo_step
    from trainer.tracking import configure_tracking

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    configure_tracking(mlflow_tracking_uri, mlflow_parent_run_id)
    cfg = GRPOConfig.model_validate(config)
    launch = JobLaunch(
        ExecutionConfig.model_validate(execution), pipeline_run_id, job_manifest.path, GPU_IMAGE
    )
    if not launch.as_job:
        Path(job_manifest.path).write_text("# trained in the pipeline step's own pod\n")
    result = run_grpo_step(
        cfg, sft_model.path, train_data.path, eval_data.path, model.path, training_log.path,
        launch,
    )  # fmt: skip
    for name, value in grpo_metrics(result).items():
        metrics.log_metric(name, value)
    Path(report.path).write_text(render_grpo_html(result))
    model.metadata.update(format="huggingface", exported_step=result.exported_step)
    job_manifest.metadata.update(mode=launch.execution.mode)
