"""The progress server's edges (trainer/progress.py); the live server during real SFT and GRPO
runs is checked in test_metrics_odh_reader.py."""

import json
import socket
import urllib.request

import pytest
from conftest import free_port

from trainer.progress import (
    PORT_ENV,
    TERMINATION_PATH_ENV,
    ProgressServer,
    progress_object,
    serve_progress,
)


def _get(port: int, path: str = "/metrics") -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return json.loads(answer.read())


@pytest.mark.parametrize("value", ["http", "0", "70000", "-1"])
def test_a_bad_port_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(PORT_ENV, value)
    with pytest.raises(ValueError, match=f"{PORT_ENV}='{value}' is not a TCP port"):  # noqa: SIM117
        with serve_progress():
            pass


def test_off_without_the_variable_and_on_other_ranks(monkeypatch):
    monkeypatch.delenv(PORT_ENV, raising=False)
    with serve_progress() as server:
        assert server is None
    monkeypatch.setenv(PORT_ENV, str(free_port()))
    with serve_progress(is_main=False) as server:
        assert server is None


def test_a_busy_port_leaves_training_going_without_a_server(monkeypatch, caplog):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        monkeypatch.setenv(PORT_ENV, str(taken.getsockname()[1]))
        with serve_progress() as server:
            assert server is None
    assert "progress server not started" in caplog.text


def test_the_termination_message_only_into_an_existing_file_and_only_on_success(
    tmp_path, monkeypatch
):
    port = free_port()
    monkeypatch.setenv(PORT_ENV, str(port))
    missing = tmp_path / "no-such-file"
    monkeypatch.setenv(TERMINATION_PATH_ENV, str(missing))
    with serve_progress() as server:
        server.update({"step": 2, "max_steps": 2, "epoch": 1.0, "wall_time_s": 4.0}, 1.0)
        assert _get(port, "/")["progressPercentage"] == 100  # any path answers
    assert not missing.exists()  # not created: only the kubelet's mounted file is written

    mounted = tmp_path / "termination-log"
    mounted.touch()
    monkeypatch.setenv(TERMINATION_PATH_ENV, str(mounted))
    with pytest.raises(RuntimeError), serve_progress() as server:
        server.update({"step": 1, "max_steps": 2, "epoch": 0.5, "wall_time_s": 2.0}, 1.0)
        raise RuntimeError("training failed")  # the log tail stays Kubernetes' message
    assert mounted.read_text() == ""
    with serve_progress() as server:
        server.update({"step": 2, "max_steps": 2, "epoch": 1.0, "loss": 0.5, "wall_time_s": 4}, 1)
    assert json.loads(mounted.read_text())["trainMetrics"] == {"loss": "0.5000"}


def test_before_the_first_line_and_with_values_that_are_not_finite():
    assert progress_object(None, None) == {
        "progressPercentage": None,
        "estimatedRemainingSeconds": None,
        "currentStep": 0,
        "totalSteps": None,
        "currentEpoch": 0.0,
        "totalEpochs": None,
        "trainMetrics": {},
        "evalMetrics": {},
    }
    line = {"step": 1, "max_steps": 300, "epoch": 0.01, "wall_time_s": 2.5, "loss": None}
    served = progress_object({**line, "grad_norm": float("inf")}, 2.5)
    assert served["progressPercentage"] == 0 and served["estimatedRemainingSeconds"] == 747
    assert served["currentEpoch"] == 1.0 and served["totalEpochs"] == 3
    assert served["trainMetrics"] == {"loss": None, "grad_norm": None}


def test_the_latest_eval_stays_until_the_next_and_closing_frees_the_port():
    server = ProgressServer(0, host="127.0.0.1")
    line = {"step": 3, "max_steps": 4, "epoch": 0.75, "wall_time_s": 6.0, "loss": 1.5}
    try:
        server.update(line, 1.0)
        server.update({**line, "eval_loss": 1.25, "wall_time_s": 7.0}, 1.0)  # merged eval
        server.update({**line, "step": 4, "epoch": 1.0, "wall_time_s": 9.0}, 1.0)
        served = _get(server.port)
        assert served["currentStep"] == 4 and served["estimatedRemainingSeconds"] == 0
        assert served["evalMetrics"] == {"eval_loss": "1.2500"}
    finally:
        server.close()
    with pytest.raises(OSError):
        _get(server.port)
