"""Activation and logits memory of one training micro-batch, counted from the saved tensors.

Counts follow what autograd keeps for backward in ``transformers``' gpt-oss layers (``a`` =
bytes of the activation dtype, ``S`` = sequence length, per token and layer):

- residual stream: the layer input and the mid-layer residual, ``2·H·a``;
- each of the two RMSNorms: an fp32 upcast (only when ``a < 4``), the normalized fp32 tensor
  and the output, ``4H·[a<4] + 4H + a·H``;
- attention: rotated queries, keys and values repeated to ``nh`` heads, and the attention
  output, ``4·nh·d·a``; with eager attention also the softmax probabilities over ``S`` keys
  plus the sink, ``nh·(S+1)·a``, and the row-max indices ``8·nh``; a flash kernel keeps
  only the fp32 log-sum-exp, ``4·nh``;
- router: top-k indices and scores, ``k·(8 + a)``;
- experts, per routed token (``k`` of them): the gathered input and the output ``2·H·a``,
  ``gate_up`` ``2I·a`` and five ``I``-wide SwiGLU intermediates ``5I·a``, index ``16``.

Gradient checkpointing keeps only each layer's input (``H·a``) and rebuilds one layer at a
time in backward, after the loss's backward has freed the logits: the backward peak is then
the larger of the two. Logits: the ``V``-wide logits in ``a`` plus, at the loss's backward, the
fp32 log-probabilities, their gradient and the logits' gradient: ``V·(a + 12)``.
"""

from __future__ import annotations

from capacity.model_spec import ModelSpec
from capacity.quantities import Bounds

FP32 = 4
INDEX = 8

# Low/high factors around the counted tensors: allocator rounding, small tensors not counted,
# and transients (the eager attention's unnormalized and shifted scores) on the high side.
ACTIVATION_LOW_FACTOR = 0.85
ACTIVATION_HIGH_FACTOR = 1.15


def _norm_bytes(hidden: int, a: int) -> int:
    upcast = FP32 * hidden if a < FP32 else 0
    return upcast + FP32 * hidden + a * hidden


def _mask_kinds(spec: ModelSpec) -> int:
    """Distinct attention masks eager attention materializes (full, sliding)."""
    return 2 if spec.num_sliding_layers else 1


def attention_scores_bytes_per_token(spec: ModelSpec, a: int, seq_len: int, eager: bool) -> int:
    """Bytes the attention kernel keeps per token and layer beyond q/k/v/output."""
    if eager:
        return spec.num_heads * (seq_len + 1) * a + INDEX * spec.num_heads
    return FP32 * spec.num_heads


def layer_bytes_per_token(spec: ModelSpec, a: int, seq_len: int, eager: bool) -> int:
    """Bytes one decoder layer saves for backward, per token (no checkpointing).

    Args:
        spec: the model's shape.
        a: bytes per activation element (2 for bf16, 4 for fp32).
        seq_len: tokens per sequence (eager attention grows with it).
        eager: eager attention (``S×S`` scores) rather than a flash kernel.

    Returns:
        Bytes per token.
    """
    h, i, k = spec.hidden_size, spec.intermediate_size, spec.experts_per_token
    residual = 2 * h * a
    norms = 2 * _norm_bytes(h, a)
    attention = 4 * spec.num_heads * spec.head_dim * a
    scores = attention_scores_bytes_per_token(spec, a, seq_len, eager)
    router = k * (INDEX + a)
    experts = k * ((2 * h + 7 * i) * a + 2 * INDEX)
    return residual + norms + attention + scores + router + experts


def activation_bytes(
    spec: ModelSpec,
    *,
    a: int,
    tokens: int,
    seq_len: int,
    layers: int,
    eager: bool,
    checkpointing: bool,
    shards: int = 1,
) -> Bounds:
    """Activations a micro-batch keeps from the end of forward into backward, on one rank.

    Args:
        spec: the model's shape.
        a: bytes per activation element.
        tokens: tokens in the micro-batch (sequences × ``seq_len``).
        seq_len: tokens per sequence (eager attention grows with it).
        layers: decoder layers whose activations this rank holds.
        eager: eager attention.
        checkpointing: gradient checkpointing on (only layer inputs are kept).
        shards: tensor/sequence-parallel degree dividing each activation.

    Returns:
        Bytes, with ``ACTIVATION_*_FACTOR`` around the counted tensors.
    """
    if checkpointing:
        # Layer inputs, plus the eager attention masks ([S, S] per sequence and per mask kind)
        # that each checkpointed layer's recompute closure holds until backward is done.
        per_token = layers * spec.hidden_size * a
        if eager:
            per_token += _mask_kinds(spec) * seq_len * a
    else:
        per_token = layers * layer_bytes_per_token(spec, a, seq_len, eager)
    per_token += _norm_bytes(spec.hidden_size, a)
    return Bounds.spread(tokens * per_token / shards, ACTIVATION_LOW_FACTOR, ACTIVATION_HIGH_FACTOR)


def recomputed_layer_bytes(
    spec: ModelSpec, *, a: int, tokens: int, seq_len: int, eager: bool, shards: int = 1
) -> Bounds:
    """One decoder layer rebuilt during backward under gradient checkpointing.

    The recompute's forward briefly holds two more score-sized tensors than it saves (the
    masked scores and the sink-concatenated, max-shifted copy) with eager attention; they
    count in the expected value.

    Args:
        spec: the model's shape.
        a: bytes per activation element.
        tokens: tokens in the micro-batch.
        seq_len: tokens per sequence.
        eager: eager attention.
        shards: tensor/sequence-parallel degree.

    Returns:
        Bytes.
    """
    counted = tokens * layer_bytes_per_token(spec, a, seq_len, eager) / shards
    transient = 2 * spec.num_heads * (seq_len + 1) * a * tokens / shards if eager else 0.0
    return Bounds(
        counted * ACTIVATION_LOW_FACTOR,
        counted + transient,
        counted * ACTIVATION_HIGH_FACTOR + 1.5 * transient,
    )


def logits_bytes(spec: ModelSpec, *, a: int, tokens: int, shards: int = 1) -> Bounds:
    """Logits and log-probabilities of one micro-batch at the loss's backward.

    Low: a chunked/fused log-softmax keeps just the logits and one fp32 chunk (``V·(a+4)``);
    expected ``V·(a+12)``; high adds the fp32 upcast copy of the logits (``V·(a+16)``).

    Args:
        spec: the model's shape.
        a: bytes per activation element.
        tokens: tokens in the micro-batch.
        shards: vocab-parallel degree.

    Returns:
        Bytes.
    """
    per_token = spec.vocab_size * tokens / shards
    return Bounds(per_token * (a + 4), per_token * (a + 12), per_token * (a + 16))
