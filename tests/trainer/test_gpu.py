"""The same SFT and GRPO code on a GPU (bf16, CUDA), and the vLLM rollout engine.

Marked ``gpu``: deselected by default and skipped where CUDA is missing; run on a GPU machine
with ``pytest -m gpu``.
"""

import pytest
import torch
from tests_helpers_trainer import recipe_paths, small_grpo_config

from core.seeds import group_seeds
from trainer.grpo.config import GRPOConfig, RolloutConfig
from trainer.grpo.recipe import run_grpo
from trainer.metrics import read_metrics
from trainer.sft.config import SFTConfig
from trainer.sft.recipe import run_sft
from trainer.tiny_model import TinyModelConfig, build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_sft_on_gpu_in_bf16(tmp_path, tiny_model_dir, prepared_data):
    cfg = SFTConfig(
        max_steps=3,
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        dtype="bfloat16",
        device="cuda",
        merge_check_prompts=2,
    )
    result = run_sft(cfg, *recipe_paths(tiny_model_dir, prepared_data, tmp_path))
    assert result.merge["dtype"] == "bfloat16"
    assert len([m for m in read_metrics(result.metrics_file) if "loss" in m]) == 3


def test_grpo_on_gpu_with_hf_rollouts(tmp_path, tiny_model_dir, prepared_data):
    cfg = GRPOConfig.model_validate(
        small_grpo_config(
            max_steps=2, eval_every=2, checkpoint_every=0, dtype="bfloat16", device="cuda"
        )
    )
    result = run_grpo(cfg, *recipe_paths(tiny_model_dir, prepared_data, tmp_path))
    assert [m["step"] for m in read_metrics(result.metrics_file) if "loss" in m] == [1, 2]


def _vllm_engine(tmp_path, sleep_mode: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.grpo.vllm_rollout import VLLMRolloutEngine

    # vLLM's attention kernels want head_dim >= 64
    model_dir = build_tiny_model(
        tmp_path / "m", TinyModelConfig(head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMRolloutEngine(
        str(model_dir),
        tokenizer,
        RolloutConfig(max_new_tokens=8, max_prompt_tokens=512, gpu_memory_utilization=0.2),
        dtype="bfloat16",
        sleep_mode=sleep_mode,
    )
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    return engine, policy, tokenizer


def test_vllm_engine_samples_groups_and_takes_new_weights(tmp_path):
    """On the GPU's kernels (vLLM's fp32-softmax attention and fused MoE against HF's eager
    bf16): the sync check learns their noise floor from the engine as loaded, a perturbed
    policy is past its bounds, and after a sync every weight group (experts, sinks through
    their own loader on vLLM 0.33) is back within them, with no warning from vLLM's reload."""
    pytest.importorskip("vllm")
    import logging

    from trainer.grpo.rollout import HFRolloutEngine
    from trainer.grpo.sync_check import SyncCheck, WeightSyncError, sync_gap

    engine, policy, tokenizer = _vllm_engine(tmp_path, sleep_mode=False)
    prompt = tokenizer("<|start|>user<|message|>Hallo<|end|><|start|>assistant")["input_ids"]
    out = engine.generate([prompt, prompt], group_seeds(0, 0, [0, 1], 3))
    # the same prompt in two slots: two groups, not one drawn twice
    assert [r.response_ids for r in out[:3]] != [r.response_ids for r in out[3:]]
    assert [r.prompt_index for r in out] == [0, 0, 0, 1, 1, 1]

    def gap():
        mine = HFRolloutEngine(policy, tokenizer, RolloutConfig())
        return sync_gap(
            engine.token_log_probs(prompt[:1], prompt[1:]),
            mine.token_log_probs(prompt[:1], prompt[1:]),
        )

    check = SyncCheck(torch.bfloat16)
    check.learn_floor(gap(), "VLLMRolloutEngine")  # the engine loaded the policy's weights
    with torch.no_grad():
        for _, param in policy.named_parameters():
            param.add_(torch.randn_like(param) * 0.05)
    with pytest.raises(WeightSyncError, match="did not take the weights"):
        check.check(gap(), 1, "VLLMRolloutEngine")
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logging.getLogger("vllm").addHandler(handler)
    try:
        engine.sync_weights((n, p.detach()) for n, p in policy.named_parameters())
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    check.check(gap(), 1, "VLLMRolloutEngine")  # every weight group, on the GPU's kernels
    assert [r.getMessage() for r in warnings] == []


def test_the_sync_check_learns_the_gpu_kernels_noise_and_catches_stale_experts(tiny_model_dir):
    """An HF engine in bf16 beside an fp32 policy on the GPU (bf16 matmuls and softmax vs
    fp32/TF32): the floor is learned at step 0, faithful syncs pass, a sync that leaves the
    experts stale stops the run (bench/gpu_checks.py ``sync-check`` runs the same)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.backends import OptimConfig, make_backend
    from trainer.distributed import DistInfo
    from trainer.grpo.rollout import HFRolloutEngine
    from trainer.grpo.sync_check import SyncCheck, WeightSyncError, sync_probe
    from trainer.grpo.weight_sync import sync_engine

    device = torch.device("cuda")
    info = DistInfo(0, 1, 0, device)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(device)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = make_backend(policy, OptimConfig(learning_rate=1e-2), 4, info, 2, 1)
    engine = HFRolloutEngine(
        copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False), tokenizer, RolloutConfig()
    )
    text = "<|start|>user<|message|>Quelle est la capitale de la France ? Réponds en français."
    probe = sync_probe([tokenizer(text)["input_ids"]], 64)
    check, pad = SyncCheck(torch.float32), tokenizer.pad_token_id
    sync_engine(engine, backend, probe, check, pad, info, 0)
    assert check.floor.max > 0  # kernel noise, learned
    for step in (1, 2):
        with torch.no_grad():
            for param in backend.module.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        sync_engine(engine, backend, probe, check, pad, info, step)
    with torch.no_grad():
        for name, param in backend.module.named_parameters():
            if ".experts." in name:
                param.add_(torch.randn_like(param) * 0.05)
    full = backend.hf_weights
    backend.hf_weights = lambda: ((n, t) for n, t in full() if ".experts." not in n)
    with pytest.raises(WeightSyncError, match="did not take the weights"):
        sync_engine(engine, backend, probe, check, pad, info, 3)


def test_vllm_sleep_frees_gpu_memory_and_wakes_with_its_weights(tmp_path):
    pytest.importorskip("vllm")
    engine, policy, tokenizer = _vllm_engine(tmp_path, sleep_mode=True)
    prompt = tokenizer("<|start|>user<|message|>Hola<|end|><|start|>assistant")["input_ids"]
    before = engine.token_log_probs(prompt[:-4], prompt[-4:])
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    # level 1: weights to host, KV cache dropped (0.2 of the GPU): most of it comes back
    assert free_asleep - free_awake > 0.1 * torch.cuda.get_device_properties(0).total_memory
    assert engine.token_log_probs(prompt[:-4], prompt[-4:]) == before  # wakes, same weights
