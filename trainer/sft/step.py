"""The SFT step as the pipeline runs it: one process here, or N under torchrun; then a report."""

from __future__ import annotations

import html
import json
from pathlib import Path

from cluster.config import JobLaunch
from core.html_page import html_page, png_img
from trainer.sft.config import SFTConfig
from trainer.sft.recipe import SUMMARY_FILE, SFTResult, run_sft
from trainer.step_run import RecipePaths, TrainingStep, run_training_step


def read_sft_summary(work_dir: Path) -> SFTResult:
    """Rank 0's result, from the summary it wrote in ``work_dir``."""
    return SFTResult(**json.loads((work_dir / SUMMARY_FILE).read_text()))


SFT_STEP = TrainingStep("sft", "trainer.sft", "base-model", run_sft, read_sft_summary)


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
    paths = RecipePaths(base_model, train_path, eval_path, model_output, work_dir)
    return run_training_step(SFT_STEP, cfg, paths, launch)


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
