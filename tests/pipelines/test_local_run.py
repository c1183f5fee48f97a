"""The whole pipeline under kfp.local, as `lingo run --local` runs it."""

import json

import pytest
from conftest import FAST_LOCAL_RUN as FAST
from conftest import read_jsonl, write_jsonl

from pipelines.local_console import LocalStepFailedError
from pipelines.local_run import run_local
from pipelines.presets import apply_overrides, get_preset


def test_local_pipeline_run_writes_the_step_outputs(tmp_path):
    """The demo's DAG end to end, with the SFT shortened (the demo itself trains longer)."""
    result = run_local(apply_overrides(get_preset("tiny-cpu"), FAST), tmp_path / "runs")
    train = read_jsonl(result.outputs["train_data"])
    evaluation = read_jsonl(result.outputs["eval_data"])
    assert len(train) >= 250 and len(evaluation) >= 25
    assert {r["reasoning_language"] for r in evaluation} == {"en", "fr", "de", "es", "it"}
    assert "Dataset card" in result.outputs["dataset_card"].read_text()
    assert result.pipeline_root == (tmp_path / "runs").resolve()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(result.outputs["sft_model"])
    assert model.config.hidden_size == 64
    report = result.outputs["sft_report"].read_text()
    assert "<img" in report and "last_loss" in report
    metrics = result.outputs["sft_model"].parent / "training_log" / "training_metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]  # the final eval is merged onto step 3
    assert lines[-1]["loss"] is not None and "eval_loss" in lines[-1]
    policy = AutoModelForCausalLM.from_pretrained(result.outputs["grpo_model"])
    assert policy.config.hidden_size == 64
    assert "held-out" in result.outputs["grpo_report"].read_text()
    results = json.loads(result.outputs["eval_results"].read_text())
    assert [m["label"] for m in results["models"]] == ["base", "sft", "grpo"]
    assert result.outputs["eval_report"].read_text().strip()
    reports = result.outputs["reports"]
    assert sorted(p.name for p in reports.iterdir()) == [
        "eval.html",
        "eval.md",
        "grpo.html",
        "sft.html",
    ]
    assert "<html" in (reports / "eval.html").read_text().lower()
    # quiet: kfp.local's own output went to the run's log, not to the terminal
    assert result.log_path.parent == (tmp_path / "runs" / "logs").resolve()
    assert "Executing task 'sft'" in result.log_path.read_text()


def test_local_pipeline_run_fails_on_bad_data_and_says_why(tmp_path, capfd):
    src = write_jsonl(tmp_path / "bad.jsonl", ["{nope"] * 3)
    preset = apply_overrides(get_preset("tiny-cpu"), {"data_prep.source": str(src)})
    with pytest.raises(LocalStepFailedError, match="step 'data-prep' failed: .*TooManyBadRows"):
        run_local(preset, tmp_path / "runs")
    out = capfd.readouterr()  # the failing step's last lines, printed below its line
    assert "data-prep          FAILURE" in out.out
    assert "TooManyBadRowsError" in out.out
    assert "bad.jsonl:1" in out.out


def test_capacity_check_fails_fast_with_the_table(tmp_path, capfd):
    """Hardware that cannot hold the model stops the run before SFT, naming what overflows."""
    too_small = {**FAST, "hardware.storage_gib": "0.0001"}  # 100 KiB for the checkpoints
    preset = apply_overrides(
        get_preset("tiny-cpu"), {k: v for k, v in too_small.items() if "." in k}
    )
    with pytest.raises(LocalStepFailedError, match="step 'capacity-check' failed"):
        run_local(preset, tmp_path / "runs")
    out = capfd.readouterr()
    assert "LayoutDoesNotFit" in out.out + out.err
    assert not list((tmp_path / "runs").glob("*/sft"))  # SFT never started


def test_a_second_run_into_the_same_output_dir_refuses_with_a_lock_message(tmp_path):
    # issue #17: on main two runs into one directory each printed the newer run's outputs
    import subprocess
    import sys

    from pipelines.local_run import OutputDirBusyError, run_local
    from pipelines.presets import DEFAULT_PRESET, get_preset

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from pipelines.local_run import output_dir_lock\n"
            f"with output_dir_lock(Path({str(tmp_path)!r})):\n"
            "    print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            OutputDirBusyError, match=rf"in use by another local run \(pid {holder.pid}"
        ):
            run_local(get_preset(DEFAULT_PRESET), tmp_path)
        assert not list(tmp_path.glob("lingo-*"))  # the refused run started nothing
    finally:
        holder.kill()
        holder.wait()
