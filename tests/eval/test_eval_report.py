"""The runner and reports on fixed responses: results.json, Markdown, HTML, KFP scalars."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence

import pytest

from core.seeds import sample_seed
from eval.eval_config import EvalConfig, SamplingSettings
from eval.report import kfp_metrics, language_chart_png, load_results, render_markdown
from eval.runner import ModelSpec, TooManyFailuresError, load_questions, run_eval
from generation.engines import ModelNotFoundError
from generation.requests import Generation, GenerationRequest

GOOD = {
    "en": ("I multiply the number of students by the share that walks.", "They are 168."),
    "fr": ("Je multiplie le nombre d'élèves par la part qui marche.", "Ils sont 168."),
    "de": (
        "Ich multipliziere die Zahl der Schüler mit dem Anteil, der zu Fuß geht.",
        "Es sind 168.",
    ),
    "es": (
        "Multiplico el número de alumnos por la parte que camina.",
        "Son 168 los alumnos que van a pie.",
    ),
    "it": ("Moltiplico il numero degli studenti per la parte che cammina.", "Sono 168 studenti."),
}


def good_response(language: str) -> str:
    analysis, final = GOOD[language]
    return (
        f"<|channel|>analysis<|message|>{analysis}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{final}<|return|>"
    )


class ScriptedEngine:
    """Answers each request from a table keyed by question language (fixed responses)."""

    def __init__(self, answer, fail_ids: Sequence[str] = ()) -> None:
        self.answer = answer
        self.fail_ids = set(fail_ids)
        self.description = "scripted"
        self.seen: list[GenerationRequest] = []

    def generate(self, requests, sampling) -> list[Generation]:
        self.seen += requests
        out = []
        for request in requests:
            question_id = request.key.split("#")[0]
            if question_id in self.fail_ids:
                out.append(Generation(None, error="HTTP 503: overloaded", attempts=4))
            else:
                out.append(Generation(self.answer(question_id.split("-")[1])))
        return out

    def close(self) -> None:
        pass


def english_only(language: str) -> str:
    return good_response("en")


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    engines = {"base": ScriptedEngine(english_only), "grpo": ScriptedEngine(good_response)}
    config = EvalConfig(limit=10, sampling=SamplingSettings(n=2, seed=5, max_tokens=64))
    results = run_eval(
        ["base=/models/base", "grpo=/models/grpo"],
        config,
        out,
        engine_factory=lambda spec, cfg: engines[spec.label],
    )
    return out, results, engines


def test_results_json_keeps_every_response_and_the_sampling(report_dir):
    out, _, engines = report_dir
    data = json.loads((out / "results.json").read_text())
    assert data["sampling"] == {
        "temperature": 0.7,
        "top_p": 0.95,
        "max_tokens": 64,
        "seed": 5,
        "n": 2,
    }
    assert len(data["responses"]) == 2 * 10 * 2  # models × questions × samples
    assert {r["sample"] for r in data["responses"]} == {0, 1}
    assert data["baseline"] == "base"
    # the prompt convention: developer instructions then persona, one language throughout
    request = next(r for r in engines["grpo"].seen if r.key == "p01-fr#1")
    assert request.messages[0]["content"].startswith(
        "reasoning language: French\nanswer language: French\n\n"
    )
    assert request.prompt.endswith("<|start|>assistant")
    assert "<|start|>user<|message|>Une école compte 480 élèves" in request.prompt
    assert request.seed == sample_seed(5, "eval", "p01-fr", 1)  # its own: question and sample


def test_metrics_and_deltas_of_fixed_responses(report_dir):
    _, results, _ = report_dir
    data = results.to_dict()
    base, grpo = (m["summary"]["overall"] for m in data["models"])
    assert grpo["both_language_accuracy"]["value"] == 1.0
    # base answers in English everywhere: right only for the 4 English responses of 20
    assert base["both_language_accuracy"]["value"] == pytest.approx(4 / 20)
    assert data["deltas"]["grpo"]["overall"]["both_language_accuracy"] == pytest.approx(0.8)
    assert grpo["answer_correct"]["value"] == 0.5  # "168" is right for p01, wrong for p02
    base_confusion = data["models"][0]["summary"]["confusion"]["answer"]
    assert base_confusion["fr"]["en"] == 4
    scalars = kfp_metrics(data)
    assert scalars["grpo/both_language_accuracy"] == 1.0
    assert scalars["grpo-vs-base/both_language_accuracy"] == pytest.approx(0.8)
    assert scalars["base/failure_rate"] == 0.0


def test_markdown_report_renders_the_tables(report_dir):
    out, _, _ = report_dir
    markdown = (out / "report.md").read_text()
    assert markdown == render_markdown(load_results(out))  # rebuilt from results.json
    assert "| metric | base | grpo | Δ grpo − base |" in markdown
    assert re.search(r"\| reasoning and answer in the requested language \| 0\.200 \[", markdown)
    assert "**base: answer**" in markdown
    assert "| fr | 0 | 4 | 0 | 0 | 0 | 0 | 0 | 0 |" in markdown  # fr rows of base's answers
    assert "No generation failed." in markdown
    assert "&lt;|" not in markdown.split("## Examples")[0]


def test_html_report_embeds_the_chart(report_dir):
    out, _, _ = report_dir
    page = (out / "report.html").read_text()
    match = re.search(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert match is not None
    assert base64.b64decode(match.group(1)).startswith(b"\x89PNG")
    assert page.count("<table>") >= 1 + 1 + 8 + 4  # setup, overall, per language, confusion
    assert "<th>Δ grpo − base</th>" in page
    assert language_chart_png(load_results(out)).startswith(b"\x89PNG")


def test_failures_are_recorded_and_reported(tmp_path):
    engine = ScriptedEngine(good_response, fail_ids=["p01-de"])
    config = EvalConfig(limit=10, max_failure_fraction=0.2)
    run_eval(["m=/x"], config, tmp_path, engine_factory=lambda spec, cfg: engine)
    data = load_results(tmp_path)
    failed = [r for r in data["responses"] if r["error"]]
    assert [(r["id"], r["error"], r["attempts"]) for r in failed] == [
        ("p01-de", "HTTP 503: overloaded", 4)
    ]
    summary = data["models"][0]["summary"]
    assert (summary["responses"], summary["failed"]) == (10, 1)
    assert summary["overall"]["both_language_accuracy"]["n"] == 9
    markdown = (tmp_path / "report.md").read_text()
    assert "| p01-de | 0 | 4 | HTTP 503: overloaded |" in markdown


def test_too_many_failures_fail_the_run_after_writing_results(tmp_path):
    engine = ScriptedEngine(good_response, fail_ids=["p01-de", "p01-fr", "p02-en"])
    config = EvalConfig(limit=10, max_failure_fraction=0.2)
    with pytest.raises(TooManyFailuresError, match=r"m: 3/10 responses failed \(30% > 20%\)"):
        run_eval(["m=/x"], config, tmp_path, engine_factory=lambda spec, cfg: engine)
    assert len(load_results(tmp_path)["responses"]) == 10


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        run_eval([str(tmp_path / "nope")], EvalConfig(limit=1), tmp_path / "out")
    assert not (tmp_path / "out" / "results.json").exists()


def test_model_specs_and_labels():
    assert ModelSpec.parse("sft=/models/sft") == ModelSpec("sft", "/models/sft")
    assert ModelSpec.parse("/runs/x/grpo/") == ModelSpec("grpo", "/runs/x/grpo/")
    assert ModelSpec.parse("grpo=http://vllm:8000/v1#gpt-oss-20b") == ModelSpec(
        "grpo", "http://vllm:8000/v1", "gpt-oss-20b"
    )
    assert ModelSpec.parse("http://vllm:8000/v1").label == "vllm:8000"
    with pytest.raises(ValueError, match="unique"):
        run_eval(["a=/x", "a=/y"], EvalConfig(), "/tmp/unused")


def test_question_filters():
    assert len(load_questions()) == 50
    french = load_questions(languages=["French"])
    assert len(french) == 10
    assert {q.language for q in french} == {"fr"}
    assert [q.id for q in load_questions(limit=3)] == ["p01-en", "p01-fr", "p01-de"]


DEMO_LOOP = "La con una con una con con una con una con una con una conci delle con una con con un."


def italian_loops(language: str) -> str:
    """Good responses, except Italian answers: the demo GRPO policy's loop (issue #29)."""
    if language != "it":
        return good_response(language)
    return (
        f"<|channel|>analysis<|message|>{GOOD['it'][0]}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{DEMO_LOOP}<|return|>"
    )


def test_loops_count_as_the_wrong_language_and_are_reported_per_language(tmp_path):
    engine = ScriptedEngine(italian_loops)
    run_eval(["grpo=/x"], EvalConfig(limit=10), tmp_path, engine_factory=lambda s, c: engine)
    data = load_results(tmp_path)
    summary = data["models"][0]["summary"]
    italian = summary["per_language"]["it"]
    assert italian["answer_language_accuracy"]["value"] == 0.0  # the identifier said Italian
    assert italian["both_language_accuracy"]["value"] == 0.0
    assert italian["loop_rate"]["value"] == 1.0
    assert all(summary["per_language"][c]["loop_rate"]["value"] == 0.0 for c in GOOD if c != "it")
    assert summary["overall"]["loop_rate"]["value"] == pytest.approx(2 / 10)
    assert summary["confusion"]["answer"]["it"]["loop"] == 2
    assert summary["confusion"]["answer"]["it"]["it"] == 0
    record = next(r for r in data["responses"] if r["language"] == "it")
    assert record["score"]["answer_verdict"] == "loop"
    assert record["score"]["answer_loop"] == "repeated_ngrams"
    assert record["score"]["answer_language"] == "it"  # what the identifier alone said
    markdown = (tmp_path / "report.md").read_text()
    assert "reasoning or answer a loop (scored as the wrong language)" in markdown
    assert "| it | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 2 |" in markdown  # it row of the answers
    assert kfp_metrics(data)["grpo/loop_rate"] == pytest.approx(0.2)
