"""Tracking faults (issue #17): an unreachable server fails fast with one message, and a
password in the tracking URI is never printed nor put in kfp.local's executor input."""

import time

import pytest

from core.redact import redact
from core.tracking import (
    TrackingUnreachableError,
    artifact_location,
    find_pipeline_run,
    start_pipeline_run,
)
from pipelines.local_run import tracking_arguments

SECRET_URI = "http://lingo:s3cret-pw@127.0.0.1:9"  # nothing listens on the discard port


def test_an_unreachable_server_fails_fast_without_the_password(monkeypatch):
    # on main: 4.5 min of retries in start-tracking, the password in the MLflow exception
    monkeypatch.setenv("MLFLOW_TRACKING_URI", SECRET_URI)
    started = time.monotonic()
    with pytest.raises(TrackingUnreachableError) as err:
        start_pipeline_run("run-1", "run-1", {"a": 1})
    assert time.monotonic() - started < 15
    message = str(err.value)
    assert "http://lingo:***@127.0.0.1:9 did not answer" in message
    assert "s3cret" not in message and err.value.__cause__ is None
    with pytest.raises(TrackingUnreachableError):
        find_pipeline_run("run-1")  # what the exit handler calls: fast too


def test_a_password_uri_reaches_the_steps_by_environment_only(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", SECRET_URI)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp")
    assert tracking_arguments() == {"mlflow_tracking_uri": "", "mlflow_experiment": "exp"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking_arguments()["mlflow_tracking_uri"] == "http://mlflow:5000"


def test_without_a_uri_the_local_run_tracks_to_an_sqlite_store_in_its_output_dir(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = tracking_arguments(tmp_path / "runs")["mlflow_tracking_uri"]
    assert uri == f"sqlite:///{tmp_path.resolve()}/runs/mlflow.db"
    assert artifact_location(uri) == f"{tmp_path.resolve()}/runs/mlartifacts"
    assert artifact_location("http://mlflow:5000") is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", SECRET_URI)  # the user's store wins, by env
    assert tracking_arguments(tmp_path)["mlflow_tracking_uri"] == ""


def test_redact_uri():
    assert redact(SECRET_URI) == "http://lingo:***@127.0.0.1:9"
    assert redact("http://host:5000/x") == "http://host:5000/x"
