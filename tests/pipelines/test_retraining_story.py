"""Scheduled retraining, as a schedule's runs go (issue 41's story), on the tiny model.

``lingo schedule`` against the KFP emulator (tests/kfp_emulator.py) pins a pipeline version and
the run's parameters; each trigger of the schedule (``trigger_recurring_run``, as the server's
ScheduledWorkflow controller starts a run) carries exactly the parameters ``lingo run --local``
passes for the same preset and ``--set`` values (checked), and ``lingo run --local`` (the CLI, in
a subprocess) runs them on this machine into one output directory, whose SQLite MLflow store is
the registry, so the champion carries over from run to run:

1. the first run promotes its candidate (no champion yet; ``gate.baseline=''``);
2. the same data again ends after the data check as ``unchanged data``, nothing trained;
3. new data retrains, and the candidate is compared with champion v1, evaluated in the same run
   on the same questions and samples (paired test);
4. the schedule replaced (same name) by a deliberately worse one (one SFT and one GRPO step:
   ``grpo.max_steps`` must be at least 1), on new data again: compared with the champion and
   kept out, nothing registered.

After each run the registry's versions, aliases and data fingerprints are what the decisions say,
and each decision is one ``decision |`` line of the run's output. Runs 1, 3 and 4 train the
whole DAG (minutes on a shared 2-core machine), hence ``slow``; the default tests that cover
each decision alone are listed in docs/retraining.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST_LOCAL_RUN
from kfp import dsl
from kfp_emulator import kfp_emulator
from typer.testing import CliRunner

from data_prep.sources import BUNDLED_DIR
from eval.gate import GateConfig
from pipelines.cli import app
from pipelines.overrides import apply_overrides
from pipelines.presets import get_preset
from pipelines.run_form import form_arguments

MODEL = GateConfig().registered_model
ROOT = Path(__file__).resolve().parents[2]
WORSE = {"sft.max_steps": "1", "grpo.max_steps": "1"}
"""The deliberately worse candidate: the fewest steps the configs allow."""


def aliases(client) -> dict[str, str]:
    """The registered model's aliases (a SQLite store gives versions as ints, a server as
    strings)."""
    return {k: str(v) for k, v in client.get_registered_model(MODEL).aliases.items()}


def versions(client) -> dict[str, str]:
    """Version → its data fingerprint tag."""
    return {
        str(v.version): v.tags.get("lingo.data_fingerprint", "")
        for v in client.search_model_versions(f"name='{MODEL}'")
    }


def decisions(text: str) -> list[str]:
    """The ``decision |`` lines of a run's console output."""
    return [line.strip() for line in text.splitlines() if line.strip().startswith("decision | ")]


def prep_fingerprints(client) -> list[str]:
    """The data fingerprints the data-prep runs recorded, oldest first."""
    runs = client.search_runs(
        [client.get_experiment_by_name("lingo-rl").experiment_id],
        filter_string="tags.`lingo.step` = 'data-prep'",
        order_by=["attributes.start_time ASC"],
    )
    return [r.data.tags["lingo.data_fingerprint"] for r in runs]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # three trained local runs of the whole DAG and one stopped early
def test_scheduled_retraining_story(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from core.tracking import local_store_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # the kfp client's context file
    monkeypatch.chdir(tmp_path)
    data, runs = tmp_path / "data", tmp_path / "runs"
    shutil.copytree(BUNDLED_DIR, data, ignore=shutil.ignore_patterns("*.md"))
    rows = (data / "rows_es_it.jsonl").read_text().splitlines(keepends=True)
    story = FAST_LOCAL_RUN | {"data_prep.source": str(data), "gate.baseline": ""}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(ROOT)  # the steps import this checkout (a no-op where it is installed)

    with kfp_emulator() as kfp:

        def schedule(sets: dict[str, str]) -> None:
            """``lingo schedule`` of the tiny-cpu preset with ``sets``, named ``nightly``."""
            args = ["schedule", "--endpoint", kfp.endpoint, "--cron", "30 2 * * *"]
            args += ["--name", "nightly", "--preset", "tiny-cpu"]
            args += [item for k, v in sets.items() for item in ("--set", f"{k}={v}")]
            done = CliRunner().invoke(app, args)
            assert done.exit_code == 0, done.output

        def trigger(sets: dict[str, str]) -> dict:
            """The run the schedule's next trigger starts, checked to carry the arguments
            ``lingo run --local`` passes for the same ``--set`` values."""
            (recurring_id,) = kfp.recurring_runs  # the same name replaces, never duplicates
            run = kfp.trigger_recurring_run(recurring_id)
            pinned = kfp.recurring_runs[recurring_id]["pipeline_version_reference"]
            assert run["pipeline_version_reference"] == pinned
            preset = apply_overrides(get_preset("tiny-cpu"), sets)
            assert run["runtime_config"]["parameters"] == form_arguments(preset)
            return run

        def lingo_run_local(sets: dict[str, str]) -> tuple[list[str], str, float]:
            """``lingo run --local`` with the schedule's ``--set``: its decision lines, its
            output, its wall time."""
            args = [sys.executable, "-m", "pipelines", "run", "--local", "--preset", "tiny-cpu"]
            args += ["--output-dir", str(runs)]
            args += [item for k, v in sets.items() for item in ("--set", f"{k}={v}")]
            start = time.monotonic()
            done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)
            seconds = time.monotonic() - start
            assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
            return decisions(done.stdout), done.stdout, seconds

        def run_dirs() -> list[Path]:
            return sorted(runs.glob("lingo-rl-*"))

        # 1. no champion: the candidate becomes champion v1, its data's fingerprint recorded
        schedule(story)
        scheduled = trigger(story)
        said, out, first_s = lingo_run_local(story)
        assert len(said) == 2, out
        assert (
            said[0].startswith("decision | data: retrain | data ") and "no champion yet" in said[0]
        )
        assert said[1].startswith("decision | gate: promote | no champion yet and no baseline set")
        uri = local_store_uri(runs)
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        (fingerprint,) = prep_fingerprints(client)
        assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)
        assert versions(client) == {"1": fingerprint} and aliases(client) == {"champion": "1"}
        card = (run_dirs()[-1] / "data-prep" / "card").read_text()
        assert f"- data fingerprint: `{fingerprint}`" in card
        assert f"registered model '{MODEL}' version 1 (champion → version 1)" in out

        # 2. the same data on the next trigger: unchanged data, nothing trained, the registry
        # as it was
        again = trigger(story)
        assert again["runtime_config"] == scheduled["runtime_config"]
        assert again["pipeline_version_reference"] == scheduled["pipeline_version_reference"]
        said, out, second_s = lingo_run_local(story)
        assert said == [
            f"decision | data: unchanged data | data fingerprint {fingerprint[:12]} equals "
            "champion v1's: SFT, GRPO and the eval do not run (set force to retrain)"
        ], out
        assert "data: unchanged data (the champion's fingerprint): nothing trained" in out
        assert not {"sft", "grpo", "evaluate", "gate"} & {p.name for p in run_dirs()[-1].iterdir()}
        assert second_s < first_s / 2, (second_s, first_s)
        assert versions(client) == {"1": fingerprint} and aliases(client) == {"champion": "1"}
        assert prep_fingerprints(client) == [fingerprint, fingerprint]

        # 3. new data: retrained, and compared with champion v1 evaluated in the same run on
        # the same questions and samples
        (data / "rows_es_it.jsonl").write_text("".join(rows[:-5]))
        trigger(story)
        said, out, third_s = lingo_run_local(story)
        assert len(said) == 2, out
        third = prep_fingerprints(client)[-1]
        assert third != fingerprint
        assert said[0] == (
            f"decision | data: retrain | new data: fingerprint {third[:12]} differs from "
            f"champion v1's ({fingerprint[:12]}), training"
        )
        paired = re.match(
            r"decision \| gate: (promote|keep) \| paired bootstrap over 5 questions: "
            r"both_language_accuracy [0-9.]+ vs champion v1 [0-9.]+ in this eval, difference "
            r"[-+0-9.]+, 95% lower bound .* \| power: ",
            said[1],
        )
        assert paired, said[1]
        results = json.loads((run_dirs()[-1] / "evaluate" / "results").read_text())
        assert [m["label"] for m in results["models"]] == ["base", "sft", "grpo", "champion"]
        if paired.group(1) == "promote":  # the registry follows the line
            expected = {"1": fingerprint, "2": third}, {"champion": "2"}
        else:
            expected = {"1": fingerprint}, {"champion": "1"}
        assert (versions(client), aliases(client)) == expected
        held, champion_fingerprint = expected[1]["champion"], expected[0][expected[1]["champion"]]

        # 4. the schedule replaced by a deliberately worse one, on new data again: retrained,
        # compared with the champion, kept out
        (data / "rows_es_it.jsonl").write_text("".join(rows[:-10]))
        schedule(story | WORSE)
        worse = trigger(story | WORSE)
        assert worse["runtime_config"]["parameters"]["grpo_max_steps"] == 1
        said, out, fourth_s = lingo_run_local(story | WORSE)
        assert len(said) == 2, out
        fourth = prep_fingerprints(client)[-1]
        assert len({fingerprint, third, fourth}) == 3
        assert said[0] == (
            f"decision | data: retrain | new data: fingerprint {fourth[:12]} differs from "
            f"champion v{held}'s ({champion_fingerprint[:12]}), training"
        )
        assert re.match(
            rf"decision \| gate: keep \| paired bootstrap over 5 questions: "
            rf"both_language_accuracy [0-9.]+ vs champion v{held} [0-9.]+ in this eval",
            said[1],
        ), said[1]
        assert not {"register", "publish"} & {p.name for p in run_dirs()[-1].iterdir()}
        assert (versions(client), aliases(client)) == expected
        tags = client.get_model_version(MODEL, held).tags
        assert tags["lingo.eval_footing_text"].startswith("5 questions (limit 5) of ")
        times = (first_s, second_s, third_s, fourth_s)
        print("story wall times (s):", " ".join(f"{t:.0f}" for t in times))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 9 min on 2 shared cores at load 40
def test_scheduled_retraining_story_step_by_step(tmp_path, monkeypatch, caplog):
    """The same story through the steps' component bodies in this process, in the DAG's order
    and under its conditions (``data-check == 'retrain'``, ``gate == 'promote'``), one
    SFT/GRPO result reused: the tiny model is every run's base and SFT model, and the
    candidate of runs 1 and 3 (run 3's is another tiny model: different weights, no better).
    Four runs: promote, unchanged data, new data compared with the champion (kept), the
    champion's data again forced (``force``), with the champion itself as the candidate
    (unchanged)."""
    import logging

    from mlflow import MlflowClient

    from components.data_prep import data_check, data_prep
    from components.evaluate import champion, evaluate, gate, register
    from core.tracking import local_store_uri
    from eval.registry import content_sha256
    from trainer.tiny_model import SMALLEST, build_tiny_model

    uri = local_store_uri(tmp_path / "store")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "story")
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    data = tmp_path / "data"
    shutil.copytree(BUNDLED_DIR, data, ignore=shutil.ignore_patterns("*.md"))
    tiny = build_tiny_model(tmp_path / "tiny", SMALLEST)
    other = build_tiny_model(tmp_path / "other", SMALLEST.model_copy(update={"seed": 1}))
    gate_config = {"baseline": ""}
    eval_config = {"limit": 5, "sampling": {"max_tokens": 8, "n": 2}, "batch_size": 10}

    def run(n: int, candidate, force: bool = False) -> list[str]:
        """One scheduled run; its decision lines."""
        caplog.clear()
        out = tmp_path / f"run{n}"
        artifact = {name: kind(uri=str(out / name)) for name, kind in (
            ("train_data", dsl.Dataset), ("eval_data", dsl.Dataset), ("quarantine", dsl.Dataset),
            ("metrics", dsl.Metrics), ("card", dsl.Markdown),
        )}  # fmt: skip
        fingerprint = data_prep.python_func(config={"source": str(data)}, **artifact)
        config = gate_config | {"force": force}
        if data_check.python_func(fingerprint, config) == "retrain":
            held = dsl.Model(uri=str(out / "champion"))
            champion.python_func(config, held)
            results = dsl.Artifact(uri=str(out / "results"))
            matrices = {
                f"{m}_{part}_language": dsl.ClassificationMetrics(uri=str(out / f"{m}{part}"))
                for m in ("base", "sft", "grpo")
                for part in ("reasoning", "answer")
            }
            evaluate.python_func(
                base_model=dsl.Model(uri=str(tiny)), sft_model=dsl.Model(uri=str(tiny)),
                grpo_model=dsl.Model(uri=str(candidate)), champion_model=held,
                config=eval_config, results=results, report=dsl.Markdown(uri=str(out / "r")),
                report_html=dsl.HTML(uri=str(out / "h")), metrics=dsl.Metrics(uri=str(out / "m")),
                **matrices,
            )  # fmt: skip
            inputs = dict(results=results, grpo_model=dsl.Model(uri=str(candidate)), config=config)
            decided = gate.python_func(**inputs, report=dsl.Markdown(uri=str(out / "gate")))
            if decided == "promote":
                report = dsl.Markdown(uri=str(out / "register"))
                register.python_func(**inputs, report=report, data_fingerprint=fingerprint)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("decision |")]

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    said = run(1, tiny)
    assert said[0].startswith("decision | data: retrain") and "no champion yet" in said[0]
    assert said[1].startswith("decision | gate: promote | no champion yet and no baseline set")
    fingerprint = client.get_model_version(MODEL, "1").tags["lingo.data_fingerprint"]
    assert f"- data fingerprint: `{fingerprint}`" in (tmp_path / "run1" / "card").read_text()

    assert run(2, tiny) == [
        f"decision | data: unchanged data | data fingerprint {fingerprint[:12]} equals "
        "champion v1's: SFT, GRPO and the eval do not run (set force to retrain)"
    ]
    assert not (tmp_path / "run2" / "results").exists()

    rows = (data / "rows_es_it.jsonl").read_text().splitlines(keepends=True)
    (data / "rows_es_it.jsonl").write_text("".join(rows[:-5]))
    said = run(3, other)
    assert said[0].startswith("decision | data: retrain | new data: fingerprint ")
    assert re.match(
        r"decision \| gate: keep \| paired bootstrap over 5 questions: both_language_accuracy "
        r"[0-9.]+ vs champion v1 [0-9.]+ in this eval, difference [-+0-9.]+, 95% lower bound",
        said[1],
    ), said[1]
    assert " | power: " in said[1]
    held = tmp_path / "run3" / "champion"
    assert content_sha256(held) == content_sha256(tiny)  # the registry's files, downloaded
    labels = [m["label"] for m in json.loads((tmp_path / "run3" / "results").read_text())["models"]]
    assert labels == ["base", "sft", "grpo", "champion"]

    (data / "rows_es_it.jsonl").write_text("".join(rows))  # run 1's data: the champion's
    said = run(4, tiny, force=True)
    assert "force is set: training anyway" in said[0]
    assert said[1].startswith("decision | gate: unchanged | the candidate is already champion")

    (only,) = client.search_model_versions(f"name='{MODEL}'")
    assert str(only.version) == "1" and aliases(client) == {"champion": "1"}
    assert only.tags["lingo.data_fingerprint"] == fingerprint
    assert only.tags["lingo.eval_footing_text"].startswith("5 questions (limit 5) of ")
