"""The promotion gate: does the GRPO model beat the champion, and if so, register it.

Rule (``decide``, a pure function): the candidate is promoted when

    candidate[metric] − reference[metric] > margin

where the reference is the current ``champion`` version (its value is the
``lingo.eval.<metric>`` tag stored when it was promoted) or, when there is no champion, the
baseline model of the same eval run (the SFT model). Before that:

* a candidate without a value for the metric (e.g. every response failed) is kept out;
* with ``min_real_word_share`` set, a candidate whose real-word share is below it is kept out
  (reward hacking by degenerate text, which the metric may not see);
* a candidate whose content hash equals the champion's is ``unchanged`` (re-run on the same
  model: no new version, alias untouched);
* a champion without a value for the metric is not replaced automatically.

Outcomes: ``promote``, ``keep`` (not better, or guarded), ``unchanged``, ``skipped`` (no
tracking URI, or no candidate in the results). Only ``promote`` leads to registry writes; any
other outcome ends the run green with the reason in the gate report.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path

from pydantic import ConfigDict, Field, field_validator, model_validator

from core.config_model import ConfigModel
from core.tracking import tracking_enabled
from eval.eval_metrics import METRICS
from eval.registry import (
    RegisteredVersion,
    aliased_version,
    content_sha256,
    find_version,
    register_directory,
    set_alias,
    update_metric_tags,
)

log = logging.getLogger(__name__)

LOWER_IS_BETTER = frozenset({"loop_rate", "repeated_ngram_rate"})
PIPELINE_LABELS = ("base", "sft", "grpo")
"""The labels of the models the pipeline's evaluate step compares (``components.evaluate``)."""
ALIAS_PATTERN = re.compile(r"[\w\-]{1,255}")
"""What MLflow's registry accepts as an alias (``mlflow.utils.validation``:
``_REGISTERED_MODEL_ALIAS_REGEX``, ``MAX_REGISTERED_MODEL_ALIAS_LENGTH``) …"""
RESERVED_ALIAS = re.compile(r"[vV]\d+|(?i:latest)")
"""… and what it reserves: ``v<digits>`` names a version, ``latest`` the newest one
(``_validate_model_alias_name_reserved``)."""


class GateConfig(ConfigModel):
    """Settings of the gate.

    Attributes:
        registered_model: Name in the MLflow model registry.
        alias: The alias that marks the model in production.
        metric: The overall eval metric compared (higher is better).
        margin: How much the candidate must exceed the reference by (strictly).
        candidate: Label of the candidate model in the eval results.
        baseline: Label of the model compared against when there is no champion.
        min_real_word_share: Degeneracy guard; ``None`` disables it.
    """

    model_config = ConfigDict(extra="forbid")

    registered_model: str = "lingo-gpt-oss"
    alias: str = "champion"
    metric: str = "both_language_accuracy"
    margin: float = Field(0.0, ge=0.0)
    candidate: str = "grpo"
    baseline: str = "sft"
    min_real_word_share: float | None = Field(None, ge=0.0, le=1.0)

    @field_validator("registered_model")
    @classmethod
    def _registry_name(cls, value: str) -> str:
        # MLflow's _validate_model_name: not blank, no '/' or ':'; and no path tricks
        if not value.strip():
            raise ValueError("the registered model's name is empty")
        if any(c in value for c in "/:") or value.strip() in (".", ".."):
            raise ValueError(f"{value!r}: MLflow registry names cannot contain '/' or ':'")
        return value

    @field_validator("alias")
    @classmethod
    def _registry_alias(cls, value: str) -> str:
        if not ALIAS_PATTERN.fullmatch(value):
            raise ValueError(f"{value!r}: an MLflow alias is 1-255 letters, digits, '_' or '-'")
        if RESERVED_ALIAS.fullmatch(value):
            raise ValueError(
                f"{value!r}: MLflow reserves 'latest' and v<number> (they name versions); "
                "pick another alias, e.g. champion"
            )
        return value

    @field_validator("candidate", "baseline")
    @classmethod
    def _pipeline_label(cls, value: str) -> str:
        if value not in PIPELINE_LABELS:
            raise ValueError(
                f"{value!r} is not a model the pipeline's eval compares; one of "
                f"{', '.join(PIPELINE_LABELS)}"
            )
        return value

    @model_validator(mode="after")
    def _candidate_is_not_its_baseline(self) -> GateConfig:
        if self.candidate == self.baseline:
            raise ValueError(f"candidate and baseline are both {self.candidate!r}")
        return self

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value not in METRICS or value in LOWER_IS_BETTER:
            allowed = [m for m in METRICS if m not in LOWER_IS_BETTER]
            raise ValueError(f"gate metric must be one of {allowed}, got {value!r}")
        return value


class Decision(StrEnum):
    """What the gate decided."""

    PROMOTE = "promote"
    KEEP = "keep"
    UNCHANGED = "unchanged"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class GateDecision:
    """The gate's decision and why.

    Attributes:
        decision: The outcome.
        reason: One sentence a person reads in the report.
        metric: The metric compared.
        margin: The margin required.
        candidate_value: The candidate's metric value.
        reference: What it was compared with (``champion v3``, ``sft``, ``none``).
        reference_value: The reference's metric value.
        content_sha256: The candidate's content hash.
        champion_version: The champion version before the gate (``None``: there was none).
        registered_version: The version the alias points to after ``promote`` (set by
            ``apply_gate``).
    """

    decision: Decision
    reason: str
    metric: str
    margin: float
    candidate_value: float | None = None
    reference: str = "none"
    reference_value: float | None = None
    content_sha256: str | None = None
    champion_version: str | None = None
    registered_version: str | None = None

    def to_dict(self) -> dict:
        """JSON-friendly form."""
        return asdict(self) | {"decision": self.decision.value}

    def to_markdown(self) -> str:
        """The gate report (for ``Output[Markdown]``)."""

        def number(value: float | None) -> str:
            return "–" if value is None else f"{value:.4f}"

        rows = [
            ("decision", f"**{self.decision.value}**"),
            ("reason", self.reason),
            ("metric", f"`{self.metric}` (margin {self.margin})"),
            ("candidate", number(self.candidate_value)),
            (f"reference ({self.reference})", number(self.reference_value)),
            ("candidate content sha256", f"`{self.content_sha256 or '–'}`"),
            ("champion before", self.champion_version or "none"),
            ("champion after", self.registered_version or self.champion_version or "none"),
        ]
        lines = ["# Promotion gate", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
        return "\n".join(lines) + "\n"


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def decide(
    config: GateConfig,
    candidate_metrics: dict[str, float | None],
    champion: RegisteredVersion | None,
    baseline_metrics: dict[str, float | None] | None,
    candidate_sha256: str | None,
) -> GateDecision:
    """Apply the gate rule (see the module docstring). Pure: no registry access.

    Args:
        config: The gate settings.
        candidate_metrics: The candidate's overall metric values.
        champion: The current champion version, if any.
        baseline_metrics: The baseline model's overall values in the same eval, if present.
        candidate_sha256: The candidate's content hash.
    """
    metric = config.metric
    base = {
        "metric": metric,
        "margin": config.margin,
        "content_sha256": candidate_sha256,
        "champion_version": champion.version if champion else None,
    }
    value = _finite(candidate_metrics.get(metric))
    if value is None:
        return GateDecision(Decision.KEEP, f"the candidate has no value for {metric}", **base)
    base["candidate_value"] = value
    share = _finite(candidate_metrics.get("real_word_share"))
    if config.min_real_word_share is not None and (
        share is None or share < config.min_real_word_share
    ):
        return GateDecision(
            Decision.KEEP,
            f"degenerate text: real-word share {share} is below {config.min_real_word_share}",
            **base,
        )
    if champion is not None:
        base["reference"] = f"{config.alias} v{champion.version}"
        if candidate_sha256 is not None and champion.content_sha256 == candidate_sha256:
            return GateDecision(
                Decision.UNCHANGED,
                f"the candidate is already {config.alias} (version {champion.version}, same "
                "content hash); nothing registered",
                reference_value=_finite(champion.metrics.get(metric)),
                **base,
            )
        reference_value = _finite(champion.metrics.get(metric))
        if reference_value is None:
            return GateDecision(
                Decision.KEEP,
                f"{config.alias} version {champion.version} has no recorded {metric}; "
                "it is not replaced automatically (move the alias by hand if wanted)",
                **base,
            )
    elif baseline_metrics is not None and _finite(baseline_metrics.get(metric)) is not None:
        base["reference"] = config.baseline
        reference_value = _finite(baseline_metrics.get(metric))
    else:
        return GateDecision(
            Decision.PROMOTE,
            f"no {config.alias} yet and no '{config.baseline}' result to compare with: "
            "the first candidate becomes the champion",
            **base,
        )
    assert reference_value is not None
    gain = value - reference_value
    verdict = Decision.PROMOTE if gain > config.margin else Decision.KEEP
    comparison = "beats" if verdict is Decision.PROMOTE else "does not beat"
    return GateDecision(
        verdict,
        f"{metric} {value:.4f} {comparison} {base['reference']} ({reference_value:.4f}) by more "
        f"than {config.margin} (difference {gain:+.4f})",
        reference_value=reference_value,
        **base,
    )


def _overall(results: dict, label: str) -> dict[str, float | None] | None:
    for model in results["models"]:
        if model["label"] == label:
            return {k: v["value"] for k, v in model["summary"]["overall"].items()}
    return None


def evaluate_gate(results: dict, candidate_dir: str | Path, config: GateConfig) -> GateDecision:
    """Decide with the registry's current champion (read-only).

    Args:
        results: The eval's ``results.json`` content.
        candidate_dir: The candidate's model directory (hashed).
        config: The gate settings.
    """
    candidate = _overall(results, config.candidate)
    if candidate is None:
        return GateDecision(
            Decision.SKIPPED,
            f"no model labelled '{config.candidate}' in the eval results",
            config.metric,
            config.margin,
        )
    sha = content_sha256(candidate_dir)
    baseline = _overall(results, config.baseline)
    if not tracking_enabled():
        preview = decide(config, candidate, None, baseline, sha)
        return replace(
            preview,
            decision=Decision.SKIPPED,
            reason=f"no MLFLOW_TRACKING_URI, so no registry; against {preview.reference}: "
            f"{preview.reason}",
        )
    champion = aliased_version(config.registered_model, config.alias)
    return decide(config, candidate, champion, baseline, sha)


def apply_gate(results: dict, candidate_dir: str | Path, config: GateConfig) -> GateDecision:
    """Decide against the current champion and, on ``promote``, register and move the alias.

    Idempotent: a candidate whose content hash is already a version reuses it (its metric
    tags are refreshed); a candidate that is already the champion changes nothing.
    """
    decision = evaluate_gate(results, candidate_dir, config)
    if decision.decision is not Decision.PROMOTE:
        log.info("gate: %s (%s)", decision.decision.value, decision.reason)
        return decision
    assert decision.content_sha256 is not None
    metrics = _overall(results, config.candidate) or {}
    existing = find_version(config.registered_model, decision.content_sha256)
    if existing is None:
        version = register_directory(
            config.registered_model,
            candidate_dir,
            decision.content_sha256,
            metrics,
            tags={
                "lingo.questions_sha256": results.get("questions_sha256", ""),
                "lingo.evaluated_at": results.get("created_at", ""),
            },
        )
    else:
        version = existing
        update_metric_tags(config.registered_model, version.version, metrics)
    set_alias(config.registered_model, config.alias, version.version)
    log.info(
        "gate: %s version %s is now %s", config.registered_model, version.version, config.alias
    )
    return replace(decision, registered_version=version.version)
