"""SFT and GRPO log their parameters and per-step metrics to a real MLflow server."""

import pytest
from mlflow_server import mlflow_server

from trainer.grpo.config import GRPOConfig
from trainer.grpo.recipe import run_grpo
from trainer.sft.config import SFTConfig
from trainer.sft.recipe import run_sft


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


def test_sft_and_grpo_metrics_reach_mlflow(
    tmp_path, monkeypatch, tracking_uri, tiny_model_dir, prepared_data
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lingo-test")
    train, evals = prepared_data / "train.jsonl", prepared_data / "eval.jsonl"
    run_sft(
        SFTConfig(
            max_steps=2,
            micro_batch_size=2,
            gradient_accumulation_steps=1,
            max_seq_len=512,
            merge_check_prompts=1,
        ),
        tiny_model_dir,
        train,
        evals,
        tmp_path / "sft",
        tmp_path / "sw",
    )
    grpo = GRPOConfig.model_validate(
        {
            "rollout": {"n_samples": 2, "max_new_tokens": 8},
            "prompts_per_step": 2,
            "mini_batch_size": 4,
            "micro_batch_size": 4,
            "max_steps": 2,
            "eval_every": 0,
            "eval_prompts": 2,
            "eval_samples": 1,
        }
    )
    run_grpo(grpo, tmp_path / "sft", train, evals, tmp_path / "policy", tmp_path / "gw")

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("lingo-test")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert {"sft", "grpo"} <= set(runs)
    sft_loss = client.get_metric_history(runs["sft"].info.run_id, "loss")
    assert [m.step for m in sft_loss] == [1, 2]
    assert runs["sft"].data.params["max_steps"] == "2"
    reward = client.get_metric_history(runs["grpo"].info.run_id, "mean_reward")
    assert [m.step for m in reward] == [1, 2]
    assert "loss.png" in [a.path for a in client.list_artifacts(runs["sft"].info.run_id)]


def test_one_parent_run_per_pipeline_run_with_nested_step_runs(monkeypatch, tracking_uri):
    """What the pipeline does across its pods: the first task opens the parent, each step
    nests its run under MLFLOW_PARENT_RUN_ID, the exit handler closes the parent."""
    from mlflow.tracking import MlflowClient

    from core.tracking import (
        PIPELINE_RUN_TAG,
        configure_tracking,
        find_pipeline_run,
        finish_pipeline_run,
        log_metrics,
        mlflow_run,
        start_pipeline_run,
    )

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lingo-pipeline")
    # unset ("" reads as unset), and restored after the test: configure_tracking sets it below
    monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", "")
    parent = start_pipeline_run("kfp-run-1", "lingo-rl-run-1", {"sft.max_steps": 2})
    assert start_pipeline_run("kfp-run-1", "retried task", {}) == parent  # idempotent
    assert find_pipeline_run("kfp-run-1") == parent
    assert find_pipeline_run("kfp-run-2") is None

    configure_tracking(tracking_uri, parent)  # what each step's component does
    for step in ("data-prep", "sft"):
        with mlflow_run(step, {"step": step}) as run:
            log_metrics({"rows": 10, "flag": True}, step=1)
    finish_pipeline_run(parent, "CANCELLED", "cancelled by the user")

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("lingo-pipeline")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"lingo-rl-run-1", "data-prep", "sft"}
    assert runs["lingo-rl-run-1"].data.tags[PIPELINE_RUN_TAG] == "kfp-run-1"
    assert runs["lingo-rl-run-1"].data.params["sft.max_steps"] == "2"
    assert runs["lingo-rl-run-1"].info.status == "KILLED"
    assert runs["lingo-rl-run-1"].data.tags["lingo.error"] == "cancelled by the user"
    for step in ("data-prep", "sft"):
        assert runs[step].data.tags["mlflow.parentRunId"] == parent
        assert runs[step].data.tags["lingo.step"] == step
        assert runs[step].info.status == "FINISHED"
    assert set(runs["sft"].data.metrics) == {"rows"}  # booleans are not metrics
    assert run is not None


def test_tracking_env_passes_settings_but_no_password(monkeypatch):
    from core.tracking import tracking_env

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team.svc:5000")
    monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", "abc")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert tracking_env() == {
        "MLFLOW_TRACKING_URI": "http://mlflow.team.svc:5000",
        "MLFLOW_PARENT_RUN_ID": "abc",
    }
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://user:secret@mlflow.example.com")
    assert "MLFLOW_TRACKING_URI" not in tracking_env()
