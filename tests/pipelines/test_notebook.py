"""The RHOAI notebook run top to bottom with nbclient, against an emulated pipeline server.

The pipeline server is tests/kfp_run_emulator.py (an emulator: no KFP server can run here);
object storage is a real S3-compatible server (moto), reached through the variables of an
OpenShift AI data connection (``AWS_S3_ENDPOINT``, ``AWS_S3_BUCKET``, …). The run's "outputs"
are files written by the project's own writers (``MetricsWriter``, the eval runner with
scripted engines), which the emulator stores where the KFP launcher would. The notebook's
parameters come from the environment, as its parameters cell reads them: no cell is edited.
Every code cell's output is checked.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from kfp_run_emulator import RunOutputsEmulator, spec_tasks
from nbclient import NotebookClient
from s3_server import moto_s3_server

from pipelines.overrides import apply_overrides
from pipelines.presets import get_preset
from pipelines.run_form import form_arguments

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "rhoai_lingo_rl.ipynb"
TOKEN = "sha256~notebook-test-token"
BUCKET = "pipeline-root"
GRPO_STEPS = 6


def _grpo_work_dir(path: Path) -> Path:
    """A GRPO work directory as the step leaves it: lines by the real ``MetricsWriter``."""
    from trainer.metrics import MetricsWriter

    path.mkdir(parents=True)
    writer = MetricsWriter(path / "training_metrics.jsonl", max_steps=GRPO_STEPS)
    writer.log(0, eval_mean_reward=0.41, eval_real_word_share=0.93)
    for step in range(1, GRPO_STEPS + 1):
        writer.log(step, loss=0.05 - 0.004 * step, mean_reward=0.4 + 0.05 * step)
        if step % 3 == 0:
            writer.log(step, eval_mean_reward=0.4 + 0.06 * step, eval_real_word_share=0.95)
    (path / "summary.json").write_text(json.dumps({"steps": GRPO_STEPS}))
    return path


class _ScriptedEngine:
    """Answers every question in its own language (fixed responses, no model)."""

    description = "scripted"

    def generate(self, requests, sampling):
        from generation.requests import Generation

        words = {"en": "They are 168.", "fr": "Ils sont 168.", "de": "Es sind 168.",
                 "es": "Son 168.", "it": "Sono 168."}  # fmt: skip
        out = []
        for request in requests:
            answer = words[request.key.split("#")[0].split("-")[1]]
            out.append(
                Generation(
                    f"<|channel|>analysis<|message|>{answer}<|end|>"
                    f"<|start|>assistant<|channel|>final<|message|>{answer}<|return|>"
                )
            )
        return out

    def close(self) -> None:
        pass


def _eval_report(out: Path) -> Path:
    """``report.md`` as the eval step writes it (the real runner, scripted engines)."""
    from eval.eval_config import EvalConfig, SamplingSettings
    from eval.runner import run_eval

    config = EvalConfig(limit=5, sampling=SamplingSettings(n=1, seed=5, max_tokens=32))
    run_eval(["base=/m/base", "grpo=/m/grpo"], config, out, lambda spec, cfg: _ScriptedEngine())
    return out / "report.md"


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")


@pytest.mark.timeout(300)
def test_the_notebook_runs_top_to_bottom_against_an_emulated_pipeline_server(tmp_path):
    import boto3
    import torch

    work_dir = _grpo_work_dir(tmp_path / "grpo-work")
    report = _eval_report(tmp_path / "eval")
    metrics = [json.loads(line) for line in (work_dir / "training_metrics.jsonl").open()]
    with moto_s3_server() as s3_endpoint:
        s3 = boto3.client(
            "s3", endpoint_url=s3_endpoint, aws_access_key_id="test",
            aws_secret_access_key="test", region_name="us-east-1",
        )  # fmt: skip
        kfp = RunOutputsEmulator(
            s3,
            BUCKET,
            {("grpo", "training_log"): work_dir, ("evaluate", "report"): report},
            [{"state": "RUNNING"}] * 4 + [{"state": "SUCCEEDED"}],
        ).start()
        try:
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("AWS_", "KFP_", "LINGO_", "MPLBACKEND"))  # a workbench's
            }
            env.update(
                KFP_ENDPOINT=kfp.endpoint,
                KFP_TOKEN=TOKEN,
                AWS_S3_ENDPOINT=s3_endpoint,  # an OpenShift AI data connection's names
                AWS_S3_BUCKET=BUCKET,
                AWS_ACCESS_KEY_ID="test",
                AWS_SECRET_ACCESS_KEY="test",
                AWS_DEFAULT_REGION="us-east-1",
                LINGO_POLL_S="0",
                LINGO_WAIT_TIMEOUT_S="120",
                KUBECONFIG=str(tmp_path / "no-kubeconfig"),  # no cluster: job logs not followed
            )
            nb = nbformat.read(NOTEBOOK, as_version=4)
            client = NotebookClient(
                nb,
                timeout=240,
                kernel_name="python3",
                resources={"metadata": {"path": str(NOTEBOOK.parent)}},
            )
            client.execute(env=env)  # raises CellExecutionError at the first failing cell
        finally:
            kfp.stop()

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [o for c in code for o in c.outputs if o["output_type"] == "error"] == []
    parameters, setup, configure, capacity, submit, follow, plot, report_cell = code
    assert "parameters" in parameters.metadata["tags"] and parameters.outputs == []

    assert _text(setup) == (
        f"installed: nothing (all requirements present)\ntorch {torch.__version__} "
        "(the workbench's)\n"
    )
    assert _text(configure) == "gpt-oss-20b | GRPO max_steps 100 | samples/prompt 8\n"

    from capacity import format_table
    from pipelines.preset_capacity import run_estimates

    preset = apply_overrides(
        get_preset("gpt-oss-20b"),
        {"grpo.max_steps": "100", "grpo.rollout.n_samples": "8", "data_prep.eval_fraction": "0.1"},
    )
    plan, estimates = run_estimates(preset, "gpt-oss-20b")
    expected = (
        plan.render()
        + "\n"
        + "".join(
            f"\n{step.upper()}\n{format_table(result)}\n" for step, result in estimates.items()
        )
    )
    assert _text(capacity) == expected

    (run_id,) = kfp.runs
    assert _text(submit) == (
        f"pipeline server: {kfp.endpoint} | token from: KFP_TOKEN | CA bundle: default\n"
        f"run {run_id} {kfp.endpoint}/#/runs/details/{run_id}\n"
    )
    assert {c["auth"] for c in kfp.calls} == {f"Bearer {TOKEN}"}
    run = kfp.runs[run_id]
    assert run["runtime_config"]["parameters"] == json.loads(json.dumps(form_arguments(preset)))

    followed = _text(follow).splitlines()
    tasks = spec_tasks(kfp.specs[run["pipeline_version_reference"]["pipeline_version_id"]])
    assert "grpo" in tasks and "evaluate" in tasks and "grpo-2" not in tasks
    assert followed[0].startswith("job logs: not followed (no Kubernetes configuration")
    assert followed[1:3] == ["  exit-handler-1: RUNNING", f"run {run_id}: RUNNING"]
    assert followed[-1] == f"run {run_id}: SUCCEEDED"
    for task in tasks:  # every task seen finishing, after it was seen running (or at once)
        assert f"  {task}: SUCCEEDED" in followed
    assert followed.index("  exit-handler-1: SUCCEEDED") > followed.index(
        "  exit-handler-1: RUNNING"
    )
    artifact_reads = [c["path"] for c in kfp.calls if "/artifacts/" in c["path"]]
    assert len(artifact_reads) == 2  # training_log, then the report

    images = [o for o in plot.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    steps = [m for m in metrics if m.get("loss") is not None]
    last = steps[-1]
    assert _text(plot) == (
        f"{GRPO_STEPS} GRPO steps of {GRPO_STEPS}, 3 held-out evals; last step {GRPO_STEPS}: "
        f"loss {last['loss']:.4f}, mean reward {last['mean_reward']:.3f}, "
        f"{last['wall_time_s'] / 60:.1f} min of training\n"
    )

    (shown,) = [o for o in report_cell.outputs if o["output_type"] == "display_data"]
    assert shown["data"]["text/markdown"] == report.read_text()
    assert re.search(r"\| *grpo *\|", report.read_text())  # the report compares the models


def test_the_notebook_does_not_replace_torch_or_need_a_restart():
    """The setup cell installs no torch and no editable package (the issue's two failures)."""
    sources = [
        "".join(c.source)
        for c in nbformat.read(NOTEBOOK, as_version=4).cells
        if c.cell_type == "code"
    ]
    assert not any(
        line.lstrip().startswith(("%pip", "!pip")) for s in sources for line in s.splitlines()
    )
    assert "sys.path.insert(0, str(CHECKOUT))" in sources[1]
