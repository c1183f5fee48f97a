"""The promotion gate: does the GRPO model beat the champion, and if so, register it.

Rule (``decide``, a pure function). With a champion, the champion is evaluated in the same
eval run as the candidate (label ``champion``: same questions, samples and seeds), and the
candidate is promoted when it is better **with confidence**: the paired bootstrap over
questions (``eval.paired``) gives a one-sided lower bound of the mean per-question difference
at level ``confidence`` that exceeds ``margin``, and the exact sign test over the questions it
won and lost agrees at the same level. Before that:

* a candidate without a value for the metric (e.g. every response failed) is kept out;
* with ``min_real_word_share`` set, a candidate whose real-word share is below it is kept out
  (reward hacking by degenerate text, which the metric may not see);
* a candidate whose content hash equals the champion's is ``unchanged`` (re-run on the same
  model: no new version, alias untouched);
* the comparison is **refused** when this eval's footing (question file, limit, languages,
  sampling, prompts: ``EvalFooting``) is not the one the champion was promoted on, or when the
  champion was not evaluated in this run: a ``--set eval.limit=1`` eval cannot replace a
  champion evaluated on all the questions.

Without a champion the candidate is compared with the ``baseline`` model of the same run (the
SFT model): promoted when its value exceeds the baseline's by more than ``margin``; with no
baseline (``baseline: ''``) the first candidate becomes the champion.

Outcomes: ``promote``, ``keep`` (not better, or guarded), ``unchanged``, ``refused`` (not on
the same footing), ``skipped`` (no tracking URI, or no candidate in the results). Only
``promote`` leads to registry writes (and to ``publish``); any other outcome ends the run
green with the reason in the gate report and one ``decision |`` line in the run's output.

Before training, ``check_data`` ends a run early as ``unchanged data`` when its data
fingerprint equals the champion's (``force`` retrains anyway).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from core.config_model import ConfigModel
from core.tracking import tracking_enabled
from eval.eval_metrics import METRICS
from eval.paired import PairedComparison, compare
from eval.registry import (
    DATA_FINGERPRINT_TAG,
    FOOTING_TAG,
    FOOTING_TEXT_TAG,
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
        margin: How much the candidate must exceed the reference by (strictly): against the
            champion, the paired test's lower bound must exceed it.
        candidate: Label of the candidate model in the eval results.
        baseline: Label of the model compared against when there is no champion (``''``: none;
            the first candidate becomes the champion).
        champion_label: Label of the champion, evaluated in the same run, in the eval results.
        min_real_word_share: Degeneracy guard; ``None`` disables it.
        confidence: Level of the paired test (one-sided): 0.95 promotes an equally good
            candidate about 5% of the time.
        power: The power the gate's sample-size figure is stated for.
        effect: The true difference the sample-size figure is for.
        resamples: Bootstrap resamples of the paired test.
        force: Retrain even when the data fingerprint equals the champion's.
    """

    model_config = ConfigDict(extra="forbid")

    registered_model: str = "lingo-gpt-oss"
    alias: str = "champion"
    metric: str = "both_language_accuracy"
    margin: float = Field(0.0, ge=0.0)
    candidate: str = "grpo"
    baseline: str = "sft"
    min_real_word_share: float | None = Field(None, ge=0.0, le=1.0)
    champion_label: str = Field("champion", min_length=1)
    confidence: float = Field(0.95, ge=0.5, lt=1.0)
    power: float = Field(0.8, gt=0.0, lt=1.0)
    effect: float = Field(0.1, gt=0.0, le=1.0)
    resamples: int = Field(10_000, ge=1000, le=1_000_000)
    force: bool = False

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
    def _pipeline_label(cls, value: str, info: ValidationInfo) -> str:
        if info.field_name == "baseline" and value == "":
            return value  # no baseline: the first candidate becomes the champion
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
    REFUSED = "refused"
    SKIPPED = "skipped"


DECISION_PREFIX = "decision | "
"""How a decision's one line in a run's output starts (``lingo run --local`` shows it)."""


@dataclass(frozen=True)
class EvalFooting:
    """What makes two evals comparable: the question file, which of its questions, the
    sampling and the prompts (``sha256`` over them; ``text`` for messages)."""

    sha256: str
    text: str

    @classmethod
    def of(cls, results: Mapping) -> EvalFooting:
        """The footing of an eval's ``results.json`` content."""
        config = results.get("config") or {}
        sampling = results.get("sampling") or config.get("sampling") or {}
        fields = {
            "questions_sha256": results.get("questions_sha256"),
            "questions": results.get("questions"),
            "limit": config.get("limit"),
            "languages": config.get("languages"),
            "persona": config.get("persona"),
            "reasoning_effort": config.get("reasoning_effort"),
            "sampling": {k: sampling.get(k) for k in sorted(sampling)},
        }
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        limited = f" (limit {fields['limit']})" if fields["limit"] else ""
        languages = f" in {','.join(fields['languages'])}" if fields["languages"] else ""
        text = (
            f"{fields['questions']} questions{limited}{languages} of "
            f"{str(fields['questions_sha256'])[:12]}, {sampling.get('n')} sample(s) at "
            f"temperature {sampling.get('temperature')}, top_p {sampling.get('top_p')}, "
            f"max_tokens {sampling.get('max_tokens')}, seed {sampling.get('seed')}"
        )
        return cls(digest, text)


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
        paired: The paired test against the champion, when it ran.
        power: What the eval can detect (sample size for the stated power), when it ran.
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
    paired: PairedComparison | None = None
    power: str = ""

    def to_dict(self) -> dict:
        """JSON-friendly form."""
        return asdict(self) | {"decision": self.decision.value}

    def line(self) -> str:
        """The decision as one line of the run's output (with what the eval can detect,
        when the paired test ran)."""
        power = f" | power: {self.power}" if self.power else ""
        return f"{DECISION_PREFIX}gate: {self.decision.value} | {self.reason}{power}"

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
        if self.paired is not None:
            c = self.paired
            rows += [
                ("paired test", f"bootstrap over {c.questions} questions, {c.resamples} "
                 f"resamples, one-sided level {c.confidence}"),
                ("difference (candidate − champion)", f"{c.difference:+.4f} (sd per question "
                 f"{c.sd:.4f})"),
                (f"{c.confidence:.0%} lower bound", f"{c.lower:+.4f} (p {c.p_value:.4f})"),
                ("questions won / lost", f"{c.wins} / {c.losses} (sign test p {c.sign_p:.4f})"),
            ]  # fmt: skip
        if self.power:
            rows.append(("power", self.power))
        lines = ["# Promotion gate", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
        return "\n".join(lines) + "\n"


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _power_line(paired: PairedComparison, config: GateConfig) -> str:
    """What the eval can detect: the questions needed for ``config.effect`` at
    ``config.power`` and the difference these questions detect, both from the per-question
    spread; with no spread (every question the same difference, e.g. both models at 0) there
    is nothing to estimate them from, and the line says so instead of a sample size of 2."""
    if paired.sd == 0:
        return (
            f"not estimable from this eval: all {paired.questions} questions gave the same "
            f"difference ({paired.difference:+.3f}, sd 0), so the spread a true difference of "
            f"{config.effect:+.2f} must be detected against is unknown"
        )
    needed = paired.questions_needed(config.effect, config.power)
    return (
        f"{needed if needed is not None else '–'} questions detect a true difference of "
        f"{config.effect:+.2f} with power {config.power:.0%} at level {paired.confidence} "
        f"(sd per question {paired.sd:.3f}); these {paired.questions} detect "
        f"{paired.detectable(config.power):+.3f}"
    )


def decide(
    config: GateConfig,
    candidate_metrics: dict[str, float | None],
    champion: RegisteredVersion | None,
    baseline_metrics: dict[str, float | None] | None,
    candidate_sha256: str | None,
    paired: PairedComparison | None = None,
    footing: EvalFooting | None = None,
    champion_metrics: dict[str, float | None] | None = None,
) -> GateDecision:
    """Apply the gate rule (see the module docstring). Pure: no registry access.

    Args:
        config: The gate settings.
        candidate_metrics: The candidate's overall metric values.
        champion: The current champion version, if any.
        baseline_metrics: The baseline model's overall values in the same eval, if present.
        candidate_sha256: The candidate's content hash.
        paired: The paired test of the candidate against the champion in this eval (``None``:
            the champion was not evaluated in it).
        footing: This eval's footing.
        champion_metrics: The champion's overall values in this eval.
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
        return _against_champion(config, champion, paired, footing, champion_metrics, base)
    if baseline_metrics is not None and _finite(baseline_metrics.get(metric)) is not None:
        base["reference"] = config.baseline
        reference_value = _finite(baseline_metrics.get(metric))
    else:
        against = f"no '{config.baseline}' result" if config.baseline else "no baseline set"
        return GateDecision(
            Decision.PROMOTE,
            f"no {config.alias} yet and {against} to compare with: the first candidate "
            "becomes the champion",
            **base,
        )
    assert reference_value is not None
    gain = value - reference_value
    verdict = Decision.PROMOTE if gain > config.margin else Decision.KEEP
    comparison = "beats" if verdict is Decision.PROMOTE else "does not beat"
    return GateDecision(
        verdict,
        f"no {config.alias} yet: {metric} {value:.4f} {comparison} {base['reference']} "
        f"({reference_value:.4f}) by more than {config.margin} (difference {gain:+.4f})",
        reference_value=reference_value,
        **base,
    )


def _against_champion(
    config: GateConfig,
    champion: RegisteredVersion,
    paired: PairedComparison | None,
    footing: EvalFooting | None,
    champion_metrics: dict[str, float | None] | None,
    base: dict,
) -> GateDecision:
    """The candidate against the champion: unchanged, refused, or the paired test."""
    name = f"{config.alias} v{champion.version}"
    base["reference"] = name
    if base["content_sha256"] is not None and champion.content_sha256 == base["content_sha256"]:
        return GateDecision(
            Decision.UNCHANGED,
            f"the candidate is already {config.alias} (version {champion.version}, same "
            "content hash); nothing registered",
            **base,
        )
    if champion.eval_footing is None:
        return GateDecision(
            Decision.REFUSED,
            f"refused to compare: {name} has no recorded eval footing (promoted before "
            "footings were recorded); move the alias by hand if wanted",
            **base,
        )
    if footing is None or footing.sha256 != champion.eval_footing:
        this = footing.text if footing else "unknown"
        return GateDecision(
            Decision.REFUSED,
            f"refused to compare: this eval ({this}) is not the footing {name} was promoted "
            f"on ({champion.eval_footing_text or champion.eval_footing[:12]})",
            **base,
        )
    if paired is None or champion_metrics is None:
        return GateDecision(
            Decision.REFUSED,
            f"refused to compare: {name} was not evaluated in this run (no "
            f"'{config.champion_label}' scored on the candidate's questions)",
            **base,
        )
    reference_value = _finite(champion_metrics.get(config.metric))
    verdict = Decision.PROMOTE if paired.better else Decision.KEEP
    sign = ">" if paired.better else "≤"
    power = _power_line(paired, config)
    value = base["candidate_value"]
    return GateDecision(
        verdict,
        f"paired bootstrap over {paired.questions} questions: {config.metric} {value:.4f} vs "
        f"{name} {reference_value if reference_value is None else f'{reference_value:.4f}'} "
        f"in this eval, difference {paired.difference:+.4f}, {paired.confidence:.0%} lower "
        f"bound {paired.lower:+.4f} {sign} margin {config.margin} (p {paired.p_value:.3f}); "
        f"won {paired.wins}, lost {paired.losses} (sign test p {paired.sign_p:.3f})",
        reference_value=reference_value,
        paired=paired,
        power=power,
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
    baseline = _overall(results, config.baseline) if config.baseline else None
    if not tracking_enabled():
        preview = decide(config, candidate, None, baseline, sha)
        return replace(
            preview,
            decision=Decision.SKIPPED,
            reason=f"no MLFLOW_TRACKING_URI, so no registry; against {preview.reference}: "
            f"{preview.reason}",
        )
    champion = aliased_version(config.registered_model, config.alias)
    champion_metrics = _overall(results, config.champion_label)
    paired = None
    if champion is not None and champion_metrics is not None:
        try:
            paired = compare(
                results, config.candidate, config.champion_label, config.metric,
                config.confidence, config.margin, config.resamples,
            )  # fmt: skip
        except ValueError as exc:  # no question scored for both: refused in decide
            log.warning("gate: no paired comparison: %s", exc)
    footing = EvalFooting.of(results)
    return decide(config, candidate, champion, baseline, sha, paired, footing, champion_metrics)


def apply_gate(
    results: dict, candidate_dir: str | Path, config: GateConfig, data_fingerprint: str = ""
) -> GateDecision:
    """Decide against the current champion and, on ``promote``, register and move the alias.

    The version records the eval's footing (``FOOTING_TAG``) and the training data's
    fingerprint (``DATA_FINGERPRINT_TAG``), which later runs compare with.
    Idempotent: a candidate whose content hash is already a version reuses it (its tags are
    refreshed); a candidate that is already the champion changes nothing.
    """
    decision = evaluate_gate(results, candidate_dir, config)
    if decision.decision is not Decision.PROMOTE:
        log.info("gate: %s (%s)", decision.decision.value, decision.reason)
        return decision
    assert decision.content_sha256 is not None
    metrics = _overall(results, config.candidate) or {}
    footing = EvalFooting.of(results)
    tags = {
        FOOTING_TAG: footing.sha256,
        FOOTING_TEXT_TAG: footing.text,
        DATA_FINGERPRINT_TAG: data_fingerprint,
        "lingo.questions_sha256": results.get("questions_sha256", ""),
        "lingo.evaluated_at": results.get("created_at", ""),
    }
    existing = find_version(config.registered_model, decision.content_sha256)
    if existing is None:
        version = register_directory(
            config.registered_model, candidate_dir, decision.content_sha256, metrics, tags=tags
        )
    else:
        version = existing
        update_metric_tags(config.registered_model, version.version, metrics, tags)
    set_alias(config.registered_model, config.alias, version.version)
    log.info(
        "gate: %s version %s is now %s", config.registered_model, version.version, config.alias
    )
    return replace(decision, registered_version=version.version)


UNCHANGED_DATA = "unchanged data"
RETRAIN = "retrain"


def data_decision(
    fingerprint: str, champion: RegisteredVersion | None, config: GateConfig
) -> tuple[str, str]:
    """``(RETRAIN or UNCHANGED_DATA, reason)``: unchanged when ``fingerprint`` equals the
    champion's data fingerprint and ``force`` is off. Pure."""
    short = fingerprint[:12] or "none"
    if champion is None:
        return RETRAIN, f"data {short}: no {config.alias} yet, training"
    name = f"{config.alias} v{champion.version}"
    if fingerprint == "unknown" or not fingerprint:
        return RETRAIN, "data fingerprint unknown (a source's state cannot be pinned): training"
    if champion.data_fingerprint != fingerprint:
        theirs = (champion.data_fingerprint or "none recorded")[:12]
        return RETRAIN, f"new data: fingerprint {short} differs from {name}'s ({theirs}), training"
    if config.force:
        return RETRAIN, f"data {short} is {name}'s, and force is set: training anyway"
    return UNCHANGED_DATA, (
        f"data fingerprint {short} equals {name}'s: SFT, GRPO and the eval do not run "
        "(set force to retrain)"
    )


def check_data(fingerprint: str, config: GateConfig) -> str:
    """``RETRAIN`` or ``UNCHANGED_DATA`` against the registry's champion, said in one
    ``decision |`` line; ``RETRAIN`` when no tracking URI is set (no registry)."""
    if not tracking_enabled():
        verdict, reason = RETRAIN, "no MLFLOW_TRACKING_URI, so no champion to compare: training"
    else:
        champion = aliased_version(config.registered_model, config.alias)
        verdict, reason = data_decision(fingerprint, champion, config)
    log.info("%sdata: %s | %s", DECISION_PREFIX, verdict, reason)
    return verdict
