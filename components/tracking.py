"""KFP components around the whole run: the MLflow parent run, publishing, and the exit handler.

``start_tracking`` opens one MLflow run for the pipeline run (tagged with the KFP run id; a
retry finds it again) and returns its id, which every step nests its own run under. ``publish``
copies the GRPO model and the eval reports to object storage. ``finalize`` is the pipeline's
exit handler: it runs whatever happened to the steps, deletes the run's training jobs that are
still active (a cancelled run), and closes the MLflow run with the pipeline's final state.
"""

from kfp import dsl
from kfp.dsl import Artifact, Input, Markdown, Model

from components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def start_tracking(
    pipeline_run_id: str,
    pipeline_run_name: str,
    data_source: str,
    model_source: str,
    hardware: dict,
    sft_config: dict,
    grpo_config: dict,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "",
) -> str:
    """The pipeline run's MLflow run id ("" when no tracking URI is set); its params are the
    sources, the hardware and the SFT/GRPO configs (flattened, ``sft.optim.learning_rate``)."""
    from core.processes import start_step_process
    from core.tracking import configure_tracking, start_pipeline_run

    start_step_process()  # dies with its parent; every log line redacted
    configure_tracking(mlflow_tracking_uri, experiment=mlflow_experiment)

    def flatten(prefix: str, value) -> dict:
        if not isinstance(value, dict):
            return {prefix: value}
        out = {}
        for key, item in value.items():
            out.update(flatten(f"{prefix}.{key}", item))
        return out

    params = {"data_source": data_source, "model_source": model_source}
    params |= flatten("hardware", hardware)
    params |= flatten("sft", sft_config) | flatten("grpo", grpo_config)
    return start_pipeline_run(pipeline_run_id, pipeline_run_name or pipeline_run_id, params) or ""


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def publish(
    grpo_model: Input[Model],
    eval_results: Input[Artifact],
    eval_report: Input[Markdown],
    export_uri: str,
    pipeline_run_id: str,
) -> str:
    """Upload the GRPO model and the eval results to ``<export_uri>/<run id>/`` (multipart,
    checksummed, manifest last); returns that prefix."""
    from pathlib import Path

    from core.processes import start_step_process
    from core.storage import upload_dir, upload_file

    start_step_process()  # dies with its parent; every log line redacted
    prefix = f"{export_uri.rstrip('/')}/{pipeline_run_id}"
    upload_dir(grpo_model.path, f"{prefix}/grpo-model/")
    results = Path(eval_results.path)
    if results.is_dir():
        upload_dir(results, f"{prefix}/eval/")
    else:
        upload_file(results, f"{prefix}/eval/results.json")
    upload_file(eval_report.path, f"{prefix}/eval/report.md")
    return prefix


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def finalize(
    status: dsl.PipelineTaskFinalStatus,
    pipeline_run_id: str,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "",
    delete_jobs: bool = False,
):
    """Exit handler: delete this run's active training jobs (TrainJobs, PyTorchJobs), close
    the MLflow run (found by its ``lingo.pipeline_run_id`` tag: an exit task cannot take other
    tasks' outputs)."""
    import logging

    from core.processes import start_step_process
    from core.tracking import (
        TrackingUnreachableError,
        configure_tracking,
        find_pipeline_run,
        finish_pipeline_run,
    )

    start_step_process()  # dies with its parent; every log line redacted
    log = logging.getLogger("finalize")
    log.info("pipeline run %s ended: %s", pipeline_run_id, status.state)
    if delete_jobs:
        from kubernetes.client import ApiException

        from cluster.launcher import JobLauncher
        from cluster.step_job import current_namespace, delete_run_jobs

        try:
            deleted = delete_run_jobs(JobLauncher(current_namespace()), pipeline_run_id)
            log.info("deleted training jobs still running: %s", deleted or "none")
        except ApiException as error:  # e.g. 403: the pipeline's service account may not list
            log.warning("cannot clean up training jobs (%s %s)", error.status, error.reason)
    configure_tracking(mlflow_tracking_uri, experiment=mlflow_experiment)
    try:
        parent_run_id = find_pipeline_run(pipeline_run_id)
    except TrackingUnreachableError as error:  # said once, fast; the run's own state stands
        log.warning("MLflow run not closed: %s", error)
        parent_run_id = None
    if parent_run_id:
        finish_pipeline_run(parent_run_id, status.state, status.error_message or "")
