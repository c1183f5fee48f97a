"""``lingo schedule`` (pipelines.schedules) against tests/kfp_emulator.py, read back with the
stock kfp 2.17 client: schedules pinned to their version, replaced by name, listed, paused,
resumed and deleted.

No KFP API server can run here; the emulator checks every request body against the
``kfp_server_api`` models and starts a recurring run's run as the server's ScheduledWorkflow
controller does (``trigger_recurring_run``).
"""

from __future__ import annotations

import json

import pytest
from kfp_emulator import ApiError, KfpEmulator, kfp_emulator
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.kfp_client import KfpConnection, submit_preset
from pipelines.overrides import apply_overrides
from pipelines.presets import get_preset
from pipelines.schedules import (
    ScheduleNotFoundError,
    list_schedules,
    plan_schedule,
    resolve_schedules,
    schedule_preset,
)

runner = CliRunner()


@pytest.fixture
def kfp_server():
    with kfp_emulator() as kfp:
        yield kfp


@pytest.fixture
def conn(kfp_server) -> KfpConnection:
    return KfpConnection(kfp_server.endpoint)


@pytest.fixture
def stock_client(kfp_server, tmp_path, monkeypatch):
    """The stock ``kfp.Client`` on the same emulator (its context file under tmp_path)."""
    import kfp

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "context.json"))
    return kfp.Client(host=kfp_server.endpoint)


def _schedule(conn, preset_name="tiny-cpu", cron="30 2 * * *", name=None, sets=None):
    preset = apply_overrides(get_preset(preset_name), sets or {})
    plan = plan_schedule(conn, preset, cron, name=name)
    return schedule_preset(conn, preset, plan)


def _preset_of_run(kfp: KfpEmulator, run: dict) -> str:
    """The name of the preset the run's pipeline version carries (configure's constant)."""
    spec = kfp.specs[run["pipeline_version_reference"]["pipeline_version_id"]]
    found = []

    def walk(node):
        if isinstance(node, dict):
            constant = (node.get("preset") or {}).get("runtimeValue", {}).get("constant")
            if isinstance(constant, str):
                found.append(json.loads(constant)["name"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    (name,) = set(found)
    return name


def test_a_schedule_is_pinned_and_another_preset_s_submit_does_not_change_it(
    kfp_server, conn, stock_client
):
    created, version = _schedule(conn)
    stored = stock_client.get_recurring_run(created.recurring_run_id)
    assert stored.pipeline_version_reference.pipeline_id == version.pipeline_id
    assert stored.pipeline_version_reference.pipeline_version_id == version.pipeline_version_id
    assert stored.trigger.cron_schedule.cron == "0 30 2 * * *"
    assert stored.no_catchup is True and stored.max_concurrency == "1"

    later = submit_preset(conn, get_preset("gpt-oss-20b"))  # a new version of the same pipeline
    assert later.version.pipeline_id == version.pipeline_id
    assert later.version.pipeline_version_id != version.pipeline_version_id

    run = kfp_server.trigger_recurring_run(created.recurring_run_id)
    assert run["pipeline_version_reference"] == version.as_body()
    assert _preset_of_run(kfp_server, run) == "tiny-cpu"
    assert run["runtime_config"]["parameters"] == created.parameters
    assert stock_client.get_run(run["run_id"]).recurring_run_id == created.recurring_run_id


def test_an_unpinned_recurring_run_runs_whatever_was_uploaded_last(kfp_server, conn):
    """The hazard the pinning removes (issue #41), reproduced: a reference with only the
    pipeline runs the latest version at each trigger, here another preset's."""
    created, version = _schedule(conn)
    body = kfp_server.recurring_runs[created.recurring_run_id]
    body["pipeline_version_reference"] = {"pipeline_id": version.pipeline_id}  # as before
    submit_preset(conn, get_preset("gpt-oss-20b"))
    run = kfp_server.trigger_recurring_run(created.recurring_run_id)
    assert run["pipeline_version_reference"]["pipeline_version_id"] != version.pipeline_version_id
    assert _preset_of_run(kfp_server, run) == "gpt-oss-20b"


def test_scheduling_the_same_name_twice_replaces_it(kfp_server, conn, stock_client):
    first, _ = _schedule(conn, name="nightly")
    kfp_server.calls.clear()
    second, version = _schedule(conn, cron="0 4 * * *", name="nightly", sets={"sft.max_steps": "9"})

    calls = [(c["method"], c["path"].removeprefix("/apis/v2beta1")) for c in kfp_server.calls]
    creates = [i for i, c in enumerate(calls) if c == ("POST", "/recurringruns")]
    assert len(creates) == 1
    assert kfp_server.calls[creates[0]]["body"]["mode"] == "DISABLE"  # never two enabled
    assert calls[creates[0] + 1 :] == [
        ("DELETE", f"/recurringruns/{first.recurring_run_id}"),
        ("POST", f"/recurringruns/{second.recurring_run_id}:enable"),
        ("GET", f"/recurringruns/{second.recurring_run_id}"),
    ]
    listed = stock_client.list_recurring_runs(page_size=50).recurring_runs
    assert [(r.recurring_run_id, r.display_name, r.status) for r in listed] == [
        (second.recurring_run_id, "nightly", "ENABLED")
    ]
    assert listed[0].trigger.cron_schedule.cron == "0 0 4 * * *"
    assert listed[0].runtime_config.parameters["sft_max_steps"] == 9
    assert listed[0].pipeline_version_reference.pipeline_version_id == version.pipeline_version_id


def test_a_refused_replacement_leaves_the_old_schedule(kfp_server, conn, stock_client):
    first, _ = _schedule(conn, name="nightly")
    preset = get_preset("tiny-cpu")
    plan = plan_schedule(conn, preset, "0 4 * * *", name="nightly")
    bad = type(plan)(**{**plan.__dict__, "parameters": {**plan.parameters, "no_such": 1}})
    from pipelines.kfp_client import KfpApiError

    with pytest.raises(KfpApiError, match="no_such"):
        schedule_preset(conn, preset, bad)
    listed = stock_client.list_recurring_runs().recurring_runs
    assert [(r.recurring_run_id, r.status) for r in listed] == [(first.recurring_run_id, "ENABLED")]


def test_dry_run_prints_the_plan_and_changes_nothing(kfp_server, conn):
    first, _ = _schedule(conn, name="nightly")
    kfp_server.calls.clear()
    result = runner.invoke(
        app,
        [
            "schedule",
            "--endpoint",
            kfp_server.endpoint,
            "--cron",
            "0 3 * * 1-5",
            "--name",
            "nightly",
            "--set",
            "grpo.max_steps=4",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    assert {c["method"] for c in kfp_server.calls} == {"GET"}
    out = result.output
    assert "dry run, nothing created" in out
    assert "schedule 'nightly' in experiment 'lingo-rl'" in out
    assert "pipeline: lingo-rl → a new version of pipeline 'lingo-rl'" in out
    assert "cron: 0 0 3 * * 1-5" in out
    assert "grpo_max_steps = 4" in out
    assert f"replaces: {first.recurring_run_id} (same name)" in out
    assert len(kfp_server.recurring_runs) == 1


def test_list_pause_resume_delete_from_the_command_line(kfp_server, conn, stock_client):
    created, version = _schedule(conn, name="nightly")
    endpoint = ["--endpoint", kfp_server.endpoint]

    listed = runner.invoke(app, ["schedule", "list", *endpoint])
    assert listed.exit_code == 0, listed.output
    assert listed.output.split() == [
        "nightly",
        created.recurring_run_id,
        "ENABLED",
        "'0",
        "30",
        "2",
        "*",
        "*",
        "*'",
        "pipeline",
        version.pipeline_id,
        "version",
        version.pipeline_version_id,
    ]

    paused = runner.invoke(app, ["schedule", "pause", "nightly", *endpoint])
    assert paused.exit_code == 0, paused.output
    assert paused.output.strip() == f"paused nightly ({created.recurring_run_id})"
    assert stock_client.get_recurring_run(created.recurring_run_id).status == "DISABLED"
    with pytest.raises(ApiError, match="DISABLED"):  # a paused schedule fires nothing
        kfp_server.trigger_recurring_run(created.recurring_run_id)

    resumed = runner.invoke(app, ["schedule", "resume", created.recurring_run_id, *endpoint])
    assert resumed.exit_code == 0, resumed.output
    assert stock_client.get_recurring_run(created.recurring_run_id).status == "ENABLED"

    deleted = runner.invoke(app, ["schedule", "delete", "nightly", *endpoint])
    assert deleted.exit_code == 0, deleted.output
    assert kfp_server.recurring_runs == {}
    assert runner.invoke(app, ["schedule", "list", *endpoint]).output.strip() == "no schedules"


def test_an_unknown_schedule_is_one_clear_line(kfp_server, conn):
    _schedule(conn, name="nightly")
    with pytest.raises(ScheduleNotFoundError, match="no schedule named 'weekly'"):
        resolve_schedules(conn, "weekly", "lingo-rl")
    result = runner.invoke(app, ["schedule", "pause", "weekly", "--endpoint", kfp_server.endpoint])
    assert result.exit_code == 2
    assert "no schedule named 'weekly' in experiment 'lingo-rl'" in result.output


def test_schedule_needs_a_cron_and_checks_it_before_uploading(kfp_server):
    missing = runner.invoke(app, ["schedule", "--endpoint", kfp_server.endpoint])
    assert missing.exit_code == 2 and "--cron" in missing.output
    bad = runner.invoke(app, ["schedule", "--endpoint", kfp_server.endpoint, "--cron", "daily"])
    assert bad.exit_code == 2 and "expected 5 fields" in bad.output
    assert not [c for c in kfp_server.calls if c["method"] != "GET"]


def test_list_reads_every_page(kfp_server, conn):
    for i in range(3):  # different content: version names are <time to the second>-<sha>
        _schedule(conn, name=f"s{i}", sets={"eval.sampling.seed": str(i + 1)})
    original = kfp_server._list

    def small_pages(items, query, field, id_key):
        return original(items, {**query, "page_size": "2"}, field, id_key)

    kfp_server._list = small_pages
    assert [s.display_name for s in list_schedules(conn)] == ["s0", "s1", "s2"]
