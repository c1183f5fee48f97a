"""Memory of one vLLM rollout GPU: weights by TP, runtime reserve, and the KV cache it leaves.

vLLM claims ``gpu_memory_utilization × GPU memory`` per GPU; weights (``/TP``) and a runtime
reserve (CUDA context and graphs, the profile run's activations and sampler logits) come
first, the KV cache gets the rest. A token's KV entry on one GPU is
``2 · kv_heads_on_gpu · head_dim · bytes`` per layer (``kv_heads_on_gpu = ceil(kv/TP)``:
vLLM replicates KV heads when TP exceeds them); sliding-window layers hold at most
``sliding_window`` tokens per sequence (vLLM's hybrid KV-cache manager frees the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capacity.layouts import Layout
from capacity.model_spec import ModelSpec, ParameterCount
from capacity.quantities import GIB, Bounds, Term

# MXFP4: 4-bit values plus one 8-bit (E8M0) scale per 32 values.
MXFP4_BYTES_PER_PARAM = (32 * 4 + 8) / 8 / 32
# vLLM process: CUDA context and CUDA graphs, in GiB.
VLLM_CONTEXT_GIB = Bounds(0.5, 1.0, 2.0)
# Spread of vLLM's profile-run peak around the counted per-token intermediates.
PROFILE_SPREAD = (0.75, 2.0)


def rollout_weight_bytes(counts: ParameterCount, rollout_dtype: str) -> float:
    """Bytes of the whole model's weights as vLLM holds them.

    Args:
        counts: the model's parameter count.
        rollout_dtype: ``bf16``, ``fp32`` or ``mxfp4`` (expert matrices packed, the rest bf16).

    Returns:
        Bytes over all TP shards together.
    """
    if rollout_dtype == "mxfp4":
        other = counts.total - counts.expert_matrices
        return counts.expert_matrices * MXFP4_BYTES_PER_PARAM + 2 * other
    return counts.total * (4 if rollout_dtype == "fp32" else 2)


def kv_bytes_per_token_layer(spec: ModelSpec, layout: Layout) -> float:
    """KV-cache bytes one token takes in one layer on one GPU of an engine."""
    kv_heads = math.ceil(spec.num_kv_heads / layout.vllm_tensor_parallel_size)
    kv_dtype_bytes = 4 if layout.rollout_dtype == "fp32" else 2
    return 2 * kv_heads * spec.head_dim * kv_dtype_bytes


def kv_bytes_per_sequence(spec: ModelSpec, layout: Layout, seq_len: int) -> float:
    """KV-cache bytes one sequence of ``seq_len`` tokens takes on one GPU of an engine."""
    per_layer = kv_bytes_per_token_layer(spec, layout)
    sliding = spec.num_sliding_layers
    window = min(seq_len, spec.sliding_window or seq_len)
    return per_layer * ((spec.num_layers - sliding) * seq_len + sliding * window)


def runtime_reserve(spec: ModelSpec, layout: Layout) -> Bounds:
    """CUDA context and graphs plus the profile run's peak activations on one GPU.

    The profile run pushes ``vllm_max_num_batched_tokens`` tokens through a layer (hidden
    states, q/k/v, routed SwiGLU widths in bf16, ``/TP``) and samples ``vllm_max_num_seqs``
    rows of fp32 logits (with one copy).
    """
    width = 4 * spec.hidden_size + (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    width += spec.experts_per_token * 3 * spec.intermediate_size
    activations = layout.vllm_max_num_batched_tokens * width * 2 / layout.vllm_tensor_parallel_size
    sampler = 2 * layout.vllm_max_num_seqs * spec.vocab_size * 4
    profile = Bounds.spread(activations + sampler, *PROFILE_SPREAD)
    return VLLM_CONTEXT_GIB * GIB + profile


@dataclass(frozen=True)
class KvCapacity:
    """What the KV cache of one engine holds.

    Attributes:
        cache_bytes: KV-cache bytes per GPU (expected).
        sequences: sequences of ``seq_len`` tokens that fit at once per engine.
        seq_len: the longest rollout sequence (prompt + completion).
        wanted: sequences the engine is asked to run at once.
    """

    cache_bytes: float
    sequences: int
    seq_len: int
    wanted: int


def rollout_gpu_terms(
    spec: ModelSpec, counts: ParameterCount, layout: Layout, training_resident: Bounds
) -> tuple[list[Term], KvCapacity]:
    """Terms of one rollout GPU while vLLM generates, and the KV capacity they leave.

    Args:
        spec: the model's shape.
        counts: its parameter count.
        layout: the layout.
        training_resident: what the training process keeps on the GPU meanwhile (hybrid).

    Returns:
        The terms and the KV-cache capacity.
    """
    tp = layout.vllm_tensor_parallel_size
    weights = rollout_weight_bytes(counts, layout.rollout_dtype) / tp
    reserve = runtime_reserve(spec, layout)
    budget = layout.vllm_gpu_memory_utilization * layout.gpu_memory_gib * GIB
    kv = Bounds(
        max(0.0, budget - weights - reserve.high),
        max(0.0, budget - weights - reserve.expected),
        max(0.0, budget - weights - reserve.low),
    )
    terms = [
        Term(
            "rollout_weights",
            f"vLLM weights ({layout.rollout_dtype}, 1/{tp} per GPU)",
            Bounds.exact(weights),
            "raise vllm_tensor_parallel_size, or rollout_dtype=mxfp4",
        ),
        Term("vllm_runtime", "vLLM context, CUDA graphs, profile peak", reserve),
        Term(
            "kv_cache",
            f"KV cache (rest of gpu_memory_utilization={layout.vllm_gpu_memory_utilization})",
            kv,
            "lower vllm_gpu_memory_utilization to leave the training state room"
            if layout.hybrid and not layout.deepspeed_enable_sleep
            else "raise vllm_gpu_memory_utilization or vllm_tensor_parallel_size",
        ),
    ]
    if layout.hybrid:
        terms.append(
            Term(
                "training_resident",
                "training state left on the GPU while vLLM is awake",
                training_resident,
                "deepspeed_enable_sleep=true, or non-hybrid (rollout GPUs of their own)",
            )
        )
    seq_len = layout.sequence_length
    engines = max(1, layout.vllm_num_engines)
    wanted = min(
        layout.vllm_max_num_seqs,
        math.ceil(layout.rollout_batch_size * layout.n_samples_per_prompt / engines),
    )
    sequences = int(kv.expected // kv_bytes_per_sequence(spec, layout, seq_len))
    return terms, KvCapacity(kv.expected, sequences, seq_len, wanted)
