"""MLflow tracking for a training step, active only when ``MLFLOW_TRACKING_URI`` is set.

The experiment comes from ``MLFLOW_EXPERIMENT_NAME`` (default ``lingo-rl``). Only global rank 0
logs. mlflow is imported lazily (``mlflow-skinny`` is enough).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "lingo-rl"


def tracking_enabled() -> bool:
    """True when an MLflow tracking URI is configured in the environment."""
    return bool(os.environ.get("MLFLOW_TRACKING_URI"))


@contextmanager
def mlflow_run(run_name: str, params: Mapping[str, object], is_main: bool = True) -> Iterator:
    """An MLflow run for one step (nested under an active run), or None when disabled."""
    if not (is_main and tracking_enabled()):
        yield None
        return
    import mlflow

    mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT))
    nested = mlflow.active_run() is not None
    with mlflow.start_run(run_name=run_name, nested=nested) as run:
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        yield run


def log_metrics(values: Mapping[str, float | int | None], step: int) -> None:
    """Log the numeric values to the active MLflow run."""
    import mlflow

    numeric = {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
    mlflow.log_metrics(numeric, step=step)


def log_artifact(path: str | Path) -> None:
    """Upload a file to the active MLflow run, if tracking is on and a run is active."""
    if not tracking_enabled():
        return
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_artifact(str(path))
