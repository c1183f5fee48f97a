"""KFP component: the data-prep step (see data_prep/prepare.py)."""

from kfp import dsl
from kfp.dsl import Dataset, Markdown, Metrics, Output

from components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def data_prep(
    config: dict,
    train_data: Output[Dataset],
    eval_data: Output[Dataset],
    quarantine: Output[Dataset],
    metrics: Output[Metrics],
    card: Output[Markdown],
    mlflow_tracking_uri: str = "",
    mlflow_parent_run_id: str = "",
) -> str:
    """Validate, label and render Multilingual-Thinking rows into train/eval JSONL
    (``config``: a ``DataPrepConfig``); returns the data fingerprint of what it read
    (``data_prep.fingerprint``), also in the card, the MLflow run and the datasets' metadata.
    Never served from cache (the pipeline sets caching off: its source can change)."""
    from core.processes import start_step_process
    from core.tracking import configure_tracking, log_artifact, log_metrics, mlflow_run
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset

    start_step_process()  # dies with its parent; every log line redacted
    config = DataPrepConfig.model_validate(config)
    configure_tracking(mlflow_tracking_uri, mlflow_parent_run_id)
    with mlflow_run("data-prep", config.model_dump()) as run:
        report = prepare_dataset(
            config, train_data.path, eval_data.path, quarantine.path, card.path
        )
        if run is not None:
            log_metrics(report.metrics())
            import mlflow

            mlflow.set_tag("lingo.data_fingerprint", report.fingerprint.sha256)
            log_artifact(card.path, artifact_path="data-prep")
    for name, value in report.metrics().items():
        metrics.log_metric(name, value)
    train_data.metadata.update(
        rows=report.train_rows + report.synthetic_rows + report.prompt_only_rows,
        synthetic_rows=report.synthetic_rows,
        prompt_only_rows=report.prompt_only_rows,
        format="jsonl",
        data_fingerprint=report.fingerprint.sha256,
    )
    eval_data.metadata.update(
        rows=report.eval_rows, format="jsonl", data_fingerprint=report.fingerprint.sha256
    )
    quarantine.metadata.update(rows=report.quarantined, format="jsonl")
    return report.fingerprint.sha256


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def data_check(
    data_fingerprint: str,
    gate_config: dict,
    mlflow_tracking_uri: str = "",
) -> str:
    """``retrain``, or ``unchanged data`` when the data fingerprint equals the champion's
    (and ``gate_config.force`` is off): the later steps run only on ``retrain``."""
    from core.processes import start_step_process
    from core.tracking import configure_tracking
    from eval.eval_step import run_data_check_step

    start_step_process()  # dies with its parent; every log line redacted
    configure_tracking(mlflow_tracking_uri)
    return run_data_check_step(data_fingerprint, gate_config)
