"""tests/kfp_emulator.py answers the stock kfp 2.17 client as the KFP API server does, and
refuses what the server's models refuse (so a wrong request fails the test that sends it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kfp_server_api
import pytest
import requests
from conftest import free_port
from kfp_emulator import ZERO_TIME, kfp_emulator

ROOT = Path(__file__).resolve().parents[1]
COMPILED = ROOT / "pipelines" / "compiled" / "tiny-cpu.yaml"


@pytest.fixture
def kfp_client(tmp_path, monkeypatch):
    """A stock ``kfp.Client`` (its context file under tmp_path) and the emulator it talks to."""
    import kfp

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "context.json"))
    done: list[dict] = []
    with kfp_emulator([{"state": "RUNNING"}, {"state": "SUCCEEDED"}], done.append) as server:
        server.done = done
        yield kfp.Client(host=server.endpoint, existing_token="t0k"), server


def test_the_stock_client_runs_a_pipeline_and_reads_it_back(kfp_client):
    client, server = kfp_client
    pipeline = client.upload_pipeline(str(COMPILED), pipeline_name="lingo-rl")
    assert client.get_pipeline_id("lingo-rl") == pipeline.pipeline_id  # filter: stringValue, op 1
    version = client.list_pipeline_versions(pipeline.pipeline_id).pipeline_versions[0]
    experiment = client.create_experiment("nightly")
    assert client.create_experiment("nightly").experiment_id == experiment.experiment_id

    run = client.run_pipeline(
        experiment.experiment_id,
        "seed-7",
        pipeline_id=pipeline.pipeline_id,
        version_id=version.pipeline_version_id,
        params={"sft_max_steps": 3, "overrides": "data_prep.seed=7"},
    )
    assert run.state == "PENDING" and run.created_at.tzinfo is not None
    final = client.wait_for_run_completion(run.run_id, timeout=30, sleep_duration=0)
    assert final.state == "SUCCEEDED"
    assert final.finished_at >= final.created_at
    assert [s.state for s in final.state_history] == ["PENDING", "RUNNING", "SUCCEEDED"]
    assert server.done == [server.runs[run.run_id]]  # on_run_done: once, with the final run
    assert final.runtime_config.parameters == {"sft_max_steps": 3, "overrides": "data_prep.seed=7"}
    listed = client.list_runs(experiment_id=experiment.experiment_id).runs
    assert [r.run_id for r in listed] == [run.run_id]
    assert all(c["auth"] == "Bearer t0k" for c in server.calls)


def test_a_recurring_run_is_stored_with_the_server_s_output_fields(kfp_client):
    client, server = kfp_client
    experiment = client.create_experiment("weekly")
    recurring = client.create_recurring_run(
        experiment.experiment_id,
        "weekly",
        cron_expression="0 30 2 * * 0",
        pipeline_package_path=str(COMPILED),
        params={"data_source": "bundled"},
    )
    assert recurring.status == "ENABLED" and recurring.mode == "ENABLE"
    assert recurring.max_concurrency == "1"  # int64: a JSON string, as protojson writes it
    assert client.get_recurring_run(recurring.recurring_run_id).trigger.cron_schedule.cron == (
        "0 30 2 * * 0"
    )
    client.disable_recurring_run(recurring.recurring_run_id)
    assert server.recurring_runs[recurring.recurring_run_id]["status"] == "DISABLED"


def test_recurring_runs_are_listed_filtered_paused_resumed_and_deleted_as_the_client_asks(
    kfp_client,
):
    client, server = kfp_client
    pipeline = client.upload_pipeline(str(COMPILED), pipeline_name="lingo-rl")
    version = client.list_pipeline_versions(pipeline.pipeline_id).pipeline_versions[0]
    nightly, weekly = client.create_experiment("nightly"), client.create_experiment("weekly")
    made = {
        (experiment.display_name, name): client.create_recurring_run(
            experiment.experiment_id,
            name,
            cron_expression="0 30 2 * * *",
            pipeline_id=pipeline.pipeline_id,
            version_id=version.pipeline_version_id,
        )
        for experiment in (nightly, weekly)
        for name in ("a", "b")
    }
    only_a = json.dumps(
        {"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": "a"}]}
    )
    listed = client.list_recurring_runs(experiment_id=nightly.experiment_id, filter=only_a)
    assert [r.recurring_run_id for r in listed.recurring_runs] == [
        made["nightly", "a"].recurring_run_id
    ]
    assert listed.total_size == 1
    pinned = listed.recurring_runs[0].pipeline_version_reference
    assert (pinned.pipeline_id, pinned.pipeline_version_id) == (
        pipeline.pipeline_id,
        version.pipeline_version_id,
    )
    page = client.list_recurring_runs(page_size=3, sort_by="created_at desc")
    assert len(page.recurring_runs) == 3 and page.next_page_token
    assert page.recurring_runs[0].recurring_run_id == made["weekly", "b"].recurring_run_id

    target = made["weekly", "a"].recurring_run_id
    client.disable_recurring_run(target)
    disabled = json.dumps(
        {"predicates": [{"operation": "EQUALS", "key": "status", "stringValue": "DISABLED"}]}
    )
    assert [
        r.recurring_run_id for r in client.list_recurring_runs(filter=disabled).recurring_runs
    ] == [target]
    client.enable_recurring_run(target)
    assert client.get_recurring_run(target).status == "ENABLED"
    client.delete_recurring_run(target)
    assert target not in server.recurring_runs
    with pytest.raises(kfp_server_api.ApiException) as info:
        client.get_recurring_run(target)
    assert info.value.status == 404


def test_an_unfinished_run_has_the_zero_finish_time(kfp_client):
    client, server = kfp_client
    experiment = client.create_experiment("e")
    run = client.run_pipeline(experiment.experiment_id, "r", pipeline_package_path=str(COMPILED))
    assert server.runs[run.run_id]["finished_at"] == ZERO_TIME


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"sft_max_step": 7}, "parameter 'sft_max_step' is not an input of pipeline 'lingo-rl'"),
        ({"sft_max_steps": "7"}, "parameter 'sft_max_steps' is NUMBER_INTEGER; got \"7\""),
        ({"sft_max_steps": 7.5}, "parameter 'sft_max_steps' is NUMBER_INTEGER; got 7.5"),
        # the dict parameters are gone: one of their fields is an overrides item
        ({"sft_config": {"max_steps": 3}}, "parameter 'sft_config' is not an input"),
    ],
)
def test_a_run_parameter_the_pipeline_does_not_take_is_refused(kfp_client, params, message):
    client, server = kfp_client
    experiment = client.create_experiment("e")
    with pytest.raises(kfp_server_api.ApiException) as info:
        client.run_pipeline(
            experiment.experiment_id, "r", pipeline_package_path=str(COMPILED), params=params
        )
    assert info.value.status == 400
    assert message in json.loads(info.value.body)["message"]
    assert not server.runs


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/runs", {"display_name": "r", "pipeline_version_ref": {}}, 'unknown field "pipeline'),
        ("/runs", {"display_name": 7}, "run.display_name: expected a string, got 7"),
        ("/runs", {"display_name": "r", "state": "DONE"}, "run.state: 'DONE' is not one of"),
        ("/experiments", {"displayName": "e", "created_at": "yesterday"}, "RFC 3339"),
        ("/recurringruns", {"max_concurrency": "one"}, "expected an integer, got 'one'"),
    ],
)
def test_a_body_the_server_s_models_do_not_accept_is_a_400(path, body, message):
    with kfp_emulator() as server:
        response = requests.post(f"{server.endpoint}/apis/v2beta1{path}", json=body, timeout=10)
    assert response.status_code == 400
    assert message in response.json()["message"]
    assert response.json()["code"] == 3  # INVALID_ARGUMENT


@pytest.mark.parametrize(
    "predicate",
    [
        {"operation": "EQUALS", "key": "display_name", "string_value": "b"},  # lingo's
        {"operation": 1, "key": "display_name", "stringValue": "b"},  # the kfp client's
    ],
)
def test_a_filter_is_read_in_both_json_spellings(predicate):
    with kfp_emulator() as server:
        for name in ("a", "b"):
            requests.post(
                f"{server.endpoint}/apis/v2beta1/experiments",
                json={"display_name": name},
                timeout=10,
            ).raise_for_status()
        query = {"filter": json.dumps({"predicates": [predicate]})}
        found = requests.get(
            f"{server.endpoint}/apis/v2beta1/experiments", params=query, timeout=10
        )
        bad = {"filter": json.dumps({"predicates": [{**predicate, "value": "b"}]})}
        refused = requests.get(
            f"{server.endpoint}/apis/v2beta1/experiments", params=bad, timeout=10
        )
    assert [e["display_name"] for e in found.json()["experiments"]] == ["b"]
    assert refused.status_code == 400 and "unknown field 'value'" in refused.json()["message"]


def test_a_token_when_required_must_be_sent():
    with kfp_emulator(token="s3cret") as server:
        health = f"{server.endpoint}/apis/v2beta1/healthz"
        refused = requests.get(health, timeout=10)
        wrong = requests.get(health, headers={"Authorization": "Bearer nope"}, timeout=10)
        good = requests.get(health, headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert (refused.status_code, wrong.status_code, good.status_code) == (401, 401, 200)
    assert refused.json()["code"] == 16  # UNAUTHENTICATED


def test_an_empty_list_is_an_empty_object_and_an_unknown_route_a_404():
    with kfp_emulator() as server:
        assert requests.get(f"{server.endpoint}/apis/v2beta1/runs", timeout=10).json() == {}
        missing = requests.get(f"{server.endpoint}/apis/v2beta1/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["code"] == 5


def test_the_emulator_runs_as_a_standalone_server():
    port = free_port()
    command = [sys.executable, "-m", "tests.kfp_emulator", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, "--states", "RUNNING,FAILED", "--error", "sft OOMKilled"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    api = f"http://127.0.0.1:{port}/apis/v2beta1"
    try:
        assert proc.stdout.readline().startswith(f"KFP v2beta1 emulator on http://127.0.0.1:{port}")
        assert requests.get(f"{api}/healthz", timeout=10).json()["multi_user"] is False
        spec = {"pipelineInfo": {"name": "p"}, "root": {"dag": {"tasks": {}}}}
        run = requests.post(
            f"{api}/runs", json={"display_name": "r", "pipeline_spec": spec}, timeout=10
        ).json()
        states = [requests.get(f"{api}/runs/{run['run_id']}", timeout=10).json() for _ in "123"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert [s["state"] for s in states] == ["RUNNING", "FAILED", "FAILED"]
    assert states[-1]["error"] == {"code": 2, "message": "sft OOMKilled"}
