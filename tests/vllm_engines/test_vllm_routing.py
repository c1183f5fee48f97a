"""Routing replay with vLLM: ``enable_return_routed_experts`` gives every rollout the experts
the engine routed each token to, and the training forward replays them.

vLLM's CPU build cannot (``make test-vllm`` checks that it says so); the ``gpu`` test runs the
path on a GPU: vLLM in bf16 beside an fp32 policy, where kernels differ: the routing comes back
for every token the engine ran, agrees mostly with the policy's own, and replaying it lowers
the mismatch.
"""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch

from bench.routing_replay import sampled_batch, update_stats
from trainer.grpo import update
from trainer.grpo.config import RolloutConfig
from trainer.grpo.prompts import Prompt
from trainer.grpo.routing import RoutingRecorder, moe_routers
from trainer.grpo.vllm_rollout import VLLMRolloutEngine

QUESTIONS = [
    "<|start|>user<|message|>Quelle est la capitale de la France ?<|end|><|start|>assistant",
    "<|start|>user<|message|>Wie spät ist es?<|end|><|start|>assistant",
    "<|start|>user<|message|>¿Dónde está la estación?<|end|><|start|>assistant",
    "<|start|>user<|message|>Che tempo fa oggi?<|end|><|start|>assistant",
]


def _batch(engine, tokenizer) -> update.Batch:
    prompts = [Prompt(tokenizer(q)["input_ids"], "fr", q) for q in QUESTIONS]
    return sampled_batch(engine, prompts, 4)


def _rollout_kl(model, batch, replay: str) -> float:
    return update_stats(model, batch, replay)["rollout_kl"]


def _own_routing(model, ids: list[int]):
    recorder = RoutingRecorder(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:-1]], device=next(model.parameters()).device))
        return recorder.take().numpy()
    finally:
        recorder.close()


def test_vllm_s_cpu_build_cannot_return_routed_experts_and_says_so(
    vllm_model_dir, policy, rollout_settings
):
    """vLLM 0.32 returns routed experts only from Model Runner V2, which needs Triton: its CPU
    build refuses ``enable_return_routed_experts`` ("AuxOutput Connector requires Model Runner
    V2"). The engine says so before vLLM starts; the ``gpu`` test below runs the path."""
    _, tokenizer = policy
    with pytest.raises(ValueError, match="Model Runner V2, and that needs Triton"):
        VLLMRolloutEngine(
            str(vllm_model_dir),
            tokenizer,
            RolloutConfig(**rollout_settings),
            dtype="float32",
            record_routing=True,
        )
    from vllm import LLM

    with pytest.raises(ValueError, match="AuxOutput Connector requires Model Runner V2"):
        LLM(model=str(vllm_model_dir), dtype="float32", enable_return_routed_experts=True)


@pytest.mark.gpu
def test_on_a_gpu_replaying_vllm_s_bf16_routing_lowers_the_mismatch(vllm_model_dir, policy):
    """vLLM on the GPU in bf16 (its fused MoE and attention kernels), the policy in fp32: the
    engine routes some tokens otherwise; replaying its choices lowers ``rollout_kl``. The GPU
    check runs the same (``bench/gpu_checks.py``, ``routing-replay``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, tokenizer = policy
    engine = VLLMRolloutEngine(
        str(vllm_model_dir),
        tokenizer,
        RolloutConfig(max_new_tokens=64, gpu_memory_utilization=0.3),
        seed=0,
        dtype="bfloat16",
        record_routing=True,
    )
    try:
        batch = _batch(engine, tokenizer)
    finally:
        del engine.llm
        gc.collect()
    gpu_model = copy.deepcopy(model).to("cuda")
    layers, k = len(moe_routers(model)), model.config.num_experts_per_tok
    agree = total = 0
    for rollout in batch.rollouts:
        ids = batch.prompts[rollout.prompt_index].ids + rollout.response_ids
        record = rollout.routed_experts
        assert record is not None and record.shape == (len(ids) - 1, layers, k)
        own = _own_routing(gpu_model, ids)
        agree += int((np.sort(record, -1) == np.sort(own, -1)).all(-1).sum())
        total += record.shape[0] * layers
    assert agree / total > 0.8  # bf16 kernels flip near-ties, not most choices
    replayed = _rollout_kl(gpu_model, batch, "rollout")
    plain = _rollout_kl(gpu_model, batch, "off")
    assert replayed < plain
