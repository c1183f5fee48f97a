"""Each planner term on a config small enough to compute by hand.

The hand config: V=10, H=4, I=6, L=2 (one sliding layer, window 4, one full), nh=2, kv=1,
d=2, E=3, k=2; 782 parameters (per layer 349, of which experts 264).
"""

from __future__ import annotations

import pytest
from tests_helpers_capacity import HAND_CONFIG

from capacity.activations import (
    activation_bytes,
    layer_bytes_per_token,
    logits_bytes,
    recomputed_layer_bytes,
)
from capacity.host_memory import host_node_terms, node_roles
from capacity.layouts import Layout
from capacity.model_spec import ModelSpec, count_parameters
from capacity.quantities import GIB, ZERO, Bounds, Term, Verdict, advice_for, verdict_for
from capacity.rollout_memory import (
    kv_bytes_per_sequence,
    kv_bytes_per_token_layer,
    rollout_gpu_terms,
    rollout_weight_bytes,
)
from capacity.storage import (
    deepspeed_checkpoint_bytes,
    hf_checkpoint_bytes,
    megatron_checkpoint_bytes,
)
from capacity.training_memory import rank_share, training_rank_terms

HAND = ModelSpec.from_config(HAND_CONFIG)
COUNTS = count_parameters(HAND)


def _layout(**fields: object) -> Layout:
    base: dict[str, object] = {
        "nodes": 2,
        "gpus_per_node": 2,
        "gpu_memory_gib": 1.0,
        "host_memory_gib": 4.0,
        "host_reserved_gib": 0.0,
        "training_gpus": 4,
        "rollout_gpus": 0,
        "micro_train_batch_size": 1,
        "prompt_max_len": 4,
        "generate_max_len": 4,
        "kl": False,
    }
    return Layout(**{**base, **fields})


def test_layer_activations_per_token_bf16_eager() -> None:
    # residual 2·4·2=16; norms 2·(16+16+8)=80; attention 4·2·2·2=32;
    # scores 2·(8+1)·2 + 8·2 = 52; router 2·(8+2)=20; experts 2·((8+42)·2 + 16)=232.
    assert layer_bytes_per_token(HAND, 2, 8, eager=True) == 432


def test_layer_activations_per_token_fp32_flash() -> None:
    # fp32: no upcast copy. residual 32; norms 2·(16+16)=64; attention 64; lse 4·2=8;
    # router 2·(8+4)=24; experts 2·((8+42)·4 + 16)=432.
    assert layer_bytes_per_token(HAND, 4, 8, eager=False) == 624


def test_activations_with_and_without_checkpointing() -> None:
    full = activation_bytes(
        HAND, a=2, tokens=16, seq_len=8, layers=2, eager=True, checkpointing=False
    )
    # 16 tokens · (2 layers · 432 + final norm 40).
    assert full.expected == 16 * (2 * 432 + 40)
    kept = activation_bytes(
        HAND, a=2, tokens=16, seq_len=8, layers=2, eager=True, checkpointing=True
    )
    # Layer inputs 2·4·2 + two eager masks 2·8·2 + final norm 40, per token.
    assert kept.expected == 16 * (16 + 32 + 40)
    assert kept.low < kept.expected < kept.high
    recompute = recomputed_layer_bytes(HAND, a=2, tokens=16, seq_len=8, eager=True)
    # One layer plus the two transient score tensors 2·2·9·2 per token.
    assert recompute.expected == 16 * (432 + 72)


def test_logits_bounds() -> None:
    logits = logits_bytes(HAND, a=2, tokens=16)
    assert (logits.low, logits.expected, logits.high) == (16 * 10 * 6, 16 * 10 * 14, 16 * 10 * 18)
    assert logits_bytes(HAND, a=2, tokens=16, shards=2).expected == 16 * 10 * 14 / 2


@pytest.mark.parametrize(
    ("stage", "weights", "grads", "optimizer"),
    [
        (0, 782, 782, 782),
        (1, 782, 782, 782 / 4),
        (2, 782, 782 / 4, 782 / 4),
        (3, 782 / 4, 782 / 4, 782 / 4),
    ],
)
def test_deepspeed_rank_share_by_zero_stage(
    stage: int, weights: float, grads: float, optimizer: float
) -> None:
    share = rank_share(HAND, COUNTS, _layout(zero_stage=stage))
    assert (share.weights, share.trainable, share.optimizer) == (weights, grads, optimizer)


def test_deepspeed_terms_by_hand() -> None:
    layout = _layout(zero_stage=3, kl=True, dtype="bf16")
    terms = {t.key: t.bytes for t in training_rank_terms(HAND, COUNTS, layout)}
    assert terms["weights"].expected == 2 * 782 / 4
    assert terms["gradients"].expected == 2 * 782 / 4
    assert terms["optimizer"].expected == 16 * 782 / 4
    assert terms["reference"].expected == 2 * 782 / 4
    # ZeRO-3 gathers the largest layer (349 params, bf16), two at a time expected.
    assert terms["zero3_gathered"] == Bounds(698, 1396, 2094)
    offloaded = {
        t.key: t.bytes for t in training_rank_terms(HAND, COUNTS, _layout(adam_offload=True))
    }
    assert "optimizer" not in offloaded
    # Only the reduce bucket stays: reduce_bucket_size, or less when the model is smaller.
    assert offloaded["gradients"].expected == 2 * 782
    small_bucket = _layout(adam_offload=True, reduce_bucket_size=100)
    bucket = next(
        t for t in training_rank_terms(HAND, COUNTS, small_bucket) if t.key == "gradients"
    )
    assert bucket.bytes.expected == 2 * 100


def test_fp32_optimizer_is_adam_moments_only() -> None:
    terms = training_rank_terms(HAND, COUNTS, _layout(zero_stage=0, dtype="fp32", device="cpu"))
    optimizer = next(t for t in terms if t.key == "optimizer")
    assert optimizer.bytes.expected == 8 * 782


def test_megatron_rank_share_by_hand() -> None:
    layout = _layout(
        backend="megatron", training_gpus=3, nodes=1, gpus_per_node=3, expert_parallel=3
    )
    share = rank_share(HAND, COUNTS, layout)
    # Dense per layer 349-264=85, ×2 layers + embedding 40 + lm_head 40 + final norm 4 = 254;
    # experts 2·264/3 = 176.
    assert share.weights == 254 + 176
    # Dense optimizer sharded over DP=3, experts over expert-DP=1.
    assert share.optimizer == pytest.approx(254 / 3 + 176)


def test_rollout_kv_by_hand() -> None:
    layout = _layout(rollout_gpus=2, vllm_tensor_parallel_size=2, hybrid=False, training_gpus=2)
    # kv=1 head cannot split over TP=2: replicated. K and V, d=2, bf16: 2·1·2·2 = 8 B.
    assert kv_bytes_per_token_layer(HAND, layout) == 8
    # 8-token sequence: full layer 8 tokens, sliding layer min(8, window 4) tokens.
    assert kv_bytes_per_sequence(HAND, layout, 8) == 8 * (8 + 4)


def test_rollout_weights_and_kv_budget() -> None:
    assert rollout_weight_bytes(COUNTS, "bf16") == 2 * 782
    assert rollout_weight_bytes(COUNTS, "fp32") == 4 * 782
    # MXFP4 packs the 2·3·(4·12 + 6·4) = 432 expert-matrix params at 4.25 bits.
    assert rollout_weight_bytes(COUNTS, "mxfp4") == 432 * 4.25 / 8 + 2 * (782 - 432)
    layout = _layout(
        rollout_gpus=2, training_gpus=2, gpu_memory_gib=16.0, vllm_gpu_memory_utilization=0.5
    )
    terms, kv = rollout_gpu_terms(HAND, COUNTS, layout, ZERO)
    by_key = {t.key: t.bytes for t in terms}
    budget = 0.5 * 16 * GIB
    assert by_key["kv_cache"].expected == pytest.approx(
        budget - by_key["rollout_weights"].expected - by_key["vllm_runtime"].expected
    )
    assert kv.sequences == int(
        by_key["kv_cache"].expected // kv_bytes_per_sequence(HAND, layout, 8)
    )
    # 128 prompts × 8 samples over 2 engines, capped by vLLM's max_num_seqs.
    assert kv.wanted == 256


def test_node_roles_non_hybrid_and_hybrid() -> None:
    layout = _layout(nodes=3, gpus_per_node=4, training_gpus=6, rollout_gpus=4)
    assert [(r.training_ranks, r.rollout_gpus) for r in node_roles(layout)] == [
        (4, 0),
        (2, 2),
        (0, 2),
    ]
    hybrid = _layout(nodes=2, gpus_per_node=4, training_gpus=8, rollout_gpus=8, hybrid=True)
    assert [(r.training_ranks, r.rollout_gpus) for r in node_roles(hybrid)] == [(4, 4), (4, 4)]
    assert [r.holds_rank0 for r in node_roles(hybrid)] == [True, False]


def test_host_terms_by_hand() -> None:
    layout = _layout(
        adam_offload=True,
        hybrid=True,
        rollout_gpus=4,
        vllm_tensor_parallel_size=2,
        deepspeed_enable_sleep=True,
    )
    node0, node1 = node_roles(layout)
    resident = Bounds.exact(5000.0)
    terms = {t.key: t.bytes for t in host_node_terms(HAND, COUNTS, layout, node0, resident)}
    # 16 B × 782/4 per rank, 2 ranks on the node.
    assert terms["optimizer_offload"].expected == 16 * 782 / 4 * 2
    assert terms["pinned_buffers"].expected == 2 * GIB
    # Two rollout GPUs, each backing up half the bf16 weights.
    assert terms["vllm_sleep_backup"].expected == 2 * (2 * 782 / 2)
    assert terms["hf_save_gather"].expected == 2 * 782
    # Two ranks park 2·5000 B while vLLM is awake; backup and HF save (3128 B) are gone then,
    # so the peak grows only by the excess.
    assert terms["training_sleep"].expected == 2 * 5000 - 3128
    assert terms["processes"].expected == 4 * 3 * GIB
    others = {t.key: t.bytes for t in host_node_terms(HAND, COUNTS, layout, node1, resident)}
    assert "hf_save_gather" not in others
    assert others["training_sleep"].expected == 2 * 5000 - 1564


def test_storage_by_hand() -> None:
    assert deepspeed_checkpoint_bytes(HAND, COUNTS, _layout(zero_stage=3)) == Bounds(
        12 * 782, 12 * 782, 14 * 782
    )
    assert deepspeed_checkpoint_bytes(HAND, COUNTS, _layout(zero_stage=2)).expected == 14 * 782
    megatron = _layout(backend="megatron", training_gpus=4)
    assert megatron_checkpoint_bytes(HAND, COUNTS, megatron).expected == 14 * 782
    assert hf_checkpoint_bytes(COUNTS).expected == 2 * 782


def test_verdicts_and_advice() -> None:
    assert verdict_for(Bounds(1, 2, 3), 10) is Verdict.FITS
    assert verdict_for(Bounds(1, 2, 11), 10) is Verdict.TIGHT
    assert verdict_for(Bounds(1, 9.5, 9.8), 10) is Verdict.TIGHT
    assert verdict_for(Bounds(1, 11, 12), 10) is Verdict.DOES_NOT_FIT
    terms = [
        Term("a", "a", Bounds.exact(1), "small"),
        Term("b", "b", Bounds.exact(5), "big"),
        Term("c", "c", Bounds.exact(3), "big"),
    ]
    assert advice_for(terms, Verdict.DOES_NOT_FIT) == ("big", "small")
    assert advice_for(terms, Verdict.FITS) == ()


def test_bounds_arithmetic_and_order() -> None:
    assert Bounds(1, 2, 3) + Bounds(1, 1, 1) == Bounds(2, 3, 4)
    assert 2 * Bounds(1, 2, 3) == Bounds(2, 4, 6)
    assert Bounds(1, 5, 6).maximum(Bounds(2, 3, 7)) == Bounds(2, 5, 7)
    with pytest.raises(ValueError, match="order"):
        Bounds(3, 2, 1)
