"""Log an eval run to MLflow when ``MLFLOW_TRACKING_URI`` is set (``mlflow-skinny`` is enough).

The run (experiment ``MLFLOW_EXPERIMENT_NAME``, default ``lingo-rl``; nested under an active
run) holds the sampling parameters and model locations as params, ``eval.report.kfp_metrics``
as metrics, and ``results.json``, ``report.md``, ``report.html`` as artifacts under ``eval/``.
"""

from __future__ import annotations

import logging
import os

from eval.report import ReportPaths, kfp_metrics

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "lingo-rl"


def tracking_enabled() -> bool:
    """True when an MLflow tracking URI is configured in the environment."""
    return bool(os.environ.get("MLFLOW_TRACKING_URI"))


def _metric_key(name: str) -> str:
    return name.replace("-vs-", "_vs_")


def log_eval_run(results: dict, paths: ReportPaths, run_name: str = "eval") -> str | None:
    """Log the eval to MLflow; returns the run id, or ``None`` when tracking is off."""
    if not tracking_enabled():
        return None
    import mlflow

    mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT))
    nested = mlflow.active_run() is not None
    with mlflow.start_run(run_name=run_name, nested=nested) as run:
        params = {f"sampling.{k}": v for k, v in results["sampling"].items()}
        params.update({f"model.{m['label']}": m["location"] for m in results["models"]})
        params["questions_sha256"] = results["questions_sha256"]
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        mlflow.log_metrics({_metric_key(k): v for k, v in kfp_metrics(results).items()})
        for path in (paths.results, paths.markdown, paths.html):
            mlflow.log_artifact(str(path), artifact_path="eval")
        log.info("eval logged to MLflow run %s", run.info.run_id)
        return run.info.run_id
