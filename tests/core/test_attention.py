"""The attention kernel is decided once (``core.attention``): the model loaders ask
transformers for it and the capacity planner counts it (tests/trainer/test_capacity_check.py)."""

import torch
from transformers import AutoModelForCausalLM

from core.attention import HF_ATTN_IMPLEMENTATION, training_attention
from core.modeling import load_causal_lm
from plan import trainer_spec


def test_the_hf_trainer_runs_eager_attention_whatever_the_gpu_and_megatron_the_fused_one():
    for backend in ("torch", "deepspeed"):
        for fused in (True, False):
            hf_module = trainer_spec(backend).trains_hf_module
            assert training_attention(hf_module, fused) == HF_ATTN_IMPLEMENTATION == "eager"
    megatron = trainer_spec("megatron").trains_hf_module
    assert training_attention(megatron, fused_sinks=True) == "flash"
    assert training_attention(megatron, fused_sinks=False) == "eager"


def test_the_loader_asks_for_the_kernel_the_planner_counts_and_it_is_transformers_own_pick(
    tiny_model_dir,
):
    """A GPT-OSS loaded by the trainer's loader runs ``HF_ATTN_IMPLEMENTATION``; loaded with
    no ``attn_implementation`` at all, transformers picks the same (it tries ``sdpa``, which
    GPT-OSS does not support, and falls back to ``eager``), so a run that left it unset (on
    an H200 too) ran eager attention: the kernel is named, not a change of numerics."""
    ours = load_causal_lm(tiny_model_dir, torch.float32)
    assert ours.config._attn_implementation == HF_ATTN_IMPLEMENTATION
    default = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert default.config._attn_implementation == HF_ATTN_IMPLEMENTATION
    assert not type(default)._supports_sdpa  # why: no SDPA kernel takes the sinks
