"""pipelines.kfp_client against tests/kfp_emulator.py, a local KFP v2beta1 REST server.

No KFP API server can run here (it needs Kubernetes, MySQL and Argo); the emulator checks
request bodies field by field against the ``kfp_server_api`` models, so a misspelt field fails.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from kfp_emulator import KfpEmulator, kfp_emulator

from pipelines import kfp_client
from pipelines.kfp_client import (
    KfpApiError,
    KfpConnection,
    RunFailedError,
    get_run,
    submit_preset,
    wait_for_run,
)
from pipelines.overrides import apply_overrides
from pipelines.presets import get_preset
from pipelines.run_form import form_arguments

TOKEN = "kfp-test-token-9f8e7d6c5b4a"


@pytest.fixture
def kfp_server(request):
    """A running emulated KFP server; ``request.param`` is the run's states, poll by poll."""
    states = getattr(request, "param", [{"state": "RUNNING"}, {"state": "SUCCEEDED"}])
    with kfp_emulator(states) as kfp:
        yield kfp


@pytest.fixture
def conn(kfp_server, monkeypatch) -> KfpConnection:
    monkeypatch.setenv(kfp_client.TOKEN_ENV, TOKEN)
    return KfpConnection.from_env(kfp_server.endpoint + "/")


def _calls(fake: KfpEmulator) -> list[tuple[str, str]]:
    return [(c["method"], c["path"]) for c in fake.calls]


def test_submit_uploads_creates_experiment_and_run_then_waits_to_success(kfp_server, conn, caplog):
    caplog.set_level(logging.DEBUG)
    preset = apply_overrides(get_preset("tiny-cpu"), {"sft.max_steps": "7"})

    submitted = submit_preset(conn, preset, experiment="nightly")

    assert _calls(kfp_server) == [
        ("GET", "/apis/v2beta1/pipelines"),
        ("POST", "/apis/v2beta1/pipelines/upload"),
        ("GET", f"/apis/v2beta1/pipelines/{submitted.version.pipeline_id}/versions"),
        ("GET", "/apis/v2beta1/experiments"),
        ("POST", "/apis/v2beta1/experiments"),
        ("POST", "/apis/v2beta1/runs"),
    ]
    assert all(c["auth"] == f"Bearer {TOKEN}" for c in kfp_server.calls)
    upload = kfp_server.calls[1]
    assert upload["query"]["name"] == "lingo-rl"
    assert b"pipelineInfo:" in upload["files"]["uploadfile"]
    assert kfp_server.calls[4]["body"] == {"display_name": "nightly"}
    run_body = kfp_server.calls[5]["body"]
    assert run_body["experiment_id"] == submitted.experiment_id
    assert run_body["pipeline_version_reference"] == submitted.version.as_body()
    assert submitted.version.pipeline_version_id.startswith("version-")
    parameters = run_body["runtime_config"]["parameters"]
    # the preset's form with --set's values; every other field is in the version's preset
    assert parameters == json.loads(json.dumps(form_arguments(preset)))
    assert parameters["sft_max_steps"] == 7 and parameters["overrides"] == ""
    assert submitted.url == f"{kfp_server.endpoint}/#/runs/details/{submitted.run_id}"

    final = wait_for_run(conn, submitted.run_id, poll_s=0)
    assert final.state == "SUCCEEDED" and final.done
    assert [r.getMessage() for r in caplog.records if "run run-" in r.getMessage()][-2:] == [
        f"run {submitted.run_id}: RUNNING",
        f"run {submitted.run_id}: SUCCEEDED",
    ]
    assert get_run(conn, submitted.run_id).state == "SUCCEEDED"
    assert TOKEN not in caplog.text and TOKEN not in repr(conn)


def test_second_submit_uploads_a_new_version_and_reuses_the_experiment(kfp_server, conn):
    first = submit_preset(conn, get_preset("tiny-cpu"))
    kfp_server.calls.clear()

    second = submit_preset(conn, get_preset("tiny-cpu"))

    assert _calls(kfp_server) == [
        ("GET", "/apis/v2beta1/pipelines"),
        ("POST", "/apis/v2beta1/pipelines/upload_version"),
        ("GET", "/apis/v2beta1/experiments"),
        ("POST", "/apis/v2beta1/runs"),
    ]
    assert kfp_server.calls[1]["query"]["pipelineid"] == first.version.pipeline_id
    assert kfp_server.calls[1]["query"]["name"].startswith("lingo-rl-")
    assert second.version.pipeline_id == first.version.pipeline_id
    assert second.version.pipeline_version_id != first.version.pipeline_version_id
    assert second.experiment_id == first.experiment_id
    assert kfp_server.calls[3]["body"]["pipeline_version_reference"] == second.version.as_body()


@pytest.mark.parametrize(
    "kfp_server",
    [[{"state": "RUNNING"}, {"state": "FAILED", "error": {"code": 2, "message": "sft OOMKilled"}}]],
    indirect=True,
)
def test_a_failed_run_raises_with_the_server_message(kfp_server, conn):
    submitted = submit_preset(conn, get_preset("tiny-cpu"))
    with pytest.raises(RunFailedError, match=rf"run {submitted.run_id} FAILED: sft OOMKilled"):
        wait_for_run(conn, submitted.run_id, poll_s=0)


@pytest.mark.parametrize("kfp_server", [[{"state": "RUNNING"}]], indirect=True)
def test_wait_times_out_on_a_run_that_never_ends(kfp_server, conn):
    submitted = submit_preset(conn, get_preset("tiny-cpu"))
    with pytest.raises(TimeoutError, match="still RUNNING"):
        wait_for_run(conn, submitted.run_id, poll_s=0.01, timeout_s=0.05)


def test_http_errors_name_the_endpoint_status_and_message(kfp_server, conn):
    with pytest.raises(KfpApiError) as info:
        get_run(conn, "no-such-run")
    assert info.value.status == 404
    assert str(info.value) == (
        f"KFP GET {kfp_server.endpoint}/apis/v2beta1/runs/no-such-run failed (HTTP 404): "
        "run no-such-run not found"
    )
    assert TOKEN not in str(info.value)


def test_an_unreachable_server_is_a_clear_error(tmp_path: Path):
    conn = KfpConnection("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(
        KfpApiError, match=r"KFP GET http://127.0.0.1:9/apis/v2beta1/runs/x .*no response"
    ):
        get_run(conn, "x")


def test_no_token_sends_no_authorization_header(kfp_server, monkeypatch):
    monkeypatch.delenv(kfp_client.TOKEN_ENV, raising=False)
    with pytest.raises(KfpApiError):
        get_run(KfpConnection.from_env(kfp_server.endpoint), "missing")
    assert kfp_server.calls[0]["auth"] is None


def test_endpoint_needs_a_scheme():
    with pytest.raises(ValueError, match="is not an http:// or https:// URL with a host"):
        KfpConnection("kfp.example.com")


def test_a_run_id_is_sent_encoded(kfp_server, conn):
    # issue #17: on main "../../x?y" was sent as is, i.e. GET /apis/x?y
    with pytest.raises(KfpApiError) as info:
        get_run(conn, "../../x?y")
    assert info.value.status == 404
    assert "/apis/v2beta1/runs/..%2F..%2Fx%3Fy failed" in str(info.value)
    from pipelines.kfp_client import run_url

    assert run_url(conn, "a/b") == f"{conn.endpoint}/#/runs/details/a%2Fb"
