"""Scheduled retraining, as a schedule's runs would go, run locally under kfp.local into one
output directory (its SQLite MLflow store is the registry, so the champion carries over from
one run to the next), on the tiny model with the local-run tests' short settings:

1. the first run promotes its candidate (no champion yet; ``gate.baseline=''``);
2. the same data again ends after data prep as ``unchanged data``, in seconds;
3. new data retrains a deliberately worse candidate (one SFT and one GRPO step), which is
   compared with the champion, evaluated in the same run on the same questions and samples
   (paired test), and kept out;
and the registry's versions, aliases and data fingerprints are what the decisions say. Each
decision is one ``decision |`` line of the run's output. Three runs, not four (new data and
the worse candidate in one): each full local run takes minutes on a shared machine.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import FAST_LOCAL_RUN
from kfp import dsl

from data_prep.sources import BUNDLED_DIR
from eval.gate import GateConfig
from pipelines.local_run import run_local, tracking_summary
from pipelines.presets import apply_overrides, get_preset

MODEL = GateConfig().registered_model


def aliases(client) -> dict[str, str]:
    """The registered model's aliases (a SQLite store gives versions as ints, a server as
    strings)."""
    return {k: str(v) for k, v in client.get_registered_model(MODEL).aliases.items()}


def decisions(text: str) -> list[str]:
    """The ``decision |`` lines of a run's console output."""
    return [line.strip() for line in text.splitlines() if line.strip().startswith("decision | ")]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # three local runs of the whole DAG
def test_scheduled_retraining_story(tmp_path, monkeypatch, capfd):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    data, runs = tmp_path / "data", tmp_path / "runs"
    shutil.copytree(BUNDLED_DIR, data, ignore=shutil.ignore_patterns("*.md"))
    story = FAST_LOCAL_RUN | {"data_prep.source": str(data), "gate.baseline": ""}
    preset = apply_overrides(get_preset("tiny-cpu"), story)

    def run(extra: dict[str, str] | None = None):
        result = run_local(apply_overrides(preset, extra or {}), runs)
        return result, decisions(capfd.readouterr().out)

    # 1. no champion: the candidate becomes champion v1
    first, said = run()
    assert said[0].startswith("decision | data: retrain | data ") and "no champion yet" in said[0]
    assert said[1].startswith("decision | gate: promote | no champion yet and no baseline set")
    assert len(said) == 2
    client = MlflowClient(tracking_uri=first.tracking_uri, registry_uri=first.tracking_uri)
    v1 = client.get_model_version(MODEL, "1")
    fingerprint = v1.tags["lingo.data_fingerprint"]
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)
    card = (first.outputs["dataset_card"]).read_text()
    assert f"- data fingerprint: `{fingerprint}`" in card
    assert aliases(client) == {"champion": "1"}

    # 2. the same data: unchanged data, nothing trained, in seconds
    second, said = run()
    assert said == [
        f"decision | data: unchanged data | data fingerprint {fingerprint[:12]} equals "
        "champion v1's: SFT, GRPO and the eval do not run (set force to retrain)"
    ]
    assert not (second.run_dir / "sft").exists() and not (second.run_dir / "evaluate").exists()
    assert second.seconds < first.seconds / 2, (second.seconds, first.seconds)
    assert tracking_summary(second, GateConfig())[1] == (
        "data: unchanged data (the champion's fingerprint): nothing trained"
    )

    # 3. new data, and a deliberately worse candidate (one SFT and one GRPO step): retrained,
    # compared with champion v1 evaluated in the same run on the same questions, kept out
    rows = (data / "rows_es_it.jsonl").read_text().splitlines(keepends=True)
    (data / "rows_es_it.jsonl").write_text("".join(rows[:-5]))
    third, said = run({"sft.max_steps": "1", "grpo.max_steps": "1"})
    assert said[0].startswith("decision | data: retrain | new data: fingerprint ")
    assert f"differs from champion v1's ({fingerprint[:12]})" in said[0]
    assert re.match(
        r"decision \| gate: keep \| paired bootstrap over 5 questions: "
        r"both_language_accuracy [0-9.]+ vs champion v1 [0-9.]+ in this eval",
        said[1],
    ), said[1]
    assert len(said) == 2
    results = (third.run_dir / "evaluate" / "results").read_text()
    assert '"label": "champion"' in results
    assert not (third.run_dir / "register").exists() and not (third.run_dir / "publish").exists()

    # the registry: one version, the alias on it, the first data's fingerprint and footing
    (only,) = client.search_model_versions(f"name='{MODEL}'")
    assert str(only.version) == "1" and aliases(client) == {"champion": "1"}
    assert only.tags["lingo.data_fingerprint"] == fingerprint
    assert only.tags["lingo.eval_footing_text"].startswith("5 questions (limit 5) of ")
    third_prep = client.search_runs(
        [client.get_experiment_by_name("lingo-rl").experiment_id],
        filter_string="tags.`lingo.step` = 'data-prep'",
    )
    prints = {r.data.tags["lingo.data_fingerprint"] for r in third_prep}
    assert len(prints) == 2 and fingerprint in prints  # each data prep run records its own


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
