"""Memory of one training rank at its peak (the loss's backward of a micro-batch).

Persistent state by backend (``w`` = training dtype bytes, ``Pt`` = trainable parameters,
``N`` = training ranks):

- DeepSpeed: weights ``w·P`` (ZeRO-3: ``/N``; ``param_offload``: on the host); ZeRO-3 also
  gathers whole layers for compute (one to three layers' worth in flight); gradients
  ``w·Pt`` (ZeRO-2/3: ``/N``; with ``adam_offload`` they stream to the host and only the
  reduce bucket stays); optimizer: fp32 master + Adam m + v + fp32 gradient = 16 B per
  trainable parameter in mixed precision, 8 B (m + v) when training in fp32 (ZeRO-1+: ``/N``;
  ``adam_offload``: on the host).
- Megatron: the rank holds ``L/PP`` layers with dense weights ``/TP`` and experts ``/EP``,
  plus the embedding and/or ``lm_head`` ``/TP``; gradients in the param dtype (fp32 as the
  high bound, ``grad_reduce_in_fp32``); the distributed optimizer's 16 B per parameter is
  sharded over the data-parallel group (``N/(TP·PP)`` dense, ``N/(EP·PP)`` experts).

LoRA (``lora_rank``): the base is frozen (weights only: no gradients, no optimizer states);
the adapter's gradients and optimizer states are as above for ``Pt`` = its parameters; the KL
reference is the base with the adapter switched off (``trainer.backends.torch.reference_copy``),
so it adds nothing.

Gradients persist across micro-batches (gradient accumulation), so they coexist with the
activations, as do the optimizer states and the reference model (when KL is on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capacity.activations import activation_bytes, logits_bytes, recomputed_layer_bytes
from capacity.layouts import Layout
from capacity.model_spec import ModelSpec, ParameterCount, count_lora_parameters
from capacity.quantities import GIB, ZERO, Bounds, Term, format_bytes, format_count

# CUDA context, cuBLAS workspaces and NCCL buffers of one process, in GiB.
CUDA_RUNTIME_GIB = Bounds(0.5, 1.0, 2.0)
# Caching-allocator fragmentation, as a share of everything else on the GPU.
FRAGMENTATION_SHARE = Bounds(0.0, 0.05, 0.15)
# Layers ZeRO-3 holds gathered at once: the one computing, the prefetched one, and in
# backward the full-size gradients of the layer before its reduce-scatter.
ZERO3_GATHERED_LAYERS = Bounds(1.0, 2.0, 3.0)


def optimizer_bytes_per_param(layout: Layout) -> int:
    """Optimizer bytes per trainable parameter: fp32 master + m + v + fp32 grad, or m + v."""
    return 16 if layout.weight_bytes < 4 else 8


def trainable_parameters(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> int:
    """Parameters the optimizer updates: the LoRA adapter, or every weight."""
    if layout.lora_rank:
        return count_lora_parameters(spec, layout.lora_rank, layout.lora_experts)
    return counts.total


@dataclass(frozen=True)
class RankShare:
    """The parameters one training rank holds.

    Attributes:
        weights: model (base) parameters whose weights live on the rank.
        adapter: LoRA adapter parameters on the rank (0 without LoRA).
        trainable: trainable parameters whose gradients live on the rank.
        optimizer: trainable parameters in the rank's optimizer shard.
    """

    weights: float
    adapter: float
    trainable: float
    optimizer: float


def rank_share(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> RankShare:
    """How many parameters one training rank holds, by backend and parallelism.

    Args:
        spec: the model's shape.
        counts: its parameter count.
        layout: the layout.

    Returns:
        The rank's share (for Megatron: the first pipeline stage, which also holds the
        embedding).
    """
    n = layout.training_gpus
    trainable = trainable_parameters(spec, counts, layout)
    adapter = trainable if layout.lora_rank else 0
    if layout.trainer.zero:
        split = n if layout.zero_stage == 3 else 1
        grads = trainable / n if layout.zero_stage >= 2 else trainable
        optimizer = trainable / n if layout.zero_stage >= 1 else trainable
        return RankShare(counts.total / split, adapter / split, grads, optimizer)
    tp, pp, ep = layout.tensor_parallel, layout.pipeline_parallel, layout.expert_parallel
    layers = math.ceil(spec.num_layers / pp)
    experts_per_layer = counts.experts / spec.num_layers
    dense_per_layer = counts.per_layer - experts_per_layer
    # The first stage holds the embedding; with PP=1 it is also the last (lm_head, final norm).
    vocab = counts.embedding
    if pp == 1:
        vocab += counts.unembedding + spec.hidden_size
    dense = (layers * dense_per_layer + vocab) / tp
    experts = layers * experts_per_layer / ep
    weights = dense + experts
    # Trainable share of what the rank holds (1 for full training; the adapter's share for
    # LoRA, spread like the weights it adapts).
    share = trainable / counts.total
    dense_dp = n / (tp * pp)
    expert_dp = n / (ep * pp)
    optimizer = share * (dense / dense_dp + experts / expert_dp)
    adapter_on_rank = share * weights if layout.lora_rank else 0.0
    return RankShare(weights, adapter_on_rank, share * weights, optimizer)


def largest_tensor(spec: ModelSpec, counts: ParameterCount) -> int:
    """Elements of the model's largest tensor (the embedding, ``lm_head`` or one layer's
    ``gate_up_proj``): what a partitioned load gathers at once."""
    gate_up = spec.num_experts * spec.hidden_size * 2 * spec.intermediate_size
    return max(counts.embedding, counts.unembedding, gate_up)


def loaded_parameters(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> float:
    """Parameters one training rank holds once the model is loaded, before training: its
    share when the load is partitioned (ZeRO-3) or sharded (Megatron), else all of them."""
    if layout.whole_model_load:
        return counts.total
    return rank_share(spec, counts, layout).weights


def load_terms(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> list[Term]:
    """What loading the model adds on a training rank beyond its share of the weights: the
    rest of the model when every rank loads it whole and ZeRO-3 partitions it only in
    ``deepspeed.initialize``. Counted as if it met the training peak (an upper bound: at load
    nothing else but the weights is there yet). Empty for a partitioned or sharded load."""
    share = rank_share(spec, counts, layout)
    on_device = 0.0 if layout.param_offload else share.weights
    extra = loaded_parameters(spec, counts, layout) - on_device
    if extra <= 0:
        return []
    return [
        Term(
            "whole_model_load",
            "model load: the whole model on every rank, then partitioned",
            Bounds.exact(layout.weight_bytes * extra),
            "load partitioned (DeepSpeed ZeRO-3 builds the model under zero.Init)",
        )
    ]


def load_description(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> str:
    """One line on how a training rank loads the model (the table's detail line)."""
    w = layout.weight_bytes
    if layout.trainer.model_parallel:
        return "model load: each rank reads its own shard of the Megatron checkpoint"
    if not layout.whole_model_load:
        share = rank_share(spec, counts, layout).weights
        return (
            f"model load: partitioned (ZeRO-3 zero.Init), {format_count(share)} params a rank, "
            f"one tensor gathered at a time (largest "
            f"{format_bytes(w * largest_tensor(spec, counts))})"
        )
    whole = format_bytes(w * counts.total)
    if layout.zero_stage == 3:
        return f"model load: the whole model ({whole}) on every rank before ZeRO-3 partitions it"
    return f"model load: the whole model ({whole}) on every rank (ZeRO-{layout.zero_stage})"


def gpu_resident_state(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> list[Term]:
    """Weights, gradients, optimizer states and reference model kept on a training rank.

    Args:
        spec: the model's shape.
        counts: its parameter count.
        layout: the layout.

    Returns:
        The terms (zero-sized ones left out).
    """
    w = layout.weight_bytes
    share = rank_share(spec, counts, layout)
    lora = layout.lora_rank > 0
    terms = _weight_terms(layout, share) + [_gradient_term(spec, counts, layout, share)]
    if not layout.adam_offload:
        optimizer = optimizer_bytes_per_param(layout) * share.optimizer
        terms.append(
            Term(
                "optimizer",
                f"{'adapter ' if lora else ''}optimizer states "
                f"({optimizer_bytes_per_param(layout)} B/trainable param"
                f"{_sharded(layout)['optimizer']})",
                Bounds.exact(optimizer),
                "adam_offload=true, or add training nodes",
            )
        )
    # LoRA: the reference is the frozen base itself with the adapter off (no second model)
    if layout.kl and not layout.ref_offload and not lora:
        terms.append(
            Term(
                "reference",
                "reference model (KL)",
                Bounds.exact(w * share.weights),
                "ref_offload=true (or kl=false)",
            )
        )
    return terms


def _weight_terms(layout: Layout, share: RankShare) -> list[Term]:
    """The rank's weights on its GPU (none under parameter offload): the frozen base and the
    adapter under LoRA, else the trained weights."""
    w = layout.weight_bytes
    if layout.param_offload:
        return []
    if layout.lora_rank > 0:  # the base is frozen (no gradients, no optimizer state)
        return [
            Term(
                "weights",
                f"frozen base ({layout.dtype}, {format_count(share.weights)} params, "
                "no grads/optimizer state)",
                Bounds.exact(w * share.weights),
                "zero_stage=3 (splits the base over the training GPUs)",
            ),
            Term(
                "adapter",
                f"LoRA adapter (r={layout.lora_rank}"
                f"{', experts' if layout.lora_experts else ''}, "
                f"{format_count(share.adapter)} params on this rank)",
                Bounds.exact(w * share.adapter),
                "lower lora_rank",
            ),
        ]
    return [
        Term(
            "weights",
            f"weights ({layout.dtype}, {format_count(share.weights)} params on this rank)",
            Bounds.exact(w * share.weights),
            "add training nodes (ZeRO-3 / EP split weights over more GPUs)",
        )
    ]


def _gradient_term(
    spec: ModelSpec, counts: ParameterCount, layout: Layout, share: RankShare
) -> Term:
    """The rank's gradients: DeepSpeed's reduce buckets when they stream to the host (adam
    offload), its ZeRO shard otherwise; Megatron's gradient buffer."""
    w = layout.weight_bytes
    if layout.trainer.zero and layout.adam_offload and layout.training_gpus > 1:
        # DeepSpeed sizes the bucket to what there is to reduce, at most reduce_bucket_size.
        bucket = min(layout.reduce_bucket_size, trainable_parameters(spec, counts, layout)) * w
        return Term(
            "gradients",
            "gradient reduce buckets (gradients stream to the host)",
            Bounds(0.5 * bucket, bucket, 2 * bucket),
        )
    if layout.trainer.zero:
        return Term(
            "gradients",
            f"{'adapter ' if layout.lora_rank > 0 else ''}gradients ({layout.dtype}, "
            f"ZeRO-{layout.zero_stage}{_sharded(layout)['gradients']})",
            Bounds.exact(w * share.trainable),
            "zero_stage=3 or add training nodes",
        )
    return Term(
        "gradients",
        "gradient buffer (param dtype; fp32 if grad_reduce_in_fp32)",
        Bounds(w * share.trainable, w * share.trainable, 4 * share.trainable),
        "raise expert_parallel / tensor_parallel",
    )


def _sharded(layout: Layout) -> dict[str, str]:
    """How DeepSpeed splits the gradients and the optimizer states over the training ranks,
    as words for a term's label ("" where a rank holds them whole, or under Megatron)."""
    n = layout.training_gpus
    if not layout.trainer.zero or n == 1:
        return {"gradients": "", "optimizer": ""}
    return {
        "gradients": f", 1/{n} a rank" if layout.zero_stage >= 2 else "",
        "optimizer": f", 1/{n} a rank" if layout.zero_stage >= 1 else "",
    }


def training_rank_terms(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> list[Term]:
    """Every term of one training rank's peak memory.

    Args:
        spec: the model's shape.
        counts: its parameter count.
        layout: the layout.

    Returns:
        The terms, in table order.
    """
    w = layout.weight_bytes
    terms = gpu_resident_state(spec, counts, layout)
    after_weights = sum(1 for term in terms if term.key in ("weights", "adapter"))
    terms[after_weights:after_weights] = load_terms(spec, counts, layout)
    if layout.trainer.zero and layout.zero_stage == 3 and layout.training_gpus > 1:
        largest = max(counts.per_layer, counts.embedding)
        terms.insert(
            after_weights,
            Term(
                "zero3_gathered",
                f"ZeRO-3 gathered layers ({format_count(largest)} params each)",
                ZERO3_GATHERED_LAYERS * (w * largest),
                "megatron backend with expert_parallel (splits each layer's experts)",
            ),
        )
    terms += _step_terms(spec, layout)
    if layout.device == "cuda":
        subtotal = ZERO
        for term in terms:
            subtotal = subtotal + term.bytes
        terms.append(Term("cuda_runtime", "CUDA context, NCCL, workspaces", CUDA_RUNTIME_GIB * GIB))
        terms.append(
            Term(
                "fragmentation",
                "allocator fragmentation",
                Bounds(
                    FRAGMENTATION_SHARE.low * subtotal.low,
                    FRAGMENTATION_SHARE.expected * subtotal.expected,
                    FRAGMENTATION_SHARE.high * subtotal.high,
                ),
            )
        )
    return terms


def _step_terms(spec: ModelSpec, layout: Layout) -> list[Term]:
    """What one micro-batch's forward and backward hold: the activations kept for the backward
    and its peak (the logits and fp32 log-probs, or one recomputed layer)."""
    w = layout.weight_bytes
    shards = layout.tensor_parallel if layout.trainer.model_parallel else 1
    tokens = layout.micro_train_batch_size * layout.sequence_length
    eager = layout.attn_implementation == "eager"
    kept = activation_bytes(
        spec,
        a=w,
        tokens=tokens,
        seq_len=layout.sequence_length,
        layers=spec.num_layers,
        eager=eager,
        checkpointing=layout.gradient_checkpointing,
        shards=shards,
    )
    what = "checkpointed layer inputs" if layout.gradient_checkpointing else "all layers"
    peak = logits_bytes(spec, a=w, tokens=tokens, shards=shards)
    label = f"logits + fp32 log-probs (vocab {spec.vocab_size})"
    if layout.gradient_checkpointing:
        recompute = recomputed_layer_bytes(
            spec, a=w, tokens=tokens, seq_len=layout.sequence_length, eager=eager, shards=shards
        )
        peak = peak.maximum(recompute)
        label = "backward peak: logits + log-probs, or one recomputed layer"
    return [
        Term(
            "activations",
            f"activations ({what}, {tokens} tokens)",
            kept,
            "gradient_checkpointing=true, lower micro_train_batch_size, shorter generate_max_len",
        ),
        Term(
            "logits",
            label,
            peak,
            "lower micro_train_batch_size or shorter generate_max_len (tokens × vocab)",
        ),
    ]
