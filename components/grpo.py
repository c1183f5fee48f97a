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
):
    """GRPO with the language-compliance reward; exports the policy as a HF directory."""
    import logging
    from pathlib import Path

    from trainer.grpo.config import GRPOConfig
    from trainer.grpo.step import grpo_metrics, render_grpo_html, run_grpo_step

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = GRPOConfig.model_validate(config)
    result = run_grpo_step(
        cfg, sft_model.path, train_data.path, eval_data.path, model.path, training_log.path
    )
    for name, value in grpo_metrics(result).items():
        metrics.log_metric(name, value)
    Path(report.path).write_text(render_grpo_html(result))
    model.metadata.update(format="huggingface", exported_step=result.exported_step)
