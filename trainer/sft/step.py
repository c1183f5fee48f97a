"""The SFT step as the pipeline runs it: one process here, or N under torchrun; then a report."""

from __future__ import annotations

import html
import json
from pathlib import Path

from cluster.config import JobLaunch
from cluster.torchrun import run_step_processes
from core.html_page import html_page, png_img
from trainer.metrics import METRICS_FILE
from trainer.sft.config import SFTConfig
from trainer.sft.recipe import SUMMARY_FILE, SFTResult, run_sft


def run_sft_step(
    cfg: SFTConfig,
    base_model: str | Path,
    train_path: str | Path,
    eval_path: str | Path | None,
    model_output: str | Path,
    work_dir: str | Path,
    launch: JobLaunch | None = None,
) -> SFTResult:
    """Run SFT with ``cfg.nproc`` processes (here, or as a PyTorchJob when ``launch`` says so)
    and return rank 0's result."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if launch is not None and launch.as_job:
        from cluster.step_job import StepJob, run_step_job

        job = StepJob(
            "sft", "trainer.sft", cfg, "base-model", base_model, train_path, eval_path,
            metrics_file=METRICS_FILE,
        )  # fmt: skip
        run_step_job(
            job, launch.execution, launch.run_id, model_output, work_dir,
            launch.manifest_path, launch.image,
        )  # fmt: skip
        return SFTResult(**json.loads((work_dir / SUMMARY_FILE).read_text()))
    if cfg.nproc == 1:
        result = run_sft(cfg, base_model, train_path, eval_path, model_output, work_dir)
        assert result is not None  # a single process is rank 0
        return result
    args = [
        "--base-model", str(base_model), "--train", str(train_path),
        "--model-output", str(model_output), "--work-dir", str(work_dir),
    ]  # fmt: skip
    if eval_path:
        args += ["--eval", str(eval_path)]
    run_step_processes("trainer.sft", cfg, args, work_dir / "sft_config.json")
    return SFTResult(**json.loads((work_dir / SUMMARY_FILE).read_text()))


def sft_metrics(result: SFTResult) -> dict[str, float]:
    """Scalars for KFP ``Metrics`` / MLflow."""
    out = {
        "steps": result.steps,
        "first_loss": result.first_loss,
        "last_loss": result.last_loss,
        "examples": result.examples,
        "dropped_overlong": result.dropped_overlong,
        "truncated": result.truncated,
        "merge_max_abs_diff": max(
            result.merge["max_abs_diff_in_memory"], result.merge["max_abs_diff_after_reload"]
        ),
    }
    if result.eval_loss is not None:
        out["eval_loss"] = result.eval_loss
    return out


def render_sft_html(result: SFTResult) -> str:
    """A small HTML page for the KFP UI: the loss plot and the headline numbers."""
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>"
        for k, v in sft_metrics(result).items()
    )
    image = ""
    if result.loss_plot and Path(result.loss_plot).exists():
        image = png_img(Path(result.loss_plot).read_bytes(), "SFT loss")
    return html_page(
        "lingo-rl SFT",
        f"<h2>SFT</h2>{image}<table>{rows}</table>"
        f"<p>merged model: {html.escape(result.model_dir)}</p>",
    )
