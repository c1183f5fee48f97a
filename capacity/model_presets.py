"""Architecture presets the planner knows by name, written as HF ``config.json`` data.

The values are the architecture fields of the published ``config.json`` files of
``openai/gpt-oss-20b`` and ``openai/gpt-oss-120b`` (tokenizer ids, RoPE scaling and the
MXFP4 quantization block are left out: they do not change memory). ``tiny-gpt-oss`` is the
CPU test model described in ``docs/capacity.md``.
"""

from __future__ import annotations

from typing import Any


def _alternating_layer_types(num_layers: int) -> list[str]:
    """Return gpt-oss's layer schedule: sliding-window attention first, then full, repeated."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


GPT_OSS_20B: dict[str, Any] = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": _alternating_layer_types(24),
    "attention_bias": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}

GPT_OSS_120B: dict[str, Any] = {
    **GPT_OSS_20B,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": _alternating_layer_types(36),
}

TINY_GPT_OSS: dict[str, Any] = {
    **GPT_OSS_20B,
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 32,
    "layer_types": _alternating_layer_types(2),
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": GPT_OSS_20B,
    "openai/gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-120b": GPT_OSS_120B,
    "openai/gpt-oss-120b": GPT_OSS_120B,
    "tiny-gpt-oss": TINY_GPT_OSS,
}
