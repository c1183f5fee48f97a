"""The weight-sync check and the vLLM weight stream, without vLLM (the engine itself runs in
tests/vllm_engines under ``make test-vllm``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.vllm_scheduling import vllm_scheduling_kwargs
from trainer.backends import OptimConfig, make_backend
from trainer.distributed import DistInfo
from trainer.grpo import recipe
from trainer.grpo.config import RolloutConfig
from trainer.grpo.rollout import HFRolloutEngine, VLLMWeights, vllm_engine_kwargs
from trainer.grpo.sync_check import (
    WeightSyncError,
    check_sync,
    max_abs_diff,
    sync_probe,
    sync_tolerance,
)

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_probe_tolerance_and_difference_rules():
    assert sync_probe([[1, 2, 3, 4, 5]], 2) == recipe.SyncProbe([1, 2, 3], [4, 5])
    assert sync_probe([[1, 2]], 32) == recipe.SyncProbe([1], [2])  # at most all but one
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sync_probe([[7]], 4)
    assert sync_tolerance(None, torch.float32) == 1e-3
    assert sync_tolerance(None, torch.bfloat16) == sync_tolerance(None, torch.float16) == 0.1
    assert sync_tolerance(0.3, torch.float32) == 0.3
    assert max_abs_diff([-1.0, -2.0], [-1.5, -2.25]) == 0.5
    assert max_abs_diff([-1.0], [-1.0, -2.0]) == math.inf  # a lost token is a failure
    assert max_abs_diff([float("nan")], [-1.0]) == math.inf
    assert check_sync(1e-4, 1e-3, 5, "E") == 1e-4
    with pytest.raises(WeightSyncError, match=r"step 5, the E rollout engine.*0\.5 nats"):
        check_sync(0.5, 1e-3, 5, "E")


def test_vllm_weights_split_experts_and_set_sinks_aside(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = dict(model.named_parameters())
    weights = VLLMWeights(((n, p.detach()) for n, p in params.items()), tp_rank=1, tp_size=2)
    streamed = dict(weights.checkpoint_format())
    experts = params["model.layers.0.mlp.experts.gate_up_proj"]
    for e in range(experts.shape[0]):
        assert torch.equal(streamed[f"model.layers.0.mlp.experts.{e}.w13_weight"], experts[e])
    down_bias = params["model.layers.1.mlp.experts.down_proj_bias"]
    assert torch.equal(streamed["model.layers.1.mlp.experts.3.w2_bias"], down_bias[3])
    assert not [n for n in streamed if n.endswith(("gate_up_proj", "down_proj", "sinks"))]
    assert torch.equal(streamed["lm_head.weight"], params["lm_head.weight"])
    sinks = dict(weights.kernel_format)
    assert set(sinks) == {f"model.layers.{i}.attn.sinks" for i in range(2)}
    heads = params["model.layers.0.self_attn.sinks"]
    assert torch.equal(sinks["model.layers.0.attn.sinks"], heads[heads.shape[0] // 2 :])
    assert weights.count == len(params)


def test_vllm_weights_draw_one_tensor_at_a_time():
    drawn = []

    def producer():
        for i in range(3):
            drawn.append(i)
            yield f"model.layers.{i}.mlp.router.weight", torch.zeros(2)

    stream = VLLMWeights(producer()).checkpoint_format()
    assert drawn == []
    next(stream)
    assert drawn == [0]  # nothing is gathered ahead of the consumer


def test_vllm_kwargs_never_split_prompts_on_cpu():
    assert vllm_scheduling_kwargs(None, 1280, cpu=True) == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 1280,
    }
    assert vllm_scheduling_kwargs(8192, 1280, cpu=True)["max_num_batched_tokens"] == 8192
    assert vllm_scheduling_kwargs(None, 1280, cpu=False) == {}
    assert vllm_scheduling_kwargs(2048, 1280, cpu=False) == {"max_num_batched_tokens": 2048}
    cfg = RolloutConfig(engine="vllm", max_prompt_tokens=1024, max_new_tokens=256)
    kwargs = vllm_engine_kwargs("/m", cfg, None, 1, 0, dtype="float32", cpu=True)
    assert kwargs["max_model_len"] == 1280 and kwargs["dtype"] == "float32"
    assert kwargs["enable_chunked_prefill"] is False and kwargs["enable_sleep_mode"] is False


def test_a_one_process_vllm_engine_refuses_tensor_parallel():
    from trainer.grpo.rollout import VLLMRolloutEngine

    with pytest.raises(ValueError, match="torchrun with tensor_parallel_size processes"):
        VLLMRolloutEngine("/m", None, RolloutConfig(engine="vllm", tensor_parallel_size=2))


@pytest.fixture
def policy_and_copy(tiny_model_dir):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = make_backend(policy, OptimConfig(learning_rate=1e-2), 4, ONE, 2, 1)
    engine = HFRolloutEngine(
        copy.deepcopy(policy).requires_grad_(False), tokenizer, RolloutConfig()
    )
    probe = sync_probe([tokenizer("Quelle est la capitale de la France ?")["input_ids"]], 8)
    return backend, engine, probe, tokenizer


def test_sync_check_passes_a_faithful_sync(policy_and_copy):
    backend, engine, probe, tokenizer = policy_and_copy
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        for p in backend.module.parameters():
            p.add_(0.05)
    diff = recipe._sync(engine, backend, probe, 1e-3, pad, ONE, 1)
    assert diff is not None and diff < 1e-5


def test_sync_check_stops_a_sync_that_leaves_the_experts_stale(policy_and_copy):
    backend, engine, probe, tokenizer = policy_and_copy
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        for p in backend.module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    full = backend.hf_weights
    backend.hf_weights = lambda: ((n, t) for n, t in full() if ".experts." not in n)
    with pytest.raises(WeightSyncError, match="step 3"):
        recipe._sync(engine, backend, probe, 1e-3, pad, ONE, 3)


def test_no_check_when_the_engine_is_the_policy(policy_and_copy):
    backend, _, probe, tokenizer = policy_and_copy
    shared = HFRolloutEngine(backend.unwrapped(), tokenizer, RolloutConfig())
    assert recipe._sync(shared, backend, probe, 1e-3, tokenizer.pad_token_id, ONE, 0) is None
