"""The rollout engines built from the registry keyed by ``rollout.engine``
(``trainer.grpo.engines``), on the tiny model with a real torch backend; the engine protocol's
``submit``/``collect`` and ``sleep`` on the in-process engines."""

from __future__ import annotations

import pytest
import torch
from tests_helpers_trainer import small_grpo_config

from core.modeling import load_tokenizer
from plan import ENGINE_SPECS
from trainer.backends import BackendRequest, DataParallel, build_backend
from trainer.distributed import DistInfo
from trainer.grpo import engines
from trainer.grpo.config import GRPOConfig, RolloutConfig
from trainer.grpo.rollout import HFRolloutEngine
from trainer.placement import run_placement

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_every_engine_name_of_the_config_has_builders():
    """The config accepts the engines ``plan.ENGINE_SPECS`` holds; each has its builders."""
    assert sorted(engines.ENGINES) == sorted(ENGINE_SPECS)
    for name in ENGINE_SPECS:
        assert RolloutConfig(engine=name).engine == name


def test_an_unknown_engine_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="rollout.engine='sglang'.*valid names: hf, vllm"):
        engines.engine_builders("sglang")


@pytest.fixture
def colocated(tiny_model_dir):
    cfg = GRPOConfig(**small_grpo_config())
    tokenizer = load_tokenizer(tiny_model_dir)
    backend, policy = build_backend(
        BackendRequest(tiny_model_dir, cfg.optim, torch.float32, ONE, 4, 2, 1)
    )
    site = engines.EngineSite(cfg, tiny_model_dir, tokenizer, run_placement(cfg, ONE), ONE)
    return site, backend, policy


def test_the_colocated_hf_engine_samples_with_the_trained_module(colocated):
    from trainer.grpo.weight_sync import sync_engine

    site, backend, policy = colocated
    engine = engines.colocated_engine(site, policy, backend)
    assert isinstance(engine, HFRolloutEngine)
    assert engine.model is backend.unwrapped() and not engine.lockstep
    # nothing to sync: the engine is the policy
    assert sync_engine(engine, backend, None, None, 0, ONE, 1) is None
    assert engines.engine_ranks(site, backend.data_parallel) == (0,)


def test_a_rollout_only_hf_engine_loads_its_own_frozen_copy(colocated):
    site, _, policy = colocated
    engine = engines.rollout_only_engine(site)
    assert engine.model is not policy
    assert not any(p.requires_grad for p in engine.model.parameters())
    for mine, theirs in zip(engine.model.parameters(), policy.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_colocated_vllm_engine_generates_for_all_its_workers(monkeypatch):
    """Under torchrun (2 nodes × 8, TP 4 engines), rank 13 generates the prompts of the
    ranks of its engine; an HF engine only its own; dedicated engines every rank's."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    config = {
        "rollout": {"engine": "vllm", "tensor_parallel_size": 4, "n_samples": 8},
        "prompts_per_step": 16,
        "mini_batch_size": 128,
        "micro_batch_size": 1,
        "nproc": 16,
        "optim": {"backend": "deepspeed"},
    }
    cfg = GRPOConfig(**config)
    info = DistInfo(13, 16, 5, torch.device("cpu"))
    dp = DataParallel(13, 16, torch.device("cpu"))
    site = engines.EngineSite(cfg, "model", None, run_placement(cfg, info), info)
    assert engines.engine_ranks(site, dp) == (12, 13, 14, 15)
    hf = GRPOConfig(**{**config, "rollout": {"engine": "hf", "n_samples": 8}})
    site = engines.EngineSite(hf, "model", None, run_placement(hf, info), info)
    assert engines.engine_ranks(site, dp) == (13,)
    dedicated = GRPOConfig(
        **{**config, "rollout": {**config["rollout"], "colocate": False, "num_engines": 2}}
    )
    wide = DistInfo(0, 24, 0, torch.device("cpu"))
    site = engines.EngineSite(dedicated, "model", None, run_placement(dedicated, wide), wide)
    assert engines.engine_ranks(site, DataParallel(0, 16, torch.device("cpu"))) == tuple(range(16))


def test_in_process_engines_take_one_request_at_a_time_and_sleep_as_a_no_op(colocated):
    site, backend, policy = colocated
    engine = engines.colocated_engine(site, policy, backend)
    engine.sleep()  # nothing to free: the next request runs as before
    with pytest.raises(RuntimeError, match="nothing submitted"):
        engine.collect()
    prompt = site.tokenizer("Hallo")["input_ids"]
    engine.submit([prompt], [[1, 2]])
    with pytest.raises(RuntimeError, match="already submitted"):
        engine.submit([prompt], [[3, 4]])
    collected = engine.collect()
    assert engine.last_busy_s > 0 and engine.last_idle_s is None
    assert collected == engine.generate([prompt], [[1, 2]])  # the seeds make the draws
    assert [r.prompt_index for r in collected] == [0, 0]
