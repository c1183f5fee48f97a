"""The promotion gate: the rule on its own, and the registry against a real MLflow server
(sqlite backend, proxied local artifacts) started by this module on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kfp import dsl
from mlflow_server import mlflow_server

from components.evaluate import champion as champion_component
from components.evaluate import evaluate, gate, register
from eval.eval_metrics import Outcome, response_values, summarize
from eval.gate import (
    RETRAIN,
    UNCHANGED_DATA,
    Decision,
    EvalFooting,
    GateConfig,
    apply_gate,
    check_data,
    data_decision,
    decide,
    evaluate_gate,
)
from eval.paired import paired_bootstrap
from eval.registry import RegisteredVersion, aliased_version, content_sha256
from eval.report import json_safe
from trainer.tiny_model import SMALLEST, build_tiny_model

METRIC = "both_language_accuracy"


def model_results(questions: int = 40, limit: int | None = None, **accuracies: float) -> dict:
    """results.json content where model ``label`` answers the first ``accuracy × questions``
    questions right (both languages) and the rest wrong, one sample each."""
    models, responses = [], []
    for label, accuracy in accuracies.items():
        hits = round(accuracy * questions)
        outcomes = [
            Outcome(
                "en", reasoning_ok=i < hits, answer_ok=i < hits, reward=0.0, real_word_share=0.9
            )
            for i in range(questions)
        ]
        models.append({"label": label, "summary": summarize(outcomes).to_dict()})
        responses += [
            {"model": label, "id": f"q{i}", "sample": 0, "values": response_values(o)}
            for i, o in enumerate(outcomes)
        ]
    sampling = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 512, "seed": 0, "n": 1}
    data = {
        "models": models,
        "responses": responses,
        "questions": questions,
        "questions_sha256": "q" * 64,
        "config": {"limit": limit, "languages": None, "persona": "p", "reasoning_effort": "low"},
        "sampling": sampling,
        "created_at": "2026-01-01T00:00:00",
    }
    return json.loads(json.dumps(json_safe(data)))


def model_dir(root: Path, name: str, weights: bytes) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "gpt_oss"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


FULL = EvalFooting.of(model_results(grpo=0.5))
"""The footing of a full eval (40 questions, no limit)."""


def champion(
    version: str, value: float | None, sha: str = "c" * 64, footing: str | None = FULL.sha256
) -> RegisteredVersion:
    metrics = {} if value is None else {METRIC: value}
    return RegisteredVersion(version, sha, metrics, "mlflow-artifacts:/x", footing, "full")


# -- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("candidate", "champ", "baseline", "margin", "expected", "reference"),
    [
        (0.60, None, 0.40, 0.0, Decision.PROMOTE, "sft"),  # no champion: beat SFT
        (0.40, None, 0.40, 0.0, Decision.KEEP, "sft"),  # a tie is not a win
        (0.45, None, 0.40, 0.05, Decision.KEEP, "sft"),  # must exceed the margin
        (0.46, None, 0.40, 0.05, Decision.PROMOTE, "sft"),
        (0.30, None, None, 0.0, Decision.PROMOTE, "none"),  # nothing to compare with
    ],
)
def test_decide(candidate, champ, baseline, margin, expected, reference):
    baseline_metrics = None if baseline is None else {METRIC: baseline}
    result = decide(
        GateConfig(margin=margin), {METRIC: candidate}, champ, baseline_metrics, "a" * 64
    )
    assert (result.decision, result.reference) == (expected, reference)
    assert result.candidate_value == candidate


@pytest.mark.parametrize(
    ("differences", "margin", "expected"),
    [
        ([0.5] * 30 + [0.0] * 10, 0.0, Decision.PROMOTE),  # better on most questions
        ([0.0] * 40, 0.0, Decision.KEEP),  # the same on every question
        ([1.0, -1.0] * 20, 0.0, Decision.KEEP),  # equal on average
        ([1.0] * 3 + [0.0] * 37, 0.0, Decision.KEEP),  # +0.075, but from 3 questions
        ([0.2] * 40, 0.25, Decision.KEEP),  # sure, but below the margin
    ],
)
def test_decide_against_the_champion_is_the_paired_test(differences, margin, expected):
    paired = paired_bootstrap(differences, 0.95, margin)
    config = GateConfig(margin=margin)
    result = decide(
        config, {METRIC: 0.7}, champion("3", 0.6), {METRIC: 0.1}, "a" * 64, paired, FULL,
        {METRIC: 0.6},
    )  # fmt: skip
    assert (result.decision, result.reference) == (expected, "champion v3")
    assert result.reason.startswith("paired bootstrap over 40 questions")
    spread = len(set(differences)) > 1  # one difference everywhere: sd 0, nothing to size from
    assert (
        "questions detect a true difference of +0.10 with power 80%"
        if spread
        else "not estimable from this eval"
    ) in result.power


def test_with_every_question_tied_the_power_line_says_it_cannot_be_estimated():
    """Reproduces the retraining story's run 3: both models scored 0 on all 5 questions, and
    the gate printed '2 questions detect a true difference of +0.10 …; these 5 detect
    +0.000' (questions_needed's 2 for sd 0), a sample size nothing supports."""
    paired = paired_bootstrap([0.0] * 5, 0.95)
    result = decide(
        GateConfig(), {METRIC: 0.0}, champion("1", 0.0), {METRIC: 0.0}, "a" * 64, paired, FULL,
        {METRIC: 0.0},
    )  # fmt: skip
    assert result.decision is Decision.KEEP
    assert "questions detect" not in result.power and "these 5 detect" not in result.power
    assert result.power.startswith("not estimable from this eval: all 5 questions gave the same")
    spread = paired_bootstrap([0.0, 1.0, 0.0, -1.0, 0.0], 0.95)
    assert "questions detect a true difference of +0.10" in (
        decide(
            GateConfig(),
            {METRIC: 0.0},
            champion("1", 0.0),
            {METRIC: 0.0},
            "a" * 64,
            spread,
            FULL,
            {METRIC: 0.0},
        ).power  # fmt: skip
    )


def test_decide_refuses_when_the_champion_is_not_on_the_same_footing():
    """The exploit of issue 41: a champion at 0.848 on the full eval, a candidate at 1.0 on
    `--set eval.limit=1`: refused by the footing, whatever the scores."""
    limited = EvalFooting.of(model_results(questions=1, limit=1, grpo=1.0))
    paired = paired_bootstrap([1.0], 0.95)
    args = ({METRIC: 1.0}, champion("1", 0.848), None, "a" * 64, paired)
    result = decide(GateConfig(), *args, limited, {METRIC: 0.0})
    assert result.decision is Decision.REFUSED
    assert result.reason.startswith("refused to compare: this eval (1 questions (limit 1)")
    assert "is not the footing champion v1 was promoted on (full)" in result.reason
    other_sampling = model_results(grpo=0.5)
    other_sampling["sampling"]["temperature"] = 1.0
    result = decide(GateConfig(), *args, EvalFooting.of(other_sampling), {METRIC: 0.0})
    assert result.decision is Decision.REFUSED
    old = champion("1", 0.8, footing=None)  # promoted before footings were recorded
    result = decide(GateConfig(), {METRIC: 1.0}, old, None, "a" * 64, paired, FULL, {})
    assert (result.decision, "no recorded eval footing" in result.reason) == (
        Decision.REFUSED, True,
    )  # fmt: skip
    unevaluated = decide(GateConfig(), {METRIC: 1.0}, champion("1", 0.8), None, "a", None, FULL)
    assert unevaluated.decision is Decision.REFUSED
    assert "was not evaluated in this run" in unevaluated.reason


def test_data_decision():
    config = GateConfig()
    held = RegisteredVersion("2", "c", {}, "x", FULL.sha256, "full", data_fingerprint="f" * 64)
    assert data_decision("f" * 64, held, config) == (
        UNCHANGED_DATA,
        "data fingerprint ffffffffffff equals champion v2's: SFT, GRPO and the eval do not run "
        "(set force to retrain)",
    )
    assert data_decision("f" * 64, held, GateConfig(force=True))[0] == RETRAIN
    assert data_decision("e" * 64, held, config)[0] == RETRAIN
    assert data_decision("unknown", held, config)[0] == RETRAIN  # a hub revision not pinned
    assert data_decision("f" * 64, None, config)[0] == RETRAIN


def test_decide_same_content_as_champion_is_unchanged():
    result = decide(GateConfig(), {METRIC: 0.9}, champion("2", 0.5, sha="a" * 64), None, "a" * 64)
    assert result.decision is Decision.UNCHANGED
    assert "already champion" in result.reason


def test_decide_guards_against_degenerate_text_and_missing_values():
    config = GateConfig(min_real_word_share=0.8)
    degenerate = {METRIC: 1.0, "real_word_share": 0.55}
    assert decide(config, degenerate, None, {METRIC: 0.1}, "a").decision is Decision.KEEP
    assert decide(GateConfig(), {METRIC: None}, None, None, "a").decision is Decision.KEEP


def test_gate_config_rejects_unknown_or_lower_is_better_metrics():
    with pytest.raises(ValueError, match="gate metric"):
        GateConfig(metric="repeated_ngram_rate")
    with pytest.raises(ValueError, match="gate metric"):
        GateConfig(metric="loop_rate")  # lower is better too
    with pytest.raises(ValueError, match="gate metric"):
        GateConfig(metric="accuracy")


@pytest.mark.parametrize(
    ("field", "value"),
    [("confidence", 1.0), ("confidence", 0.3), ("power", 0.0), ("effect", 0.0),
     ("resamples", 10), ("champion_label", "")],
)  # fmt: skip
def test_gate_config_rejects_bad_test_settings_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        GateConfig(**{field: value})


def test_the_decision_line_carries_the_power_figure():
    paired = paired_bootstrap([0.5, 0.0] * 20, 0.95)
    result = decide(
        GateConfig(), {METRIC: 0.7}, champion("3", 0.6), None, "a", paired, FULL, {METRIC: 0.6}
    )
    line = result.line()
    assert line.startswith("decision | gate: promote | paired bootstrap over 40 questions")
    assert line.count("\n") == 0 and " | power: " in line and "these 40 detect +" in line


def test_content_hash_follows_content_and_names(tmp_path):
    a = model_dir(tmp_path, "a", b"\x00\x01")
    b = model_dir(tmp_path, "b", b"\x00\x01")
    c = model_dir(tmp_path, "c", b"\x00\x02")
    assert content_sha256(a) == content_sha256(b)
    assert content_sha256(a) != content_sha256(c)
    (b / "model.safetensors").rename(b / "other.safetensors")
    assert content_sha256(a) != content_sha256(b)
    with pytest.raises(FileNotFoundError):
        content_sha256(tmp_path / "absent")


def test_without_tracking_the_gate_is_skipped_with_the_comparison(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    candidate = model_dir(tmp_path, "grpo", b"w")
    result = evaluate_gate(model_results(sft=0.4, grpo=0.6), candidate, GateConfig())
    assert result.decision is Decision.SKIPPED
    assert "no MLFLOW_TRACKING_URI" in result.reason and "beats sft" in result.reason
    missing = evaluate_gate(model_results(sft=0.4), candidate, GateConfig())
    assert missing.decision is Decision.SKIPPED


# -- in a local SQLite store, no server (what `lingo run --local` tracks to) -----------------


def test_the_gate_registers_into_a_local_sqlite_store(tmp_path, monkeypatch):
    """mlflow-skinny opens the store itself; the model's files land beside the database, not
    in ./mlruns of the directory the step runs in."""
    import mlflow
    from mlflow import MlflowClient

    from core.tracking import local_store_uri

    store, cwd = tmp_path / "runs", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", local_store_uri(store))
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    candidate = model_dir(tmp_path, "grpo", b"weights")
    result = apply_gate(model_results(sft=0.40, grpo=0.60), candidate, GateConfig())
    assert (result.decision, result.registered_version) == (Decision.PROMOTE, "1")
    client = MlflowClient()
    aliases = client.get_registered_model("lingo-gpt-oss").aliases  # the store says 1, a server "1"
    assert {k: str(v) for k, v in aliases.items()} == {"champion": "1"}
    downloaded = mlflow.artifacts.download_artifacts(
        "models:/lingo-gpt-oss@champion", dst_path=str(tmp_path / "download")
    )
    assert content_sha256(downloaded) == content_sha256(candidate)
    assert (store / "mlflow.db").is_file()
    assert sorted(p.name for p in (store / "mlartifacts").rglob("model.safetensors")) == [
        "model.safetensors"
    ]
    assert list(cwd.iterdir()) == []
    assert apply_gate(model_results(grpo=0.60), candidate, GateConfig()).decision is (
        Decision.UNCHANGED
    )


# -- against a real MLflow server -------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@pytest.fixture
def tracking(mlflow_url, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lingo-rl-tests")
    return mlflow_url


def _versions(name: str) -> list[str]:
    from mlflow import MlflowClient

    return sorted(v.version for v in MlflowClient().search_model_versions(f"name='{name}'"))


def _alias(name: str) -> str | None:
    from mlflow import MlflowClient

    return MlflowClient().get_registered_model(name).aliases.get("champion")


def test_gate_lifecycle_on_a_real_registry(tracking, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    config = GateConfig(registered_model="lifecycle", margin=0.02)
    first = model_dir(tmp_path, "first", b"weights-1")
    worse = model_dir(tmp_path, "worse", b"weights-2")
    better = model_dir(tmp_path, "better", b"weights-3")

    # 1. no champion: the first model beats SFT and becomes champion, its data and eval noted
    result = apply_gate(model_results(sft=0.40, grpo=0.60), first, config, "d" * 64)
    assert (result.decision, result.reference, result.registered_version) == (
        Decision.PROMOTE,
        "sft",
        "1",
    )
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1"], "1")
    held = aliased_version("lifecycle", "champion")
    assert (held.data_fingerprint, held.eval_footing) == ("d" * 64, FULL.sha256)
    assert check_data("d" * 64, config) == UNCHANGED_DATA
    assert check_data("e" * 64, config) == RETRAIN

    # 2. the same model again: idempotent, no new version, alias unchanged
    again = apply_gate(model_results(sft=0.40, grpo=0.60, champion=0.60), first, config)
    assert again.decision is Decision.UNCHANGED
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1"], "1")

    # 3. a worse model (0.55 < the champion's 0.60 in the same eval): not registered
    kept = apply_gate(model_results(sft=0.40, grpo=0.55, champion=0.60), worse, config)
    assert (kept.decision, kept.reference, kept.reference_value) == (
        Decision.KEEP,
        "champion v1",
        0.6,
    )
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1"], "1")

    # 4. a better one, with confidence: new version, alias moves
    moved = apply_gate(model_results(sft=0.40, grpo=0.75, champion=0.60), better, config)
    assert (moved.decision, moved.registered_version) == (Decision.PROMOTE, "2")
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1", "2"], "2")

    # 5. re-run on it: unchanged
    assert apply_gate(model_results(grpo=0.75), better, config).decision is Decision.UNCHANGED
    assert _versions("lifecycle") == ["1", "2"]

    # 6. an earlier version that wins again is reused (found by its hash), not re-uploaded
    back = apply_gate(model_results(grpo=0.90, champion=0.75), first, config)
    assert (back.decision, back.registered_version) == (Decision.PROMOTE, "1")
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1", "2"], "1")
    assert MlflowClient().get_model_version("lifecycle", "1").tags[f"lingo.eval.{METRIC}"] == "0.9"

    # 7. issue 41's exploit: one question scores 1.0 against the champion's 0.0 on it; the
    # eval is limited, the champion's was not: refused, nothing moves
    limited = apply_gate(model_results(questions=1, limit=1, grpo=1.0, champion=0.0), worse, config)
    assert limited.decision is Decision.REFUSED
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1", "2"], "1")

    apply_gate(model_results(grpo=0.95, champion=0.75), better, config)  # "better" again
    # the registry holds the real files: the champion downloads to the same content hash
    downloaded = mlflow.artifacts.download_artifacts(
        "models:/lifecycle@champion", dst_path=str(tmp_path / "download")
    )
    assert content_sha256(downloaded) == content_sha256(better)
    tags = MlflowClient().get_model_version("lifecycle", "2").tags
    assert tags["lingo.content_sha256"] == content_sha256(better)
    assert float(tags[f"lingo.eval.{METRIC}"]) == 0.95


def test_components_end_to_end(tracking, tmp_path):
    """The component bodies in-process: eval (tiny model, logged to MLflow), gate, register."""
    from mlflow import MlflowClient

    tiny = build_tiny_model(
        tmp_path / "tiny",
        SMALLEST,
    )
    out = tmp_path / "outputs"
    results = dsl.Artifact(uri=str(out / "results"))
    markdown, page = dsl.Markdown(uri=str(out / "report")), dsl.HTML(uri=str(out / "html"))
    metrics = dsl.Metrics(uri=str(out / "metrics"))
    config = {"limit": 5, "sampling": {"max_tokens": 8}, "batch_size": 5}
    matrices = {
        f"{model}_{part}_language": dsl.ClassificationMetrics(uri=str(out / f"{model}_{part}"))
        for model in ("base", "sft", "grpo")
        for part in ("reasoning", "answer")
    }
    evaluate.python_func(
        base_model=dsl.Model(uri=str(tiny)),
        sft_model=dsl.Model(uri=str(tiny)),
        grpo_model=dsl.Model(uri=str(tiny)),
        config=config,
        results=results,
        report=markdown,
        report_html=page,
        metrics=metrics,
        **matrices,
        mlflow_tracking_uri=tracking,
    )
    data = json.loads(Path(results.path).read_text())
    assert [m["label"] for m in data["models"]] == ["base", "sft", "grpo"]
    assert len(data["responses"]) == 15
    assert "## Overall" in Path(markdown.path).read_text()
    assert "data:image/png;base64," in Path(page.path).read_text()
    assert metrics.metadata["grpo-vs-base/mean_reward"] == 0.0  # same weights, same seed
    grpo_answers = matrices["grpo_answer_language"].metadata["confusionMatrix"]
    assert sum(sum(row["row"]) for row in grpo_answers["rows"]) == 5
    runs = MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name("lingo-rl-tests").experiment_id],
        filter_string="attributes.run_name = 'eval'",
    )
    assert runs and "grpo/mean_reward" in runs[0].data.metrics
    artifacts = {a.path for a in MlflowClient().list_artifacts(runs[0].info.run_id, "eval")}
    assert artifacts == {"eval/results.json", "eval/report.md", "eval/report.html"}

    def decide(component, config: dict, report: str) -> str:
        """The gate or register component on the eval's results and the tiny model."""
        return component.python_func(
            results=results,
            grpo_model=dsl.Model(uri=str(tiny)),
            config=config,
            report=dsl.Markdown(uri=str(out / report)),
            mlflow_tracking_uri=tracking,
        )

    decision = decide(gate, {"registered_model": "e2e", "margin": 0.0}, "gate")
    assert decision == "keep"  # the GRPO model is the SFT model: no gain
    assert "does not beat sft" in (out / "gate").read_text()

    first = {"registered_model": "e2e", "baseline": ""}  # nothing to beat
    assert decide(gate, first, "gate2") == "promote"
    version = decide(register, first, "register")
    assert version == "1"
    assert _alias("e2e") == "1"
    assert "**promote**" in (out / "register").read_text()

    # the next run evaluates the champion, downloaded from the registry, beside the candidate
    held = dsl.Model(uri=str(out / "champion"))
    assert champion_component.python_func(first, held, tracking) == "1"
    assert content_sha256(held.path) == content_sha256(tiny)
    results = dsl.Artifact(uri=str(out / "results2"))
    evaluate.python_func(
        base_model=dsl.Model(uri=str(tiny)),
        sft_model=dsl.Model(uri=str(tiny)),
        grpo_model=dsl.Model(uri=str(tiny)),
        champion_model=held,
        config=config,
        results=results,
        report=dsl.Markdown(uri=str(out / "report2")),
        report_html=dsl.HTML(uri=str(out / "html2")),
        metrics=dsl.Metrics(uri=str(out / "metrics2")),
        **matrices,
        mlflow_tracking_uri=tracking,
    )
    data = json.loads(Path(results.path).read_text())
    assert [m["label"] for m in data["models"]] == ["base", "sft", "grpo", "champion"]
    assert decide(gate, first, "gate3") == "unchanged"  # the candidate is the champion
