"""The vLLM rollout engine on vLLM's CPU build: samples, weight sync, the sync check, GRPO.

Skipped where vLLM is missing; ``make test-vllm`` runs them (tools/vllm_env.sh).
"""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch
from tests_helpers_trainer import grpo_cli_args, grpo_step_lines, small_grpo_config, subprocess_env

from core.seeds import group_seeds
from trainer.grpo.config import RolloutConfig
from trainer.grpo.rollout import VLLMRolloutEngine, VLLMWeights
from trainer.grpo.sync_check import WeightSyncError, check_sync, sync_tolerance


@pytest.fixture(scope="module")
def engine(vllm_model_dir, policy, rollout_settings):
    _, tokenizer = policy
    engine = VLLMRolloutEngine(
        str(vllm_model_dir), tokenizer, RolloutConfig(**rollout_settings), seed=0, dtype="float32"
    )
    yield engine
    del engine.llm
    gc.collect()


def test_engine_scores_like_the_policy_it_loaded(engine, gap):
    assert gap(engine) < 1e-4


def test_each_response_has_its_own_random_stream(engine, policy):
    _, tokenizer = policy
    prompt = tokenizer("<|start|>user<|message|>Wie spät ist es?<|end|><|start|>assistant")[
        "input_ids"
    ]
    seeds = group_seeds(0, 0, [0, 1], 4)
    out = engine.generate([prompt, prompt], seeds)
    assert [r.prompt_index for r in out] == [0] * 4 + [1] * 4
    # the same prompt in two slots: two different groups, not one group drawn twice
    assert [r.response_ids for r in out[:4]] != [r.response_ids for r in out[4:]]
    firsts = {tuple(r.response_ids[:3]) for r in out}
    assert len(firsts) > 2
    # a response depends on its own seed only: alone or in a batch, the same tokens
    alone = engine.generate([prompt], [seeds[1]])
    assert [r.response_ids for r in alone] == [r.response_ids for r in out[4:]]


def test_sync_takes_every_weight_group_including_experts_and_sinks(engine, policy, gap, perturb):
    model, _ = policy
    perturb(model)  # every group: embeddings … experts, sinks
    assert gap(engine) > 0.05  # the engine still has the old weights
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())
    assert gap(engine) < 1e-4
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())  # twice: same
    assert gap(engine) < 1e-4


def test_sinks_alone_are_synced(engine, policy, gap):
    model, _ = policy
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.add_(1.0)
    assert gap(engine) > 1e-3
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())
    assert gap(engine) < 1e-4


def test_the_check_catches_a_sync_that_leaves_experts_stale(engine, policy, gap):
    """vLLM's reload of GPT-OSS's stacked expert tensors (its loader's own format) copies them
    in without counting them, then puts the old experts back: no error, a wrong model."""
    model, _ = policy
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.add_(torch.randn_like(param) * 0.05)
    stacked = VLLMWeights((n, p.detach()) for n, p in model.named_parameters())
    engine.llm.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": iter(stacked.named_tensors), "is_checkpoint_format": True},
    )
    engine.llm.reset_prefix_cache()
    diff = gap(engine)
    with pytest.raises(WeightSyncError, match="did not take the weights"):
        check_sync(diff, sync_tolerance(None, torch.float32), 3, "VLLMRolloutEngine")
    engine.sync_weights((n, p.detach()) for n, p in model.named_parameters())
    assert gap(engine) < 1e-4


def _grpo(tmp_path, model_dir, data, rollout: dict, *program: str) -> subprocess.CompletedProcess:
    """``python -m trainer.grpo`` with vLLM rollouts, 2 steps, in its own process (as the GRPO
    step runs it; vLLM's engine lives in that process); the run is named ``grpo``."""
    cfg = small_grpo_config(
        max_steps=2, checkpoint_every=0, rollout={"engine": "vllm", "n_samples": 4, **rollout}
    )
    args = grpo_cli_args(tmp_path, "grpo", cfg, model_dir, data)
    return subprocess.run(
        [sys.executable, *(program or ("-m", "trainer.grpo")), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(),
    )


def test_grpo_trains_with_vllm_rollouts_and_checks_every_sync(
    tmp_path, vllm_model_dir, prepared_data, rollout_settings
):
    done = _grpo(tmp_path, vllm_model_dir, prepared_data, rollout_settings)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = grpo_step_lines(tmp_path, "grpo")
    assert [m["step"] for m in lines] == [1, 2]
    assert all(0 <= m["sync_logprob_max_diff"] < 1e-3 for m in lines)
    assert (tmp_path / "grpo" / "model" / "config.json").exists()


STACKED_SYNC = """
import runpy, sys
from trainer.grpo.rollout import VLLMWeights
# the sync streams GPT-OSS's stacked expert tensors: vLLM's reload keeps its old experts
VLLMWeights.checkpoint_format = lambda self: iter(self.named_tensors)
sys.argv[0] = "trainer.grpo"
runpy.run_module("trainer.grpo", run_name="__main__")
"""


def test_grpo_stops_when_the_engine_does_not_take_the_weights(
    tmp_path, vllm_model_dir, prepared_data, rollout_settings
):
    done = _grpo(tmp_path, vllm_model_dir, prepared_data, rollout_settings, "-c", STACKED_SYNC)
    assert done.returncode != 0
    assert "WeightSyncError" in done.stderr and "did not take the weights" in done.stderr
    assert "weight sync of step 0" in done.stderr  # at start, before any update
    assert not grpo_step_lines(tmp_path, "grpo")  # no step was recorded as trained
