"""KFP components: the base model, and SFT (LoRA + merge)."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from components.images import CPU_IMAGE, GPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def base_model(source: str, tiny_config: dict, model: Output[Model]):
    """The base model as a HF directory: the tiny GPT-OSS, a local copy or a hub download."""
    import logging

    from trainer.base_model import materialize_base_model
    from trainer.tiny_model import TinyModelConfig

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
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
):
    """LoRA (or full) SFT on the train split, merged into the base weights."""
    import logging
    from pathlib import Path

    from trainer.sft.config import SFTConfig
    from trainer.sft.step import render_sft_html, run_sft_step, sft_metrics

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = SFTConfig.model_validate(config)
    result = run_sft_step(
        cfg, base_model.path, train_data.path, eval_data.path, model.path, training_log.path
    )
    for name, value in sft_metrics(result).items():
        metrics.log_metric(name, value)
    Path(loss_plot.path).write_text(render_sft_html(result))
    model.metadata.update(format="huggingface", merged_adapter=result.merge["merged_adapter"])


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def capacity_check(
    base_model: Input[Model], layout: str, overrides: dict, report: Output[Markdown]
):
    """Fail fast, before any heavy step, when the layout cannot hold the model (the table is in
    the report and in the error)."""
    import logging
    from pathlib import Path

    from trainer.planner import LayoutDoesNotFit, check_layout, format_table

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = check_layout(base_model.path, layout, {k: str(v) for k, v in overrides.items()})
    except LayoutDoesNotFit as exc:
        Path(report.path).write_text(f"# Capacity check: does not fit\n\n```\n{exc.table}\n```\n")
        raise
    Path(report.path).write_text(
        f"# Capacity check: {result.verdict.value}\n\n```\n{format_table(result)}\n```\n"
    )
