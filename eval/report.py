"""Eval reports: ``results.json``, a Markdown and an HTML report, KFP metrics and matrices.

Everything renders from the ``results.json`` content (``EvalResults.to_dict()``), so a report
can be rebuilt from a stored results file. The HTML report embeds a PNG bar chart (matplotlib,
Agg backend) of the language accuracies per language, one bar per model, with 95% intervals.
"""

from __future__ import annotations

import html
import io
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from core.atomic import atomic_write_text, record_output_files
from core.html_page import html_page, png_img
from core.languages import LANGUAGE_NAMES, SUPPORTED_LANGUAGES
from core.redact import redact_data
from core.tracking import log_artifact, log_metrics, mlflow_run
from eval.eval_metrics import DETECTED_COLUMNS, METRICS

METRIC_TITLES: dict[str, str] = {
    "reasoning_language_accuracy": "reasoning in the requested language",
    "answer_language_accuracy": "answer in the requested language",
    "both_language_accuracy": "reasoning and answer in the requested language",
    "brevity": "brief answer (at most 2 sentences)",
    "answer_correct": "numeric answer correct",
    "loop_rate": "reasoning or answer a loop (scored as the wrong language)",
    "mean_reward": "mean reward",
    "real_word_share": "real-word share (low = degenerate text)",
    "repeated_ngram_rate": "repeated 3-gram rate (high = degenerate text)",
    "median_reasoning_words": "median reasoning length (words)",
}
CHART_METRICS = (
    "reasoning_language_accuracy",
    "answer_language_accuracy",
    "answer_correct",
    "real_word_share",
)
MAX_FAILURES_LISTED = 10
EXAMPLE_CHARS = 160

log = logging.getLogger(__name__)


def json_safe(value: object) -> object:
    """``value`` with NaN and infinities replaced by ``None`` (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


@dataclass
class Table:
    """A table of already formatted cells."""

    headers: list[str]
    rows: list[list[str]]
    caption: str = ""


@dataclass
class Section:
    """A titled part of the report: paragraphs, then tables."""

    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


def _number(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _estimate(estimate: dict) -> str:
    if estimate.get("value") is None:
        return "–"
    text = _number(estimate["value"])
    if estimate.get("low") is not None and estimate.get("high") is not None:
        text += f" [{_number(estimate['low'])}, {_number(estimate['high'])}]"
    return text


def _signed(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:+.3f}"


def _clip(text: str | None, limit: int = EXAMPLE_CHARS) -> str:
    if text is None:
        return "(none)"
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _sections(results: dict) -> list[Section]:
    """The report's sections, in order (``render_markdown`` and ``render_html`` lay them out)."""
    sections = [
        _setup_section(results),
        _overall_section(results),
        _per_language_section(results),
    ]
    if "reasoning_length_ratio" in results:
        sections.append(_reasoning_length_section(results))
    sections += [
        _confusion_section(results),
        _failures_section(results),
        _examples_section(results),
    ]
    return sections


def _compared(results: dict) -> tuple[list[str], str, list[str]]:
    """The models' labels, the baseline's, and the others' (each with a delta column)."""
    labels = [m["label"] for m in results["models"]]
    baseline = results["baseline"]
    return labels, baseline, [label for label in labels if label != baseline]


def _setup_section(results: dict) -> Section:
    """The questions, the sampling, the intervals, and each model's engine and responses."""
    sampling, baseline = results["sampling"], results["baseline"]
    setup = Section("Setup")
    setup.paragraphs.append(
        f"{results['questions']} questions from `{Path(results['questions_file']).name}` "
        f"(sha256 `{results['questions_sha256'][:12]}`), {sampling['n']} sample(s) each; "
        f"sampling: temperature {sampling['temperature']}, top_p {sampling['top_p']}, "
        f"max_tokens {sampling['max_tokens']}, seed {sampling['seed']}. "
        f"Run at {results['created_at']}. Deltas are against `{baseline}`."
    )
    setup.paragraphs.append(
        "95% intervals: Wilson score interval for rates, Student t interval for means. "
        "Failed generations are left out of the metrics and listed under Failures."
    )
    setup.tables.append(
        Table(
            ["model", "engine", "responses", "failed", "wall time (s)"],
            [
                [
                    m["label"],
                    m["engine"],
                    str(m["summary"]["responses"]),
                    str(m["summary"]["failed"]),
                    _number(m["wall_time_s"], 1),
                ]
                for m in results["models"]
            ],
        )
    )
    return setup


def _overall_section(results: dict) -> Section:
    """Each metric over every question, per model, with the deltas against the baseline."""
    labels, baseline, others = _compared(results)
    rows = []
    for metric in METRICS:
        row = [METRIC_TITLES[metric]]
        row += [_estimate(m["summary"]["overall"][metric]) for m in results["models"]]
        row += [_signed(results["deltas"][label]["overall"][metric]) for label in others]
        rows.append(row)
    headline = Section("Overall")
    headline.tables.append(
        Table(["metric", *labels, *[f"Δ {label} − {baseline}" for label in others]], rows)
    )
    return headline


def _per_language_section(results: dict) -> Section:
    """One table a metric: each language's figure per model, with the deltas."""
    labels, _, others = _compared(results)
    per_language = Section("Per language")
    for metric in METRICS:
        rows = []
        for code in SUPPORTED_LANGUAGES:
            row = [f"{code} ({LANGUAGE_NAMES[code]})"]
            row += [
                _estimate(m["summary"]["per_language"][code][metric]) for m in results["models"]
            ]
            row += [
                _signed(results["deltas"][label]["per_language"][code][metric]) for label in others
            ]
            rows.append(row)
        per_language.tables.append(
            Table(
                ["language", *labels, *[f"Δ {label}" for label in others]],
                rows,
                caption=METRIC_TITLES[metric],
            )
        )
    return per_language


def _reasoning_length_section(results: dict) -> Section:
    """Each model's median reasoning length over the reference model's, overall and per
    language."""
    reference = results["reasoning_length_reference"]
    lengths = Section(
        "Reasoning length",
        [
            f"Median reasoning words ÷ {reference}'s on the same questions "
            "(`reasoning_length_ratio`; below 1: the model reasons less)."
        ],
    )
    lengths.tables.append(
        Table(
            ["model", "overall", *SUPPORTED_LANGUAGES],
            [
                [
                    label,
                    _number(ratio["overall"]),
                    *(_number(ratio["per_language"][code]) for code in SUPPORTED_LANGUAGES),
                ]
                for label, ratio in results["reasoning_length_ratio"].items()
            ],
        )
    )
    return lengths


def _confusion_section(results: dict) -> Section:
    """Requested against detected language, for each model's reasoning and answer."""
    confusion = Section(
        "Confusion matrices",
        [
            "Rows: requested language; columns: detected language (`und`: too little text to "
            "judge, `missing`: no such channel, `loop`: a repetition loop or not the "
            "language's words, scored as the wrong language)."
        ],
    )
    for m in results["models"]:
        for part in ("reasoning", "answer"):
            matrix = m["summary"]["confusion"][part]
            confusion.tables.append(
                Table(
                    ["requested", *DETECTED_COLUMNS],
                    [
                        [code, *(str(matrix[code][col]) for col in DETECTED_COLUMNS)]
                        for code in SUPPORTED_LANGUAGES
                    ],
                    caption=f"{m['label']}: {part}",
                )
            )
    return confusion


def _failures_section(results: dict) -> Section:
    """The first failed generations of each model, with their errors."""
    labels, _, _ = _compared(results)
    failures = Section("Failures")
    failed = [r for r in results["responses"] if r.get("error")]
    if not failed:
        failures.paragraphs.append("No generation failed.")
    for label in labels:
        listed = [r for r in failed if r["model"] == label][:MAX_FAILURES_LISTED]
        if listed:
            failures.tables.append(
                Table(
                    ["question", "sample", "attempts", "error"],
                    [
                        [r["id"], str(r["sample"]), str(r["attempts"]), _clip(r["error"])]
                        for r in listed
                    ],
                    caption=f"{label} (first {MAX_FAILURES_LISTED})",
                )
            )
    return failures


def _examples_section(results: dict) -> Section:
    """The first response in each language, per model: what was detected, its reward, its
    reasoning and answer (clipped)."""
    labels, _, _ = _compared(results)
    examples = Section("Examples", ["The first response in each language, per model."])
    for label in labels:
        rows = []
        for code in SUPPORTED_LANGUAGES:
            response = next(
                (
                    r
                    for r in results["responses"]
                    if r["model"] == label and r["language"] == code and not r.get("error")
                ),
                None,
            )
            if response is None:
                continue
            score = response["score"]
            rows.append(
                [
                    response["id"],
                    f"{score['reasoning_language'] or 'missing'} / "
                    f"{score['answer_language'] or 'missing'}",
                    _number(score["reward"], 2),
                    _clip(response["reasoning"]),
                    _clip(response["final"]),
                ]
            )
        examples.tables.append(
            Table(
                ["question", "detected (reasoning / answer)", "reward", "reasoning", "answer"],
                rows,
                caption=label,
            )
        )
    return examples


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def render_markdown(results: dict) -> str:
    """The report as Markdown (for ``Output[Markdown]`` and MLflow)."""
    results = json_safe(results)
    out = ["# lingo-rl eval", ""]
    for section in _sections(results):
        out += [f"## {section.title}", ""]
        for paragraph in section.paragraphs:
            out += [paragraph, ""]
        for table in section.tables:
            if table.caption:
                out += [f"**{_md_cell(table.caption)}**", ""]
            out.append("| " + " | ".join(_md_cell(h) for h in table.headers) + " |")
            out.append("|" + "---|" * len(table.headers))
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
            out.append("")
    return "\n".join(out)


def language_chart_png(results: dict) -> bytes:
    """Bar charts (one panel per metric): per language, one bar per model, 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json_safe(results)
    models = results["models"]
    fig, axes = plt.subplots(1, len(CHART_METRICS), figsize=(4.2 * len(CHART_METRICS), 3.6))
    width = 0.8 / max(len(models), 1)
    for ax, metric in zip(axes, CHART_METRICS, strict=True):
        for i, m in enumerate(models):
            values, low_err, high_err = [], [], []
            for code in SUPPORTED_LANGUAGES:
                est = m["summary"]["per_language"][code][metric]
                value = est["value"] if est["value"] is not None else 0.0
                values.append(value)
                low_err.append(value - est["low"] if est["low"] is not None else 0.0)
                high_err.append(est["high"] - value if est["high"] is not None else 0.0)
            positions = [x + (i - (len(models) - 1) / 2) * width for x in range(5)]
            ax.bar(positions, values, width, yerr=[low_err, high_err], capsize=2, label=m["label"])
        ax.set_xticks(range(len(SUPPORTED_LANGUAGES)), SUPPORTED_LANGUAGES)
        ax.set_ylim(0, 1.05)
        ax.set_title(METRIC_TITLES[metric], fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def render_html(results: dict, chart_png: bytes | None = None) -> str:
    """The report as a self-contained HTML page (for ``Output[HTML]`` in the KFP UI)."""
    results = json_safe(results)
    parts = ["<h1>lingo-rl eval</h1>"]
    for index, section in enumerate(_sections(results)):
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        parts += [f"<p>{html.escape(p)}</p>" for p in section.paragraphs]
        if index == 1 and chart_png:
            parts.append(png_img(chart_png, "accuracy per language"))
        for table in section.tables:
            parts.append("<table>")
            if table.caption:
                parts.append(f"<caption>{html.escape(table.caption)}</caption>")
            parts.append(
                "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in table.headers) + "</tr>"
            )
            parts += [
                "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                for row in table.rows
            ]
            parts.append("</table>")
    return html_page("lingo-rl eval", "\n".join(parts))


def kfp_metrics(results: dict) -> dict[str, float]:
    """Scalars for ``Output[Metrics]`` / MLflow: ``<model>/<metric>`` and
    ``<model>-vs-<baseline>/<metric>`` (finite values only)."""
    results = json_safe(results)
    out: dict[str, float] = {}
    for m in results["models"]:
        for metric, estimate in m["summary"]["overall"].items():
            if estimate["value"] is not None:
                out[f"{m['label']}/{metric}"] = float(estimate["value"])
        out[f"{m['label']}/failure_rate"] = float(m["summary"]["failure_rate"])
    for label, delta in results["deltas"].items():
        for metric, value in delta["overall"].items():
            if value is not None:
                out[f"{label}-vs-{results['baseline']}/{metric}"] = float(value)
    return out


CONFUSION_PARTS = ("reasoning", "answer")


def kfp_confusion_matrices(results: dict) -> dict[str, tuple[list[str], list[list[int]]]]:
    """Square confusion matrices for KFP ``ClassificationMetrics``, one per model and part.

    KFP wants the same categories on both axes, so rows and columns are ``DETECTED_COLUMNS``
    (the five languages, ``other``, ``und``, ``missing``, ``loop``: what the scorer detects);
    the rows of the last four are zero (a question always requests a language).

    Returns:
        ``"<model>_<part>_language"`` (e.g. ``grpo_answer_language``) → (categories, rows).
    """
    categories = list(DETECTED_COLUMNS)
    out = {}
    for m in results["models"]:
        for part in CONFUSION_PARTS:
            matrix = m["summary"]["confusion"][part]
            rows = [
                [int(matrix[row][col]) if row in matrix else 0 for col in categories]
                for row in categories
            ]
            out[f"{m['label']}_{part}_language"] = (categories, rows)
    return out


@dataclass(frozen=True)
class ReportPaths:
    """Files written by ``write_reports``."""

    results: Path
    markdown: Path
    html: Path

    @classmethod
    def under(cls, output_dir: str | Path) -> ReportPaths:
        """The report files of ``output_dir``."""
        output_dir = Path(output_dir)
        return cls(
            output_dir / "results.json", output_dir / "report.md", output_dir / "report.html"
        )

    def files(self) -> list[Path]:
        """The three paths."""
        return [self.results, self.markdown, self.html]


def write_reports(results: dict, output_dir: str | Path) -> ReportPaths:
    """Write ``results.json``, ``report.md`` and ``report.html`` (each atomically, recorded as
    ours in ``output_dir``), with every credential redacted (``core.redact``: an endpoint
    URL's password, a signed URL's query)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    safe = _redacted(json_safe(results))
    paths = ReportPaths.under(output_dir)
    atomic_write_text(paths.results, json.dumps(safe, ensure_ascii=False, indent=1))
    atomic_write_text(paths.markdown, render_markdown(safe))
    atomic_write_text(paths.html, render_html(safe, language_chart_png(safe)))
    record_output_files(paths.files())
    return paths


MODEL_TEXT_FIELDS = ("text", "reasoning_field", "reasoning", "final")
"""A response's fields that hold the model's own words: kept as the model wrote them."""


def _redacted(results: dict) -> dict:
    """``results`` with what the project says about configuration and environment redacted
    (locations, errors, settings), and the model's words left as they are: redaction is for
    credentials the project holds, and "a bearer of news" is no token."""
    responses = results.get("responses", [])
    safe = redact_data({k: v for k, v in results.items() if k != "responses"})
    safe["responses"] = []
    for response in responses:
        kept = {k: response[k] for k in MODEL_TEXT_FIELDS if k in response}
        record = redact_data({k: v for k, v in response.items() if k not in kept})
        safe["responses"].append({k: kept.get(k, record.get(k)) for k in response})
    return safe


def load_results(path: str | Path) -> dict:
    """Read a ``results.json`` (a file, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    return json.loads(path.read_text(encoding="utf-8"))


_MLFLOW_UNSAFE = re.compile(r"[^\w.\- ]")


def mlflow_label(label: str) -> str:
    """A model label as one part of an MLflow key: MLflow takes only letters, digits, ``_``,
    ``-``, ``.``, spaces (and ``/``, ``:``, which split or confuse keys here), and no key that
    starts with ``.`` or ``..``: anything else becomes ``_`` (``127.0.0.1:8000`` →
    ``127.0.0.1_8000``, ``..`` → ``_..``)."""
    safe = _MLFLOW_UNSAFE.sub("_", label) or "_"
    return "_" + safe if safe.startswith(".") else safe


def log_eval_run(results: dict, paths: ReportPaths, run_name: str = "eval") -> str | None:
    """Log the eval to MLflow; returns the run id, or ``None`` when tracking is off."""
    params = {f"sampling.{k}": v for k, v in results["sampling"].items()}
    params.update({f"model.{mlflow_label(m['label'])}": m["location"] for m in results["models"]})
    params["questions_sha256"] = results["questions_sha256"]
    with mlflow_run(run_name, params) as run:
        if run is None:
            return None
        labels = {m["label"] for m in results["models"]}
        metrics = {}
        for key, value in kfp_metrics(results).items():
            model, _, metric = key.rpartition("/")
            left, vs, right = model.partition("-vs-")
            if vs and left in labels and right in labels:
                model = f"{mlflow_label(left)}_vs_{mlflow_label(right)}"
            else:
                model = mlflow_label(model)
            metrics[f"{model}/{metric}"] = value
        log_metrics(metrics)
        for path in paths.files():
            log_artifact(path, artifact_path="eval")
        log.info("eval logged to MLflow run %s", run.info.run_id)
        return run.info.run_id
