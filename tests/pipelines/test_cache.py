"""``lingo run --local --cache`` reuses a step only when what it reads is the same (issue #44,
item 3).

kfp.local (2.17, ``kfp/local/cache.py``) keys a task on its component, image, command,
arguments and container environment: a path given as an argument is keyed by its name, not by
what it holds. On main, two cached runs with ``model.source=DIR`` and ``DIR/model.safetensors``
replaced between them: run 2 logged ``Task base-model cache hit`` and trained on run 1's
weights; ``start-tracking cache hit`` nested run 2's step runs under run 1's finished MLflow
run, and run 2 ended ``error: …/start-tracking/executor_output.json: no such file``.
"""

from __future__ import annotations

import shutil

import pytest
import yaml
from conftest import FAST_LOCAL_RUN as FAST
from kfp import compiler
from kfp.local.cache import LocalCache

from eval.runner import BUNDLED_QUESTIONS
from pipelines.local_run import input_fingerprints, run_local
from pipelines.overrides import apply_overrides
from pipelines.pipeline import INPUT_FINGERPRINT_ENV, NEVER_CACHED, build_pipeline
from pipelines.presets import get_preset


def _spec(preset, tmp_path, fingerprints=None) -> dict:
    path = tmp_path / "pipeline.yaml"
    compiler.Compiler().compile(build_pipeline(preset, input_fingerprints=fingerprints), str(path))
    return next(yaml.safe_load_all(path.read_text()))


def _tasks(spec: dict) -> dict[str, dict]:
    """Every task of the pipeline spec, its DAG nesting flattened."""
    found = {}
    dags = [spec["root"]["dag"], *(c["dag"] for c in spec["components"].values() if "dag" in c)]
    for dag in dags:
        found |= dag["tasks"]
    return found


def test_tracking_gate_register_and_publish_are_never_cached(tmp_path):
    tasks = _tasks(_spec(get_preset("tiny-cpu"), tmp_path))
    for name in NEVER_CACHED:
        assert tasks[name]["cachingOptions"] == {}, name  # enableCache false: left out
    assert tasks["base-model"]["cachingOptions"] == {"enableCache": True}


def _cache_key(spec: dict, task: str, cache_root) -> str:
    """The key kfp.local computes for ``task`` (its arguments left out: the same here)."""
    component = _tasks(spec)[task]["componentRef"]["name"]
    executor = spec["deploymentSpec"]["executors"][f"exec-{component.removeprefix('comp-')}"]
    container = executor["container"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    command = container["command"] + container["args"]
    return LocalCache(str(cache_root)).compute_key(component, container["image"], command, {}, env)


def test_replacing_the_model_weights_changes_the_base_models_cache_key(tmp_path):
    from trainer.tiny_model import SMALLEST, build_tiny_model

    model = build_tiny_model(tmp_path / "model", SMALLEST)
    preset = apply_overrides(get_preset("tiny-cpu"), {"model.source": str(model)})
    first = input_fingerprints(preset)
    assert set(first) == {"base-model"}  # bundled data, bundled questions: no local path
    assert input_fingerprints(preset) == first  # the same files: the same key
    other = build_tiny_model(tmp_path / "other", SMALLEST.model_copy(update={"seed": 1}))
    shutil.copy(other / "model.safetensors", model / "model.safetensors")
    second = input_fingerprints(preset)
    assert second["base-model"] != first["base-model"]
    keys = [
        _cache_key(_spec(preset, tmp_path, fingerprints), "base-model", tmp_path / "cache")
        for fingerprints in (first, second)
    ]
    assert keys[0] != keys[1]
    executor = _spec(preset, tmp_path, second)["deploymentSpec"]["executors"]["exec-base-model"]
    assert {"name": INPUT_FINGERPRINT_ENV, "value": second["base-model"]} in executor["container"][
        "env"
    ]


def test_changed_eval_questions_change_the_eval_steps_fingerprint(tmp_path):
    questions = tmp_path / "q.jsonl"
    shutil.copy(BUNDLED_QUESTIONS, questions)
    preset = apply_overrides(get_preset("tiny-cpu"), {"eval.questions": str(questions)})
    before = input_fingerprints(preset)["evaluate"]
    questions.write_text(questions.read_text().replace("?", "? "))
    assert input_fingerprints(preset)["evaluate"] != before


@pytest.mark.slow  # two local runs to the capacity check: 8-17 min on a loaded 2-core machine
@pytest.mark.timeout(2400)
def test_a_second_cached_run_with_replaced_weights_rebuilds_the_base_model(tmp_path):
    from trainer.tiny_model import SMALLEST, build_tiny_model

    model = build_tiny_model(tmp_path / "model", SMALLEST)
    stop = {**FAST, "hardware.storage_gib": "0.0001", "model.source": str(model)}
    preset = apply_overrides(get_preset("tiny-cpu"), {k: v for k, v in stop.items() if "." in k})
    from pipelines.local_console import LocalStepFailedError

    out = tmp_path / "runs"
    with pytest.raises(LocalStepFailedError, match="capacity-check"):
        run_local(preset, out, enable_caching=True)
    other = build_tiny_model(tmp_path / "other", SMALLEST.model_copy(update={"seed": 1}))
    shutil.copy(other / "model.safetensors", model / "model.safetensors")
    with pytest.raises(LocalStepFailedError, match="capacity-check"):
        run_local(preset, out, enable_caching=True)
    first, second = sorted((out / "logs").glob("run-*.log"))
    log = second.read_text()
    assert "Task base-model cache hit" not in log
    assert "Executing task 'base-model'" in log
    assert "Executing task 'start-tracking'" in log and "start-tracking cache hit" not in log
    assert "Executing task 'configure'" not in log  # it reads only its arguments: reused
    runs = sorted(out.glob("lingo-rl-*"))
    assert (runs[-1] / "base-model" / "model" / "model.safetensors").read_bytes() == (
        other / "model.safetensors"
    ).read_bytes()
