"""The promotion gate: the rule on its own, and the registry against a real MLflow server
(sqlite backend, proxied local artifacts) started by this module on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kfp import dsl
from mlflow_server import mlflow_server

from components.evaluate import evaluate, gate, register
from eval.eval_metrics import Outcome, summarize
from eval.gate import Decision, GateConfig, apply_gate, decide, evaluate_gate
from eval.registry import RegisteredVersion, content_sha256
from eval.report import json_safe
from trainer.tiny_model import SMALLEST, build_tiny_model

METRIC = "both_language_accuracy"


def model_results(**accuracies: float) -> dict:
    """results.json content where model ``label`` has the given both-language accuracy."""
    models = []
    for label, accuracy in accuracies.items():
        hits = round(accuracy * 20)
        outcomes = [
            Outcome(
                "en", reasoning_ok=i < hits, answer_ok=i < hits, reward=0.0, real_word_share=0.9
            )
            for i in range(20)
        ]
        models.append({"label": label, "summary": summarize(outcomes).to_dict()})
    data = {"models": models, "questions_sha256": "q" * 64, "created_at": "2026-01-01T00:00:00"}
    return json.loads(json.dumps(json_safe(data)))


def model_dir(root: Path, name: str, weights: bytes) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "gpt_oss"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def champion(version: str, value: float | None, sha: str = "c" * 64) -> RegisteredVersion:
    metrics = {} if value is None else {METRIC: value}
    return RegisteredVersion(version, sha, metrics, "mlflow-artifacts:/x")


# -- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("candidate", "champ", "baseline", "margin", "expected", "reference"),
    [
        (0.60, None, 0.40, 0.0, Decision.PROMOTE, "sft"),  # no champion: beat SFT
        (0.40, None, 0.40, 0.0, Decision.KEEP, "sft"),  # a tie is not a win
        (0.45, None, 0.40, 0.05, Decision.KEEP, "sft"),  # must exceed the margin
        (0.46, None, 0.40, 0.05, Decision.PROMOTE, "sft"),
        (0.70, champion("3", 0.60), 0.40, 0.0, Decision.PROMOTE, "champion v3"),
        (0.55, champion("3", 0.60), 0.40, 0.0, Decision.KEEP, "champion v3"),
        (0.90, champion("3", None), 0.40, 0.0, Decision.KEEP, "champion v3"),  # no value stored
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

    config = GateConfig(registered_model="lifecycle", margin=0.02)
    first = model_dir(tmp_path, "first", b"weights-1")
    worse = model_dir(tmp_path, "worse", b"weights-2")
    better = model_dir(tmp_path, "better", b"weights-3")

    # 1. no champion: the first model beats SFT and becomes champion
    result = apply_gate(model_results(sft=0.40, grpo=0.60), first, config)
    assert (result.decision, result.reference, result.registered_version) == (
        Decision.PROMOTE,
        "sft",
        "1",
    )
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1"], "1")

    # 2. the same model again: idempotent, no new version, alias unchanged
    again = apply_gate(model_results(sft=0.40, grpo=0.60), first, config)
    assert again.decision is Decision.UNCHANGED
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1"], "1")

    # 3. a worse model (0.55 < 0.60 stored on the champion): not registered, alias unchanged
    kept = apply_gate(model_results(sft=0.40, grpo=0.55), worse, config)
    assert (kept.decision, kept.reference, kept.reference_value) == (
        Decision.KEEP,
        "champion v1",
        0.6,
    )
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1"], "1")

    # 4. a better one by more than the margin: new version, alias moves
    moved = apply_gate(model_results(sft=0.40, grpo=0.75), better, config)
    assert (moved.decision, moved.registered_version) == (Decision.PROMOTE, "2")
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1", "2"], "2")

    # 5. re-run on it: unchanged
    assert apply_gate(model_results(grpo=0.75), better, config).decision is Decision.UNCHANGED
    assert _versions("lifecycle") == ["1", "2"]

    # 6. an earlier version that wins again is reused (found by its hash), not re-uploaded
    back = apply_gate(model_results(grpo=0.90), first, config)
    assert (back.decision, back.registered_version) == (Decision.PROMOTE, "1")
    assert (_versions("lifecycle"), _alias("lifecycle")) == (["1", "2"], "1")
    from mlflow import MlflowClient

    assert MlflowClient().get_model_version("lifecycle", "1").tags[f"lingo.eval.{METRIC}"] == "0.9"
    apply_gate(model_results(grpo=0.95), better, config)  # back to "better" for the checks below

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

    first = {"registered_model": "e2e", "baseline": "none-in-results"}  # nothing to beat
    assert decide(gate, first, "gate2") == "promote"
    version = decide(register, first, "register")
    assert version == "1"
    assert _alias("e2e") == "1"
    assert "**promote**" in (out / "register").read_text()
