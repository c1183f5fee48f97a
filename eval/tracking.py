"""Log an eval run to MLflow when ``MLFLOW_TRACKING_URI`` is set (``mlflow-skinny`` is enough).

The run (see ``trainer.tracking.mlflow_run``: nested under the pipeline's run when there is
one) holds the sampling parameters and model locations as params,
``eval.report.kfp_metrics`` as metrics, and ``results.json``, ``report.md``, ``report.html``
as artifacts under ``eval/``.
"""

from __future__ import annotations

import logging

from eval.report import ReportPaths, kfp_metrics
from trainer.tracking import log_artifact, log_metrics, mlflow_run, tracking_enabled

log = logging.getLogger(__name__)

__all__ = ["log_eval_run", "tracking_enabled"]


def _metric_key(name: str) -> str:
    return name.replace("-vs-", "_vs_")


def log_eval_run(results: dict, paths: ReportPaths, run_name: str = "eval") -> str | None:
    """Log the eval to MLflow; returns the run id, or ``None`` when tracking is off."""
    params = {f"sampling.{k}": v for k, v in results["sampling"].items()}
    params.update({f"model.{m['label']}": m["location"] for m in results["models"]})
    params["questions_sha256"] = results["questions_sha256"]
    with mlflow_run(run_name, params) as run:
        if run is None:
            return None
        log_metrics({_metric_key(k): v for k, v in kfp_metrics(results).items()})
        for path in (paths.results, paths.markdown, paths.html):
            log_artifact(path, artifact_path="eval")
        log.info("eval logged to MLflow run %s", run.info.run_id)
        return run.info.run_id
