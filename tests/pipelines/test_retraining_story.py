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

import re
import shutil

import pytest
from conftest import FAST_LOCAL_RUN

from data_prep.sources import BUNDLED_DIR
from eval.gate import GateConfig
from pipelines.local_run import run_local
from pipelines.presets import apply_overrides, get_preset

pytestmark = pytest.mark.slow
MODEL = GateConfig().registered_model


def decisions(text: str) -> list[str]:
    """The ``decision |`` lines of a run's console output."""
    return [line.strip() for line in text.splitlines() if line.strip().startswith("decision | ")]


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
    assert client.get_registered_model(MODEL).aliases == {"champion": "1"}

    # 2. the same data: unchanged data, nothing trained, in seconds
    second, said = run()
    assert said == [
        f"decision | data: unchanged data | data fingerprint {fingerprint[:12]} equals "
        "champion v1's: SFT, GRPO and the eval do not run (set force to retrain)"
    ]
    assert not (second.run_dir / "sft").exists() and not (second.run_dir / "evaluate").exists()
    assert second.seconds < first.seconds / 2, (second.seconds, first.seconds)

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
    assert only.version == "1"
    assert client.get_registered_model(MODEL).aliases == {"champion": "1"}
    assert only.tags["lingo.data_fingerprint"] == fingerprint
    assert only.tags["lingo.eval_footing_text"].startswith("5 questions (limit 5) of ")
    third_prep = client.search_runs(
        [client.get_experiment_by_name("lingo-rl").experiment_id],
        filter_string="tags.`lingo.step` = 'data-prep'",
    )
    prints = {r.data.tags["lingo.data_fingerprint"] for r in third_prep}
    assert len(prints) == 2 and fingerprint in prints  # each data prep run records its own
