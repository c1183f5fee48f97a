"""The demo's MLflow store opens with the command the run prints (issue: a store written by
``mlflow-skinny`` 3.18.0 was refused by the full ``mlflow`` 3.17.2 that ``make test`` installs:
"Detected out-of-date database schema")."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import tomllib
import urllib.request
from pathlib import Path

from conftest import free_port
from mlflow_server import stop, wait_healthy

from core import tracking

ROOT = Path(__file__).resolve().parents[2]


def _requirement(requirements: list[str], name: str) -> str:
    (spec,) = [r for r in requirements if r.split("=")[0].split(">")[0].strip() == name]
    return spec


def test_the_writer_and_the_ui_share_one_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    skinny = _requirement(project["dependencies"], "mlflow-skinny")
    full = _requirement(project["optional-dependencies"]["dev"], "mlflow")
    assert skinny.removeprefix("mlflow-skinny") == full.removeprefix("mlflow")


def _write_demo_store(directory: Path, monkeypatch) -> str:
    """A store as ``lingo run --local`` writes it: the parent run and a step run."""
    uri = tracking.local_store_uri(directory)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", tracking.DEFAULT_EXPERIMENT)
    parent = tracking.start_pipeline_run("kfp-run-1", "lingo-rl-test", {"preset": "tiny-cpu"})
    monkeypatch.setenv(tracking.PARENT_RUN_ENV, parent)
    with tracking.mlflow_run("eval", {"limit": 1}):
        tracking.log_metrics({"both_language_accuracy": 0.85})
    tracking.finish_pipeline_run(parent, "SUCCEEDED")
    return uri


def test_the_printed_command_opens_the_store_in_the_full_mlflow(tmp_path, monkeypatch):
    uri = _write_demo_store(tmp_path, monkeypatch)
    command = tracking.mlflow_ui_command(uri)
    # the version the command installs is the writer's, and the one this env's full mlflow has
    assert f"'mlflow=={importlib.metadata.version('mlflow-skinny')}'" in command
    assert importlib.metadata.version("mlflow") == importlib.metadata.version("mlflow-skinny")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no huey consumers in a test
    log_path = tmp_path / "ui.log"
    with log_path.open("wb") as log:
        # the printed command as a user pastes it (pip finds mlflow already installed), plus
        # a free port instead of 5000
        proc = subprocess.Popen(
            ["bash", "-c", f"{command} --host 127.0.0.1 --port {port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        # the command runs pip (it asks PyPI) before the server: on a loaded 2-core machine
        # the two took over 180 s
        wait_healthy(url, proc, log_path, timeout_s=480)
        request = urllib.request.Request(
            f"{url}/api/2.0/mlflow/experiments/search",
            data=json.dumps({"max_results": 10}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            names = [e["name"] for e in json.load(response)["experiments"]]
        assert tracking.DEFAULT_EXPERIMENT in names
        assert "out-of-date database schema" not in log_path.read_text()
    finally:
        stop(proc)
