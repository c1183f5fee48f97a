"""The dataset card: a Markdown summary of what data prep produced (shown in the KFP UI)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.languages import LANGUAGE_NAMES, SUPPORTED_LANGUAGES

if TYPE_CHECKING:
    from data_prep.config import DataPrepConfig
    from data_prep.fingerprint import DataFingerprint
    from data_prep.lengths import LengthHistogram
    from data_prep.report import DataPrepReport


def _length_cell(lengths: LengthHistogram) -> str:
    if len(lengths) == 0:
        return "–"
    median, p95 = lengths.percentile(50), lengths.percentile(95)
    return f"{lengths.mean():.0f} / {median:.0f} / {p95:.0f} / {lengths.max}"


def render_card(config: DataPrepConfig, report: DataPrepReport) -> str:
    """Markdown: source and settings, counts per language and split, quarantine reasons, lengths."""
    lines = [
        "# Dataset card: lingo-rl data prep",
        "",
        f"- source: `{config.source}`",
        *(_fingerprint_lines(report.fingerprint) if report.fingerprint else []),
        f"- rows read: {report.rows_read}; valid: {report.rows_valid}; "
        f"quarantined: {report.rows_bad} bad + {report.rows_duplicate} duplicates "
        f"({report.bad_fraction:.2%} bad, limit {config.max_bad_fraction:.0%})",
        f"- split: eval_fraction {config.eval_fraction}, seed {config.seed}, "
        "stratified by reasoning language",
        f"- synthetic train rows (augment_factor {_augment(config)}): {report.synthetic_rows}",
        *(
            [
                f"- prompt-only train rows (question sets, GRPO only): "
                f"{report.prompt_only_rows} {dict(report.prompt_only_by_language)}; "
                f"{report.question_rows_bad} quarantined"
            ]
            if config.question_sets
            else []
        ),
        f"- answer language policy: `{config.answer_language_policy}`; answer language taken from: "
        + ", ".join(f"{k} {v}" for k, v in sorted(report.answer_sources.items())),
        "",
        "## Rows per reasoning language",
        "",
        "| language | train | eval | answer language (all splits) |",
        "|---|---:|---:|---:|",
    ]
    for lang in SUPPORTED_LANGUAGES:
        lines.append(
            f"| {LANGUAGE_NAMES[lang]} ({lang}) | {report.train_by_language[lang]} | "
            f"{report.eval_by_language[lang]} | {report.answer_languages[lang]} |"
        )
    lines += [
        f"| **total** | **{report.train_rows}** | **{report.eval_rows}** | |",
        "",
        "## Length in characters (mean / median / p95 / max)",
        "",
        "| language | user | analysis | final |",
        "|---|---|---|---|",
    ]
    for lang in SUPPORTED_LANGUAGES:
        lengths = report.lengths.get(lang)
        if lengths:
            lines.append(
                f"| {lang} | {_length_cell(lengths['user'])} | "
                f"{_length_cell(lengths['analysis'])} | {_length_cell(lengths['final'])} |"
            )
    lines += ["", "## Quarantine", ""]
    if report.reasons:
        lines += ["| reason | rows |", "|---|---:|"]
        lines += [f"| {reason} | {n} |" for reason, n in report.reasons.most_common()]
        if report.first_bad:
            lines += ["", "First bad rows:", ""] + [f"- {row}" for row in report.first_bad]
    else:
        lines.append("No row was quarantined.")
    return "\n".join(lines) + "\n"


def _fingerprint_lines(fingerprint: DataFingerprint) -> list[str]:
    """The data fingerprint and what it pins, one line per source."""
    lines = [
        f"- data fingerprint: `{fingerprint.sha256}` (sha256 of the sources below and "
        "the settings; a scheduled run with the champion's fingerprint retrains nothing)"
    ]
    for source in fingerprint.inputs["sources"]:
        if source["kind"] == "hub":
            pinned = f"hub `{source['id']}` [{source['split']}] revision `{source['revision']}`"
        elif source["kind"] == "s3":
            pinned = f"{len(source['objects'])} S3 object(s), ETag and size"
        else:
            pinned = f"{len(source['files'])} {source['kind']} file(s), sha256 and size"
        lines.append(f"  - {pinned}")
    return lines


def _augment(config: DataPrepConfig) -> str:
    """``9``, or ``auto → 9`` (``auto`` resolved for the source)."""
    if config.augment_factor == "auto":
        return f"auto → {config.synthetic_per_row}"
    return str(config.augment_factor)
