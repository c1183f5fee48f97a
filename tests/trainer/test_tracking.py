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
