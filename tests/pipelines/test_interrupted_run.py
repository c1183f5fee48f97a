"""An interrupted local run leaves no MLflow run RUNNING for ever, and SIGINT's exit is the
documented one (issue #44, item 9).

On main, after SIGINT or SIGKILL of ``lingo run --local`` the pipeline's MLflow run and its
step run stayed RUNNING (kfp.local runs no exit handler when it is interrupted), and SIGINT
exited 130 with no message where docs/reliability.md says 1.
"""

from __future__ import annotations

import os
import socket
import subprocess

from typer.testing import CliRunner

import pipelines.local_run as local_run
from core import tracking
from core.processes import LOCAL_RUN_PID_ENV
from core.tracking import local_store_uri
from pipelines import cli
from pipelines.presets import get_preset


def _running_runs(out, n: int = 2) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=local_store_uri(out))
    experiment = client.create_experiment("lingo-rl")
    return [client.create_run(experiment).info.run_id for _ in range(n)]


def _status(out, run_id: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=local_store_uri(out)).get_run(run_id).info.status


def test_the_next_run_into_the_folder_closes_what_a_killed_run_left_running(tmp_path, monkeypatch):
    """SIGKILL closes nothing: the next local run into the folder, holding its lock, marks the
    runs still RUNNING in the folder's own store KILLED."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    left = _running_runs(out)
    monkeypatch.setattr(local_run, "_run_steps", lambda *a: "ran")
    assert local_run.run_local(get_preset("tiny-cpu"), out) == "ran"
    assert [_status(out, r) for r in left] == ["KILLED", "KILLED"]


def test_sigint_closes_the_runs_it_started_and_says_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    started = []

    def interrupted(*args):
        started.extend(_running_runs(out, 1))  # what start-tracking had made
        raise KeyboardInterrupt

    monkeypatch.setattr(local_run, "_run_steps", interrupted)
    result = CliRunner().invoke(cli.app, ["run", "--local", "-o", str(out)])
    assert result.exit_code == 1  # docs/reliability.md: SIGINT exits 1
    assert result.output.strip().splitlines()[-1] == "error: interrupted (SIGINT)"
    assert [_status(out, r) for r in started] == ["KILLED"]


def _tagged_runs(out, *pids: int | None) -> list[str]:
    """RUNNING runs in ``out``'s store, each tagged as a local run's step of ``pid`` on this
    host (None: no tag, anyone's run)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=local_store_uri(out))
    experiment = client.create_experiment(tracking.DEFAULT_EXPERIMENT)
    host = socket.gethostname()
    return [
        client.create_run(
            experiment, tags={tracking.LOCAL_RUN_TAG: f"{host}:{pid}"} if pid else {}
        ).info.run_id
        for pid in pids
    ]


def _gone_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_in_a_store_the_user_named_only_a_gone_local_runs_runs_are_closed(tmp_path, monkeypatch):
    """Issue #44 item 9: after a SIGKILL the runs stayed RUNNING for ever in a store named by
    MLFLOW_TRACKING_URI. That store may be shared: the next run closes only the runs a local
    run on this host tagged and whose process is gone; anyone else's and a live run's stay."""
    out = tmp_path / "out"
    out.mkdir()
    live = subprocess.Popen(["sleep", "60"])
    try:
        gone, alive, theirs = _tagged_runs(out, _gone_pid(), live.pid, None)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", local_store_uri(out))  # theirs, maybe shared
        monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        assert local_run.close_abandoned_runs(out) == [gone]
        assert [_status(out, r) for r in (gone, alive, theirs)] == ["KILLED", "RUNNING", "RUNNING"]
    finally:
        live.kill()
        live.wait()


def test_sigint_closes_its_own_runs_in_a_store_the_user_named(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", local_store_uri(out))
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    started = []

    def interrupted(*args):
        started.extend(_tagged_runs(out, os.getpid(), None))  # ours, and someone else's
        raise KeyboardInterrupt

    monkeypatch.setattr(local_run, "_run_steps", interrupted)
    result = CliRunner().invoke(cli.app, ["run", "--local", "-o", str(out)])
    assert result.exit_code == 1
    assert [_status(out, r) for r in started] == ["KILLED", "RUNNING"]


def test_a_local_runs_step_tags_its_mlflow_run_with_the_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", local_store_uri(tmp_path))
    monkeypatch.setenv(LOCAL_RUN_PID_ENV, "4242")
    monkeypatch.delenv(tracking.PARENT_RUN_ENV, raising=False)
    with tracking.mlflow_run("eval", {}) as run:
        tags = run.data.tags
    assert tags[tracking.LOCAL_RUN_TAG] == f"{socket.gethostname()}:4242"
    monkeypatch.delenv(LOCAL_RUN_PID_ENV)
    assert tracking.local_run_tags() == {}


def test_a_folder_without_a_store_needs_no_mlflow(tmp_path):
    assert local_run.close_abandoned_runs(tmp_path) == []
    assert not (tmp_path / "mlflow.db").exists()
