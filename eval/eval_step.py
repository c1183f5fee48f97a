"""The eval, gate and register steps as the pipeline's components call them.

Each takes plain paths and dicts (what a KFP component has) and returns what the component
publishes, so the components stay a few lines and everything here is tested without KFP.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from core.tracking import log_artifact, log_metrics, mlflow_run
from eval.eval_config import EvalConfig
from eval.gate import GateConfig, GateDecision, apply_gate, check_data, evaluate_gate
from eval.report import kfp_metrics, load_results
from eval.runner import ModelSpec, run_eval

log = logging.getLogger(__name__)


def run_eval_step(
    models: Mapping[str, str | None],
    config: Mapping,
    results_path: str | Path,
    markdown_path: str | Path,
    html_path: str | Path,
) -> dict[str, float]:
    """Evaluate the models (label → directory or URL; ``None`` entries are skipped) and put
    ``results.json``, the Markdown and the HTML report at the given paths.

    Returns:
        The scalars for ``Output[Metrics]``.

    Raises:
        TooManyFailuresError: Too many responses failed (after the reports are written to the
            MLflow run, if tracking is on).
    """
    specs = [ModelSpec(label, location) for label, location in models.items() if location]
    with tempfile.TemporaryDirectory(prefix="lingo-eval-") as work:
        results = run_eval(specs, EvalConfig.model_validate(dict(config)), work)
        for name, target in (
            ("results.json", results_path),
            ("report.md", markdown_path),
            ("report.html", html_path),
        ):
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(work) / name, target)
    return kfp_metrics(results.to_dict())


def run_gate_step(
    results_path: str | Path,
    candidate_dir: str | Path,
    config: Mapping,
    report_path: str | Path | None = None,
    apply: bool = False,
    data_fingerprint: str = "",
) -> GateDecision:
    """Decide (``apply=False``) or decide and register (``apply=True``, the version tagged
    with ``data_fingerprint``); write the gate report to ``report_path`` when given. The
    decision is one ``decision |`` line of the step's output (the deciding step's: the
    ``register`` step logs its own at debug level)."""
    gate_config = GateConfig.model_validate(dict(config))
    results = load_results(results_path)
    if apply:
        decision = apply_gate(results, candidate_dir, gate_config, data_fingerprint)
    else:
        decision = evaluate_gate(results, candidate_dir, gate_config)
    if report_path is not None:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(decision.to_markdown(), encoding="utf-8")
    log.log(logging.DEBUG if apply else logging.INFO, "%s", decision.line())
    params = {
        "decision": decision.decision.value,
        "metric": decision.metric,
        "margin": decision.margin,
        "reference": decision.reference,
        "registered_version": decision.registered_version or "",
    }
    with mlflow_run("register" if apply else "gate", params) as run:
        if run is not None:
            log_metrics(
                {"candidate_value": decision.candidate_value,
                 "reference_value": decision.reference_value}
            )  # fmt: skip
            if report_path is not None:
                log_artifact(report_path, artifact_path="gate")
    return decision


def run_data_check_step(fingerprint: str, config: Mapping) -> str:
    """``retrain`` or ``unchanged data``: the data fingerprint against the champion's
    (``eval.gate.check_data``)."""
    return check_data(fingerprint, GateConfig.model_validate(dict(config)))


def run_champion_step(config: Mapping, destination: str | Path) -> str:
    """Download the champion's files into ``destination`` for the eval; returns its version,
    or ``""`` (``destination`` then holds only ``NO_CHAMPION``: no tracking URI, no champion).
    """
    from core.tracking import tracking_enabled
    from eval.registry import aliased_version, download_version

    gate_config = GateConfig.model_validate(dict(config))
    champion = None
    if tracking_enabled():
        champion = aliased_version(gate_config.registered_model, gate_config.alias)
    if champion is None:
        Path(destination).mkdir(parents=True, exist_ok=True)
        (Path(destination) / NO_CHAMPION).write_text("no champion to evaluate\n")
        log.info("no %s of %s: nothing to evaluate beside the candidate", gate_config.alias,
                 gate_config.registered_model)  # fmt: skip
        return ""
    download_version(champion, destination)
    return champion.version


NO_CHAMPION = "NO_CHAMPION"
"""The file the champion step leaves in its model folder when there is no champion."""


def champion_location(model_dir: str | Path | None) -> str | None:
    """The champion's model folder for the eval, or ``None`` (no champion was downloaded)."""
    if model_dir is None or (Path(model_dir) / NO_CHAMPION).exists():
        return None
    return str(model_dir)
