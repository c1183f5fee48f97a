"""The whole pipeline under kfp.local, as `lingo run --local` runs it."""

import json

import pytest
from browser import WINDOW, chromium, render
from conftest import FAST_LOCAL_RUN as FAST
from conftest import read_jsonl, write_jsonl

from core.tracking import mlflow_ui_command
from eval.gate import GateConfig
from pipelines.local_console import LocalStepFailedError
from pipelines.local_run import run_local, tracking_summary
from pipelines.overrides import apply_overrides
from pipelines.presets import get_preset


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    """The demo's DAG end to end, with the SFT shortened (the demo itself trains longer), with
    no MLFLOW_TRACKING_URI set (as `make demo` runs)."""
    root = tmp_path_factory.mktemp("local")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        env.chdir(root)  # nothing may land in the directory lingo runs from
        return run_local(apply_overrides(get_preset("tiny-cpu"), FAST), root / "runs")


def test_local_pipeline_run_writes_the_step_outputs(fast_run):
    result = fast_run
    train = read_jsonl(result.outputs["train_data"])
    evaluation = read_jsonl(result.outputs["eval_data"])
    assert len(train) >= 250 and len(evaluation) >= 25
    assert {r["reasoning_language"] for r in evaluation} == {"en", "fr", "de", "es", "it"}
    assert "Dataset card" in result.outputs["dataset_card"].read_text()
    assert result.run_dir.parent == result.pipeline_root
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
    # quiet: kfp.local's own output went to the run's log, not to the terminal
    assert result.log_path.parent == result.pipeline_root / "logs"
    assert "Executing task 'sft'" in result.log_path.read_text()


REPORTS = {"eval.html": "eval_report_html", "sft.html": "sft_report", "grpo.html": "grpo_report"}


def test_the_reports_are_files_under_their_own_names(fast_run):
    """Copies, not symlinks to the extensionless outputs (issue #30: a browser showed those as
    source text)."""
    reports = fast_run.outputs["reports"]
    assert sorted(p.name for p in reports.iterdir()) == sorted([*REPORTS, "eval.md"])
    for name, output in {**REPORTS, "eval.md": "eval_report"}.items():
        page = reports / name
        assert page.is_file() and not page.is_symlink()
        assert page.read_bytes() == fast_run.outputs[output].read_bytes()


@pytest.mark.skipif(chromium() is None, reason="no chromium on PATH (apt-get install chromium)")
@pytest.mark.parametrize("name", sorted(REPORTS))
def test_each_report_renders_in_a_real_browser(fast_run, name, tmp_path):
    """Headless Chromium opens reports/<name> as a user's browser would (.ci/run installs it):
    the page is HTML (its tables and images are elements, not text in a <pre>), every image
    decodes, and nothing is wider than the window (the eval's row of four charts fits)."""
    shown = render(fast_run.outputs["reports"] / name, tmp_path)
    assert not shown.all("pre"), shown.dom[:300]
    assert shown.all("table") and shown.all("img")
    assert all(i.attrs["src"].startswith("data:image/png;base64,") for i in shown.all("img"))
    assert shown.layout["images"] and all(i["loaded"] for i in shown.layout["images"])
    width = shown.layout["viewport"]
    assert width == WINDOW[0] and shown.layout["document"] <= width, shown.layout
    assert all(0 <= i["left"] < i["right"] <= width for i in shown.layout["images"])
    from PIL import Image

    with Image.open(shown.screenshot) as screenshot:
        assert screenshot.size == WINDOW
        colours = screenshot.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # text, table rules and charts were drawn


def test_the_run_tracks_to_an_sqlite_store_in_its_output_dir(fast_run):
    """No tracking URI set: one MLflow run for the pipeline, a nested run per step, in
    <output dir>/mlflow.db (artifacts beside it), read back by the lines the demo ends with."""
    from mlflow import MlflowClient

    root = fast_run.pipeline_root
    uri = f"sqlite:///{root}/mlflow.db"
    assert fast_run.tracking_uri == uri
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("lingo-rl")
    assert experiment.artifact_location.endswith(f"{root}/mlartifacts")
    (parent,) = client.search_runs(
        [experiment.experiment_id], filter_string="tags.`lingo.pipeline_run_id` != ''"
    )
    assert parent.info.status == "FINISHED"  # closed by the exit handler
    steps = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
    )
    assert {r.data.tags["lingo.step"] for r in steps} >= {"data-prep", "sft", "grpo", "gate"}
    assert (root / "mlartifacts").is_dir() and not list(root.parent.glob("mlruns"))
    gate = next(r for r in steps if r.data.tags["lingo.step"] == "gate")
    lines = tracking_summary(fast_run, GateConfig())
    assert lines[0].startswith(f"MLflow: run '{parent.info.run_name}' (FINISHED) with")
    assert f"gate: {gate.data.params['decision']}" in lines[1]
    assert lines[-1] == f"open it: {mlflow_ui_command(uri)} (then http://127.0.0.1:5000)"


def test_local_pipeline_run_fails_on_bad_data_and_says_why(tmp_path, capfd):
    src = write_jsonl(tmp_path / "bad.jsonl", ["{nope"] * 3)
    preset = apply_overrides(get_preset("tiny-cpu"), {"data_prep.source": str(src)})
    with pytest.raises(LocalStepFailedError, match="step 'data-prep' failed: .*TooManyBadRows"):
        run_local(preset, tmp_path / "runs")
    out = capfd.readouterr()  # the failing step's last lines, printed below its line
    assert "data-prep          FAILURE" in out.out
    assert "TooManyBadRowsError" in out.out
    assert "bad.jsonl:1" in out.out


@pytest.mark.slow  # ~75 s: the pipeline's seven steps up to the capacity check
def test_capacity_check_fails_fast_with_the_table(tmp_path, capfd):
    """Hardware that cannot hold the model stops the run before SFT, naming what overflows.

    Slow; its path runs by default in three faster tests: the check failing on this volume
    with the tables in its error (tests/trainer/test_capacity_check.py::
    test_a_volume_too_small_for_the_checkpoints_fails_the_check_with_the_table), SFT waiting
    on the check in the compiled DAG (tests/pipelines/test_compile.py::
    test_the_tiny_presets_yaml_runs_configure_first_and_holds_only_the_hf_branch), and
    kfp.local stopping the run at a failed step and printing its error
    (test_local_pipeline_run_fails_on_bad_data_and_says_why)."""
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
