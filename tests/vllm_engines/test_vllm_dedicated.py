"""Dedicated vLLM engines on vLLM's CPU build: the engine in processes of its own, the weights
sent through vLLM's weight-transfer API (trainer/grpo/vllm_dedicated.py, vllm_transfer.py),
and a torchrun GRPO job of one trainer and one rollout process.

Skipped where vLLM is missing; ``make test-vllm`` runs them (tools/vllm_env.sh).
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from tests_helpers_trainer import grpo_cli_args, grpo_step_lines, small_grpo_config, subprocess_env

from cluster.torchrun import torchrun_command
from trainer.grpo.config import RolloutConfig


@pytest.fixture(scope="module")
def engine(vllm_model_dir, policy, rollout_settings):
    from trainer.grpo.vllm_dedicated import DedicatedVLLMEngine

    _, tokenizer = policy
    engine = DedicatedVLLMEngine(
        str(vllm_model_dir),
        tokenizer,
        RolloutConfig(**rollout_settings),
        dtype="float32",
        bucket_bytes=16 << 10,  # many buckets: the tiny model is ~1 MB
    )
    yield engine
    engine.close()


def test_the_engine_runs_in_processes_of_its_own(engine):
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert engine.llm.llm_engine.engine_core.__class__.__name__ == "SyncMPClient"


def test_sent_weights_take_in_every_group_including_experts_and_sinks(engine, policy, gap, perturb):
    model, _ = policy
    assert gap(engine) < 1e-4
    perturb(model)  # every group: embeddings … experts, sinks
    assert gap(engine) > 0.05  # the engine still has the old weights
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())
    assert gap(engine) < 1e-4
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.add_(1.0)
    assert gap(engine) > 1e-3
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())  # twice: fine
    assert gap(engine) < 1e-4


def test_a_bucket_the_engine_cannot_load_raises_naming_it(engine):
    """Last in the module: a failed load leaves the engine mid-update."""
    bad = [("model.embed_tokens.weight", torch.zeros(3))]  # the wrong shape
    with pytest.raises(RuntimeError, match="bucket of 'model.embed_tokens.weight'"):
        engine.sync_weights(iter(bad))


def _grpo(tmp_path, model_dir, data, name: str, rollout: dict, nproc: int):
    cfg = small_grpo_config(
        max_steps=2, checkpoint_every=0, rollout={"engine": "vllm", "n_samples": 4, **rollout}
    )
    done = subprocess.run(
        torchrun_command(
            "trainer.grpo", grpo_cli_args(tmp_path, name, cfg, model_dir, data), nproc
        ),
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr  # every sync, silently (the workers log here too)
    assert "Failed to load weights" not in output and "were not loaded" not in output
    return grpo_step_lines(tmp_path, name)


def test_one_trainer_and_one_vllm_engine_process_train_like_one_process(
    tmp_path, vllm_model_dir, prepared_data, rollout_settings, one_process_vllm_grpo
):
    dedicated = {**rollout_settings, "colocate": False, "num_engines": 1, "sync_bucket_mb": 1}
    ours = _grpo(tmp_path, vllm_model_dir, prepared_data, "split", dedicated, 2)
    assert [m["step"] for m in ours] == [1, 2]
    assert all(0 <= m["sync_logprob_max_diff"] < 1e-4 for m in ours)
    assert (tmp_path / "split" / "model" / "config.json").exists()
    # the same engine seed and per-response seeds as one process with its engine in-process
    # (the run test_vllm_rollout.py checks, made once for both)
    alone, done = one_process_vllm_grpo
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "Failed to load weights" not in output and "were not loaded" not in output
    theirs = grpo_step_lines(alone, "grpo")
    for a, b in zip(ours, theirs, strict=True):
        assert a["mean_reward"] == b["mean_reward"]
        assert a["response_length_mean"] == b["response_length_mean"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
