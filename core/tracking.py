"""MLflow tracking, active only when ``MLFLOW_TRACKING_URI`` is set (``mlflow-skinny`` is enough).

One pipeline run is one MLflow run (the *parent*, created by the pipeline's first task,
``start_pipeline_run``, tagged with the KFP run id and closed by the exit handler,
``finish_pipeline_run``); every step logs into a run nested under it. The parent's id reaches
the steps as a component argument, which they put in ``MLFLOW_PARENT_RUN_ID``; torchrun workers
and PyTorchJob pods inherit it. Without a parent (a step run on its own), a step's run is
top-level. The experiment comes from ``MLFLOW_EXPERIMENT_NAME`` (default ``lingo-rl``). Only
global rank 0 logs. mlflow is imported lazily.

The URI may name a server (``http(s)://``) or a store MLflow opens itself, without a server:
``lingo run --local`` tracks to ``sqlite:///<output dir>/mlflow.db`` when no URI is set
(``local_store_uri``; ``mlflow-skinny`` writes it with ``sqlalchemy`` and ``alembic``). An
experiment created in such a store keeps its artifacts beside the database
(``<dir>/mlartifacts``), not in ``./mlruns`` under whatever directory a step ran in.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shlex
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from core.redact import redact, redact_exception, secret_values

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "lingo-rl"
PARENT_RUN_ENV = "MLFLOW_PARENT_RUN_ID"
PIPELINE_RUN_TAG = "lingo.pipeline_run_id"
STEP_TAG = "lingo.step"
TERMINAL_STATUS = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELLED": "KILLED"}
"""KFP's final task state → MLflow's run status."""


def tracking_enabled() -> bool:
    """True when an MLflow tracking URI is configured in the environment."""
    return bool(os.environ.get("MLFLOW_TRACKING_URI"))


def configure_tracking(
    tracking_uri: str = "", parent_run_id: str = "", experiment: str = ""
) -> None:
    """Put the non-empty settings into this process's environment (components call this with
    their arguments; values already in the environment, e.g. from a Secret, stay otherwise)."""
    for name, value in (
        ("MLFLOW_TRACKING_URI", tracking_uri),
        (PARENT_RUN_ENV, parent_run_id),
        ("MLFLOW_EXPERIMENT_NAME", experiment),
    ):
        if value:
            os.environ[name] = value


LOCAL_STORE_FILE = "mlflow.db"
LOCAL_ARTIFACTS_DIR = "mlartifacts"


def local_store_uri(directory: str | Path) -> str:
    """The URI of an SQLite MLflow store in ``directory`` (``sqlite:////abs/dir/mlflow.db``)."""
    return f"sqlite:///{Path(directory).resolve() / LOCAL_STORE_FILE}"


def mlflow_ui_command(uri: str) -> str:
    """The shell command that opens the store at ``uri`` in MLflow's UI (http://127.0.0.1:5000).

    An SQLite store carries the alembic revision of the MLflow that wrote it, and the full
    ``mlflow`` package opens only its own revision: 3.17.2 refuses a store written by
    ``mlflow-skinny`` 3.18.0 ("Detected out-of-date database schema"). So the command installs
    the full package at the exact version of the ``mlflow-skinny`` in this environment (the
    writer), into this environment, and runs its UI from there.
    """
    version = importlib.metadata.version("mlflow-skinny")
    python = shlex.quote(sys.executable)
    return (
        f"{python} -m pip install 'mlflow=={version}' && "
        f"{python} -m mlflow ui --backend-store-uri {shlex.quote(uri)}"
    )


def artifact_location(uri: str) -> str | None:
    """Where a new experiment of the store at ``uri`` keeps its artifacts: beside an SQLite
    database; None (the server's or MLflow's default) for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///"))
    return str(database.parent / LOCAL_ARTIFACTS_DIR)


def tracking_env() -> dict[str, str]:
    """The tracking settings a child process (a PyTorchJob pod) needs, minus credentials:
    ``MLFLOW_TRACKING_TOKEN`` and the like travel as Secrets, and a URI holding a password
    is left out (give the job the Secret instead)."""
    env = {}
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", PARENT_RUN_ENV):
        value = os.environ.get(name)
        if name == "MLFLOW_TRACKING_URI" and value and urlsplit(value).password is not None:
            log.warning("MLFLOW_TRACKING_URI holds a password: not passed on; use a Secret")
            continue
        if value:
            env[name] = value
    return env


class TrackingUnreachableError(RuntimeError):
    """The configured MLflow tracking server does not answer."""


def check_tracking_server(timeout_s: float = 5.0) -> None:
    """One bounded request to an http(s) tracking server, before MLflow's client (which
    retries for minutes) talks to it.

    Raises:
        TrackingUnreachableError: no answer within ``timeout_s``; the message never holds
            the URI's password.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)  # any HTTP answer will do
    except requests.RequestException as exc:
        raise TrackingUnreachableError(
            f"MLflow tracking server {redact(uri)} did not answer within {timeout_s:.0f} s "
            f"({redact_exception(exc)}); start it, or unset MLFLOW_TRACKING_URI to track "
            "to no server"
        ) from None  # the chained exception may hold the URI's password


def _params(params: Mapping[str, object]) -> dict[str, str]:
    """MLflow parameters: strings of at most 500 characters, credentials redacted."""
    secrets = secret_values()
    return {redact(k, secrets): redact(str(v), secrets)[:500] for k, v in params.items()}


def _experiment_id(client) -> str:
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    from mlflow.exceptions import MlflowException

    location = artifact_location(os.environ.get("MLFLOW_TRACKING_URI", ""))
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # created concurrently by another step
        return client.get_experiment_by_name(name).experiment_id


def use_experiment() -> str:
    """Make ``MLFLOW_EXPERIMENT_NAME`` (default ``lingo-rl``) the active experiment, created
    when missing (artifacts beside a local store); returns its id."""
    import mlflow

    experiment_id = _experiment_id(mlflow.tracking.MlflowClient())
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def find_pipeline_run(pipeline_run_id: str) -> str | None:
    """The id of the parent run tagged with ``pipeline_run_id``, or None (also when off).

    Raises:
        TrackingUnreachableError: the tracking server does not answer (checked first).
    """
    if not tracking_enabled():
        return None
    check_tracking_server()
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    return _find(client, _experiment_id(client), pipeline_run_id)


def _find(client, experiment_id: str, pipeline_run_id: str) -> str | None:
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run_id}'",
        order_by=["attributes.start_time ASC"],
    )
    return found[0].info.run_id if found else None


LOCAL_RUN_TAG = "lingo.local_run"
"""``<host>:<pid>`` of the ``lingo run --local`` process whose step made the run: a run still
RUNNING whose process is gone was left by a killed local run (``close_abandoned_runs``)."""


def local_run_tags() -> dict[str, str]:
    """``{LOCAL_RUN_TAG: "<host>:<pid>"}`` in a step of ``lingo run --local``, else ``{}``."""
    import socket

    from core.processes import LOCAL_RUN_PID_ENV

    pid = os.environ.get(LOCAL_RUN_PID_ENV, "")
    return {LOCAL_RUN_TAG: f"{socket.gethostname()}:{pid}"} if pid.isdigit() else {}


def local_run_pid(tags: Mapping[str, str]) -> int | None:
    """The pid of the local run on this host whose step made a run with ``tags``
    (``local_run_tags``), or None: no such tag, or another host's."""
    import socket

    host, _, pid = tags.get(LOCAL_RUN_TAG, "").rpartition(":")
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def start_pipeline_run(
    pipeline_run_id: str, run_name: str, params: Mapping[str, object]
) -> str | None:
    """The parent run of one pipeline run: found by its ``lingo.pipeline_run_id`` tag (a
    retried task reuses it) or created. Returns its id, or None when tracking is off."""
    if not tracking_enabled():
        return None
    check_tracking_server()
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment_id = _experiment_id(client)
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run_id}'"
    )
    if found:
        log.info(
            "MLflow: pipeline run %s already has run %s", pipeline_run_id, found[0].info.run_id
        )
        return found[0].info.run_id
    run = client.create_run(
        experiment_id,
        run_name=run_name,
        tags={PIPELINE_RUN_TAG: pipeline_run_id, **local_run_tags()},
    )
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in _params(params).items()])
    log.info("MLflow: pipeline run %s is run %s", pipeline_run_id, run.info.run_id)
    return run.info.run_id


def finish_pipeline_run(parent_run_id: str, state: str, message: str = "") -> None:
    """Close the parent run with the pipeline's final state (``SUCCEEDED``, ``FAILED``,
    ``CANCELLED``); the error message, if any, becomes the ``lingo.error`` tag."""
    if not (tracking_enabled() and parent_run_id):
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    if message:
        client.set_tag(parent_run_id, "lingo.error", redact(message)[:5000])
    client.set_terminated(parent_run_id, TERMINAL_STATUS.get(state, "FAILED"))


@contextmanager
def mlflow_run(run_name: str, params: Mapping[str, object], is_main: bool = True) -> Iterator:
    """An MLflow run for one step, or None when disabled.

    Nested under the active run if there is one, else under ``MLFLOW_PARENT_RUN_ID`` (in the
    parent's experiment), else top-level in ``MLFLOW_EXPERIMENT_NAME``.
    """
    if not (is_main and tracking_enabled()):
        yield None
        return
    import mlflow

    parent = os.environ.get(PARENT_RUN_ENV)
    tags = {STEP_TAG: run_name, **local_run_tags()}
    if mlflow.active_run() is None and parent:
        experiment_id = mlflow.tracking.MlflowClient().get_run(parent).info.experiment_id
        run = mlflow.start_run(
            run_name=run_name, experiment_id=experiment_id, parent_run_id=parent, tags=tags
        )
    else:
        use_experiment()
        run = mlflow.start_run(run_name=run_name, nested=mlflow.active_run() is not None, tags=tags)
    with run:
        mlflow.log_params(_params(params))
        yield run


def log_metrics(values: Mapping[str, float | int | None], step: int | None = None) -> None:
    """Log the numeric values to the active MLflow run."""
    import mlflow

    numeric = {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    mlflow.log_metrics(numeric, step=step)


def log_artifact(path: str | Path, artifact_path: str | None = None) -> None:
    """Upload a file to the active MLflow run, if tracking is on and a run is active."""
    if not tracking_enabled():
        return
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_artifact(str(path), artifact_path=artifact_path)
