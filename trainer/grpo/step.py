"""The GRPO step as the pipeline runs it: one process here, or N under torchrun; then a report."""

from __future__ import annotations

import html
from pathlib import Path

from cluster.config import JobLaunch
from core.html_page import html_page, png_img
from trainer.grpo.config import GRPOConfig
from trainer.grpo.recipe import GRPOResult, read_summary, run_grpo
from trainer.step_run import RecipePaths, TrainingStep, run_training_step

GRPO_STEP = TrainingStep("grpo", "trainer.grpo", "sft-model", run_grpo, read_summary)


def run_grpo_step(
    cfg: GRPOConfig,
    sft_model: str | Path,
    train_path: str | Path,
    eval_path: str | Path,
    model_output: str | Path,
    work_dir: str | Path,
    launch: JobLaunch | None = None,
) -> GRPOResult:
    """Run GRPO with ``cfg.nproc`` processes (here, or as a PyTorchJob when ``launch`` says so)
    and return rank 0's result."""
    megatron = getattr(cfg.optim, "megatron", None)
    staged = ("optim.megatron.checkpoint",) if megatron and megatron.checkpoint else ()
    paths = RecipePaths(sft_model, train_path, eval_path, model_output, work_dir)
    return run_training_step(GRPO_STEP, cfg, paths, launch, staged)


def grpo_metrics(result: GRPOResult) -> dict[str, float]:
    """Scalars for KFP ``Metrics`` / MLflow: held-out metrics before and of the exported policy."""
    out: dict[str, float] = {"steps": result.steps, "exported_step": result.exported_step}
    for key, value in result.baseline.metrics().items():
        out[f"sft_{key}"] = value
    for key, value in result.exported.metrics().items():
        out[f"policy_{key}"] = value
    out["mean_reward_gain"] = result.exported.mean_reward - result.baseline.mean_reward
    return out


def render_grpo_html(result: GRPOResult) -> str:
    """A small HTML page for the KFP UI: the reward/loss plots and the held-out comparison."""
    baseline, exported = result.baseline.metrics(), result.exported.metrics()
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{baseline.get(k, float('nan')):.3f}</td>"
        f"<td>{exported.get(k, float('nan')):.3f}</td></tr>"
        for k in sorted(set(baseline) | set(exported))
    )
    image = ""
    if result.plot and Path(result.plot).exists():
        image = png_img(Path(result.plot).read_bytes(), "GRPO metrics")
    return html_page(
        "lingo-rl GRPO",
        "<h2>GRPO</h2>"
        f"<p>exported policy: step {result.exported_step} of {result.steps} "
        "(best held-out reward whose real-word share stayed within the guard)</p>"
        "<table><tr><th>held-out</th><th>SFT model</th>"
        f"<th>GRPO policy</th></tr>{rows}</table>{image}",
    )
