"""The 50-question eval: run models over the question set, score, summarize, write reports.

Prompts follow the training convention (``core.harmony``): developer instructions
``reasoning language: <Name>`` then the fixed persona line, and the question as the user
message. The eval asks for one language throughout (question, reasoning and answer in L), so
every response is judged against ``LanguageLabels(L, L)``.

Several models run side by side in one call (base, SFT, GRPO, …); the first is the baseline
of the deltas. Outputs in ``output_dir``: ``results.json`` (every response kept, sampling
parameters recorded), ``report.md``, ``report.html``; and an MLflow run when
``MLFLOW_TRACKING_URI`` is set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from core.atomic import check_output_files, check_writable
from core.harmony import find_control_token, task_prompt
from core.languages import LANGUAGE_NAMES, LanguageLabels, normalize_language
from core.model_files import nonfinite_weights
from core.redact import redact
from core.seeds import sample_seed
from eval.engines import make_engine
from eval.eval_config import EvalConfig
from eval.eval_metrics import (
    REASONING_LENGTH_REFERENCE,
    Summary,
    deltas,
    reasoning_length_ratios,
    response_values,
    summarize,
)
from eval.report import ReportPaths, log_eval_run, write_reports
from generation.engines import Engine, ModelNotFoundError, is_endpoint, require_model_dir
from generation.requests import Generation, GenerationRequest
from reward.degeneracy import measure_degeneracy
from reward.outcome import Outcome
from reward.scoring import ComplianceResult, ComplianceScorer

log = logging.getLogger(__name__)

BUNDLED_QUESTIONS = Path(__file__).resolve().parent / "data" / "eval_50.jsonl"


class TooManyFailuresError(RuntimeError):
    """A model's failed responses exceed ``EvalConfig.max_failure_fraction``."""


@dataclass(frozen=True)
class Question:
    """One line of the eval set (see ``eval/data/README.md``)."""

    id: str
    problem_id: str
    language: str
    category: str
    question: str
    expected_answer: float | None
    unit: str = ""


def load_questions(
    path: str | Path | None = None,
    languages: Sequence[str] | None = None,
    limit: int | None = None,
) -> list[Question]:
    """Read the eval set, optionally only some languages and the first ``limit`` questions.

    Every line of the file is checked, whatever the filters: an ``id`` and a ``question``
    that are non-blank strings (a number is not a question), no id twice (it would be scored
    twice), no harmony control token in any text (``<|end|>``…: it would forge a turn of the
    prompt), a numeric ``expected_answer`` or none.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: A line is not a valid question (the line number and the id are named).
    """
    path = Path(path) if path is not None else BUNDLED_QUESTIONS
    wanted = {normalize_language(code) for code in languages} if languages else None
    questions = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            question = _question(json.loads(line))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: not a valid eval question: {err}") from err
        if question.id in first_line:
            raise ValueError(
                f"{path}:{number}: question id {question.id!r} is already on line "
                f"{first_line[question.id]}; ids must be unique (each is scored once)"
            )
        first_line[question.id] = number
        if wanted is None or question.language in wanted:
            questions.append(question)
    if not questions:
        raise ValueError(f"{path}: no questions (languages filter: {languages})")
    return questions[:limit] if limit else questions


def _question(row: object) -> Question:
    """A question from one parsed line (see ``load_questions`` for the rules)."""
    if not isinstance(row, dict):
        raise TypeError(f"a line is a JSON object, not a {type(row).__name__}")
    texts = {}
    for key in ("id", "question", "problem_id", "category", "unit"):
        value = row.get(key)
        if value is None and key not in ("id", "question"):
            continue
        if not isinstance(value, str):
            shown = "missing" if value is None else f"a {type(value).__name__}, not a string"
            raise TypeError(f"{key!r} is {shown}")
        if key in ("id", "question") and not value.strip():
            where = f" (id {row['id']!r})" if key == "question" else ""
            raise ValueError(f"{key!r} is blank{where}")
        if token := find_control_token(value):
            raise ValueError(
                f"{key!r} holds the harmony control token {token.group()} (id "
                f"{row.get('id')!r}); control tokens are never text"
            )
        texts[key] = value
    expected = row.get("expected_answer")
    if expected is not None and (
        isinstance(expected, bool)
        or not isinstance(expected, int | float)
        or not math.isfinite(expected)
    ):
        raise TypeError(
            f"'expected_answer' is {expected!r}, not a finite number (id {texts['id']!r})"
        )
    return Question(
        id=texts["id"],
        problem_id=texts.get("problem_id", texts["id"]),
        language=normalize_language(row.get("language")),
        category=texts.get("category", ""),
        question=texts["question"],
        expected_answer=expected,
        unit=texts.get("unit", ""),
    )


@dataclass(frozen=True)
class ModelSpec:
    """A model to evaluate.

    Attributes:
        label: Name in reports (``base``, ``sft``, ``grpo`` …).
        location: A Hugging Face model directory or an endpoint URL.
        served_model: The model name on an endpoint (``None``: the only one it serves).
    """

    label: str
    location: str
    served_model: str | None = None

    @classmethod
    def parse(cls, spec: str) -> ModelSpec:
        """``[label=]location[#served-name]``; the label defaults to the directory name or
        the URL's ``host:port`` (never its ``user:password@``).

        ``sft=/models/sft``, ``/models/grpo``, ``grpo=http://vllm:8000/v1#gpt-oss-20b``.
        """
        label, sep, location = spec.partition("=")
        if not sep or "/" in label or ":" in label:
            label, location = "", spec
        served = None
        if location.startswith(("http://", "https://")) and "#" in location:
            location, served = location.split("#", 1)
        if not label:
            trimmed = location.rstrip("/")
            if trimmed.startswith(("http://", "https://")):
                # the host and port only: a label is printed and logged, a password never
                authority = trimmed.split("//", 1)[1].split("/", 1)[0]
                label = authority.rpartition("@")[2]
            else:
                label = Path(trimmed).name or trimmed
        return cls(label=label, location=location, served_model=served or None)


def question_prompt(question: Question, config: EvalConfig) -> tuple[str, str]:
    """``(instructions, harmony prompt)`` of a question: reason and answer in its language."""
    name = LANGUAGE_NAMES[question.language]
    return task_prompt(name, name, config.persona, question.question, config.reasoning_effort)


def build_requests(
    questions: Sequence[Question], config: EvalConfig
) -> list[tuple[Question, int, GenerationRequest]]:
    """One request per question and sample: ``(question, sample index, request)``."""
    out = []
    for sample in range(config.sampling.n):
        for question in questions:
            instructions, prompt = question_prompt(question, config)
            request = GenerationRequest(
                key=f"{question.id}#{sample}",
                prompt=prompt,
                messages=(
                    {"role": "system", "content": instructions},
                    {"role": "user", "content": question.question},
                ),
                seed=sample_seed(config.sampling.seed, "eval", question.id, sample),
            )
            out.append((question, sample, request))
    return out


def _score_dict(result: ComplianceResult) -> dict:
    return {
        "reward": result.reward,
        "components": dict(result.components),
        "reasoning_verdict": result.reasoning_verdict.value,
        "answer_verdict": result.answer_verdict.value,
        "reasoning_language": result.reasoning_language,
        "answer_language": result.answer_language,
        "reasoning_fraction": result.reasoning_fraction,
        "answer_fraction": result.answer_fraction,
        "answer_sentences": result.answer_sentences,
        "brief_ok": result.brief_ok,
        "reasoning_loop": result.reasoning_loop and str(result.reasoning_loop),
        "answer_loop": result.answer_loop and str(result.answer_loop),
        "predicted_answer": result.predicted_answer,
        "correct": result.correct,
        "error": result.error,
    }


def score_response(
    question: Question, generation: Generation, scorer: ComplianceScorer
) -> tuple[Outcome, dict]:
    """Score one generation: the metrics' ``Outcome`` and the JSON record of the response."""
    record: dict = {
        "id": question.id,
        "problem_id": question.problem_id,
        "language": question.language,
        "category": question.category,
        "expected_answer": question.expected_answer,
        "text": generation.text,
        "reasoning_field": generation.reasoning,
        "finish_reason": generation.finish_reason,
        "completion_tokens": generation.completion_tokens,
        "latency_s": generation.latency_s,
        "attempts": generation.attempts,
        "error": generation.error,
    }
    if generation.failed:
        record.update(
            reasoning=None, final=None, truncated=None, score=None, degeneracy=None, values=None
        )
        return Outcome(language=question.language, failed=True), record
    parsed = generation.parsed()
    labels = LanguageLabels(question.language, question.language)
    result = scorer.score(parsed, labels, question.expected_answer, question.question)
    degeneracy = measure_degeneracy(parsed.reasoning, parsed.final, question.language)
    record.update(
        reasoning=parsed.reasoning,
        final=parsed.final,
        truncated=parsed.truncated,
        format=parsed.format.value,
        score=_score_dict(result),
        degeneracy={
            "words": degeneracy.words,
            "real_word_share": degeneracy.real_word_share,
            "repeated_ngram_rate": degeneracy.repeated_ngram_rate,
        },
    )
    outcome = Outcome.scored(question.language, result, degeneracy)
    record["values"] = response_values(outcome)  # the gate's per-question scores
    return outcome, record


@dataclass
class ModelRun:
    """One model's eval: its responses, summary and timing."""

    spec: ModelSpec
    engine: str
    summary: Summary
    responses: list[dict]
    wall_time_s: float
    load_time_s: float

    def to_dict(self) -> dict:
        """JSON-friendly form (responses excluded; they are listed at the top level)."""
        return {
            "label": self.spec.label,
            "location": self.spec.location,
            "served_model": self.spec.served_model,
            "engine": self.engine,
            "wall_time_s": self.wall_time_s,
            "load_time_s": self.load_time_s,
            "summary": self.summary.to_dict(),
        }


EngineFactory = Callable[[ModelSpec, EvalConfig], Engine]


def _default_engine(spec: ModelSpec, config: EvalConfig) -> Engine:
    return make_engine(spec.location, config, spec.served_model)


def evaluate_model(
    spec: ModelSpec,
    questions: Sequence[Question],
    config: EvalConfig,
    engine_factory: EngineFactory = _default_engine,
    scorer: ComplianceScorer | None = None,
) -> ModelRun:
    """Generate, score and summarize one model's responses."""
    scorer = scorer or ComplianceScorer()
    began = time.perf_counter()
    engine = engine_factory(spec, config)
    loaded = time.perf_counter()
    log.info("eval %s: %s loaded in %.1f s", spec.label, engine.description, loaded - began)
    try:
        planned = build_requests(questions, config)
        generations = engine.generate([r for _, _, r in planned], config.sampling.params)
    finally:
        engine.close()
    if len(generations) != len(planned):
        raise RuntimeError(
            f"{engine.description} returned {len(generations)} responses for {len(planned)}"
        )
    outcomes, records = [], []
    for (question, sample, request), generation in zip(planned, generations, strict=True):
        try:
            outcome, record = score_response(question, generation, scorer)
        except Exception as exc:  # this response's failure, never the model's
            log.error("%s: the reply could not be scored: %s", request.key, exc)
            failed = Generation(
                text=None,
                latency_s=generation.latency_s,
                attempts=generation.attempts,
                error=f"the reply could not be scored: {type(exc).__name__}: {exc}",
            )
            outcome, record = score_response(question, failed, scorer)
        outcomes.append(outcome)
        records.append({"model": spec.label, "sample": sample, **record})
    summary = summarize(outcomes)
    wall = time.perf_counter() - began
    log.info(
        "eval %s: %d responses (%d failed) in %.1f s; both-language accuracy %.3f",
        spec.label,
        summary.responses,
        summary.failed,
        wall,
        summary.value("both_language_accuracy"),
    )
    return ModelRun(spec, engine.description, summary, records, wall, loaded - began)


@dataclass
class EvalResults:
    """The outcome of an eval run over one or more models (first = baseline)."""

    config: EvalConfig
    questions_file: str
    questions_sha256: str
    questions: int
    runs: list[ModelRun]
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @property
    def baseline(self) -> str:
        """Label of the model the deltas are taken against."""
        return self.runs[0].spec.label

    @property
    def reasoning_length_reference(self) -> str:
        """The model ``reasoning_length_ratio`` compares with: ``sft`` when one is so labelled,
        else the baseline."""
        labels = [run.spec.label for run in self.runs]
        return REASONING_LENGTH_REFERENCE if REASONING_LENGTH_REFERENCE in labels else labels[0]

    def to_dict(self) -> dict:
        """The content of ``results.json``."""
        summaries = {run.spec.label: run.summary for run in self.runs}
        return {
            "schema_version": 1,
            "created_at": self.created_at,
            "config": self.config.model_dump(),
            "sampling": self.config.sampling.model_dump(),
            "questions_file": self.questions_file,
            "questions_sha256": self.questions_sha256,
            "questions": self.questions,
            "baseline": self.baseline,
            "models": [run.to_dict() for run in self.runs],
            "deltas": {
                label: {"overall": d.overall, "per_language": d.per_language}
                for label, d in deltas(summaries, self.baseline).items()
            },
            "reasoning_length_reference": self.reasoning_length_reference,
            "reasoning_length_ratio": reasoning_length_ratios(
                summaries, self.reasoning_length_reference
            ),
            "responses": [r for run in self.runs for r in run.responses],
        }


class DuplicateLabelError(ValueError):
    """Two models would be reported under one label."""


def _check_labels(specs: Sequence[ModelSpec]) -> None:
    labels = [s.label for s in specs]
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        clash = " and ".join(redact(s.location) for s in specs if s.label == duplicates[0])
        raise DuplicateLabelError(
            f"model labels must be unique: {duplicates[0]!r} names {clash}; give each model "
            "its own label (-m NAME=LOCATION)"
        )


def check_failures(results: EvalResults) -> None:
    """Raise when a model's failure rate exceeds the configured threshold.

    Raises:
        TooManyFailuresError: Names the models, their failure rates and the first errors.
    """
    limit = results.config.max_failure_fraction
    bad = [run for run in results.runs if run.summary.failure_rate > limit]
    if not bad:
        return
    lines = []
    for run in bad:
        errors = [f"{r['id']}: {r['error']}" for r in run.responses if r["error"]][:3]
        lines.append(
            f"{run.spec.label}: {run.summary.failed}/{run.summary.responses} responses failed "
            f"({run.summary.failure_rate:.0%} > {limit:.0%}); first errors: {errors}"
        )
    raise TooManyFailuresError("; ".join(lines))


def run_eval(
    models: Sequence[ModelSpec | str],
    config: EvalConfig,
    output_dir: str | Path,
    engine_factory: EngineFactory = _default_engine,
) -> EvalResults:
    """Evaluate the models side by side and write ``results.json``, ``report.md``,
    ``report.html`` (and an MLflow run when tracking is configured).

    The outputs are written before the failure check, so a failed run leaves its evidence.

    Raises:
        ValueError: No models.
        DuplicateLabelError: Two models have the same label.
        OutputNotOursError: ``output_dir`` holds a report file this project did not write.
        OutputInsideModelError: ``output_dir`` is, or is inside, a model directory.
        ModelNotFoundError: A model directory does not exist, or lacks its config, tokenizer
            files or readable weights.
        NonFiniteWeightsError: A model's weights hold NaN or infinite values.
        TooManyFailuresError: A model's failure rate exceeds ``max_failure_fraction``.
    """
    specs = [m if isinstance(m, ModelSpec) else ModelSpec.parse(m) for m in models]
    if not specs:
        raise ValueError("no models to evaluate")
    _check_labels(specs)
    check_output_files(ReportPaths.under(output_dir).files(), "--output-dir")
    questions_path = Path(config.questions) if config.questions else BUNDLED_QUESTIONS
    questions = load_questions(questions_path, config.languages, config.limit)
    if engine_factory is _default_engine:  # another factory gives locations its own meaning
        _check_locations(specs)
        _check_output_outside_models(specs, output_dir)
    check_writable(output_dir)  # before hours of generation, not after
    scorer = ComplianceScorer()
    results = EvalResults(
        config=config,
        questions_file=str(questions_path),
        questions_sha256=hashlib.sha256(questions_path.read_bytes()).hexdigest(),
        questions=len(questions),
        runs=[],
    )
    for spec in specs:
        try:
            run = evaluate_model(spec, questions, config, engine_factory, scorer)
        except Exception as exc:
            done = ", ".join(r.spec.label for r in results.runs)
            kept = f"; the finished models' results ({done}) are in {output_dir}" if done else ""
            raise ModelEvalError(
                f"model {spec.label!r} ({spec.location}) failed: {type(exc).__name__}: {exc}{kept}"
            ) from exc
        results.runs.append(run)
        paths = write_reports(results.to_dict(), output_dir)  # each model's, once it is done
    log_eval_run(results.to_dict(), paths)
    check_failures(results)
    return results


class OutputInsideModelError(ValueError):
    """``--output-dir`` is, or is inside, a model directory being evaluated."""


def _check_output_outside_models(specs: Sequence[ModelSpec], output_dir: str | Path) -> None:
    """Refuse an output folder inside a model directory: the reports would change the
    model's content (and its content hash, which names what was evaluated)."""
    out = Path(output_dir).resolve()
    for spec in specs:
        if is_endpoint(spec.location):
            continue
        model = Path(spec.location).resolve()
        if out == model or model in out.parents:
            raise OutputInsideModelError(
                f"--output-dir {output_dir} is {'' if out == model else 'inside '}the model "
                f"directory of {spec.label!r} ({spec.location}): the reports would change the "
                "model's files; write them elsewhere"
            )


class ModelEvalError(RuntimeError):
    """A model failed to load or generate; the models finished before it are written."""


class NonFiniteWeightsError(ValueError):
    """A model's weights hold NaN or infinite values: there is nothing to evaluate."""


def _check_locations(specs: Sequence[ModelSpec]) -> None:
    """Every model directory exists and is a model (config, tokenizer files, readable
    weights), then every model's weights are finite, before any generation (URLs: at use)."""
    problems = []
    directories = [spec for spec in specs if not is_endpoint(spec.location)]
    for spec in directories:
        try:
            require_model_dir(spec.location)
        except ModelNotFoundError as exc:
            problems.append(f"{spec.label}: {exc}")
    if problems:
        raise ModelNotFoundError("; ".join(problems))
    for spec in directories:
        # a diverged model would be scored as a real one (every response wrong): stop here
        if (bad := nonfinite_weights(spec.location)) is not None:
            problems.append(f"{spec.label}: {bad}")
    if problems:
        raise NonFiniteWeightsError(
            "model weights are not finite, there is nothing to evaluate (a training run that "
            f"diverged?): {'; '.join(problems)}"
        )
