"""Checkpoint sizes on the shared volume.

- DeepSpeed checkpoint: each rank's ``optim_states`` file holds its fp32 master weights and
  Adam m and v (12 B per trainable parameter in all); under ZeRO-3 the ``model_states``
  files hold only metadata (high bound: they also hold the bf16 partitions), under ZeRO 0-2
  rank 0 writes the whole module in the training dtype once.
- Megatron ``torch_dist`` checkpoint: model weights in the training dtype plus the
  distributed optimizer's fp32 main weights, m and v: ``w·P + 12·Pt``. The Megatron backend
  also keeps the converted starting weights (``w·P``) once.
- HF checkpoint: the full model in bf16 (``2·P``); a LoRA run's export is merged too.
"""

from __future__ import annotations

from capacity.layouts import Layout
from capacity.model_spec import ModelSpec, ParameterCount
from capacity.quantities import Bounds, Term, format_bytes
from capacity.training_memory import trainable_parameters

OPTIMIZER_CHECKPOINT_BYTES_PER_PARAM = 12
HF_BYTES_PER_PARAM = 2


def deepspeed_checkpoint_bytes(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> Bounds:
    """One DeepSpeed checkpoint (all ranks' files together)."""
    trainable = trainable_parameters(spec, counts, layout)
    optimizer = OPTIMIZER_CHECKPOINT_BYTES_PER_PARAM * trainable
    if layout.zero_stage == 3:
        return Bounds(optimizer, optimizer, optimizer + layout.weight_bytes * trainable)
    return Bounds.exact(optimizer + layout.weight_bytes * counts.total)


def megatron_checkpoint_bytes(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> Bounds:
    """One Megatron distributed checkpoint with optimizer state."""
    trainable = trainable_parameters(spec, counts, layout)
    return Bounds.exact(
        layout.weight_bytes * counts.total + OPTIMIZER_CHECKPOINT_BYTES_PER_PARAM * trainable
    )


def hf_checkpoint_bytes(counts: ParameterCount) -> Bounds:
    """One HF export (safetensors, bf16)."""
    return Bounds.exact(HF_BYTES_PER_PARAM * counts.total)


def storage_terms(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> list[Term]:
    """Every term of the checkpoint volume at its fullest.

    Args:
        spec: the model's shape.
        counts: its parameter count.
        layout: the layout.

    Returns:
        The terms (zero-sized ones left out).
    """
    terms: list[Term] = []
    keep = layout.max_ckpt_num
    if layout.trainer.zero:
        one = deepspeed_checkpoint_bytes(spec, counts, layout)
        key, what = "deepspeed_checkpoints", "DeepSpeed checkpoint"
    else:
        one = megatron_checkpoint_bytes(spec, counts, layout)
        key, what = "megatron_checkpoints", "Megatron checkpoint"
    if layout.trainer.needs_conversion:
        terms.append(
            Term(
                "megatron_base",
                "Megatron-converted starting weights",
                Bounds.exact(layout.weight_bytes * counts.total),
            )
        )
    if keep:
        terms.insert(
            0,
            Term(
                key,
                f"{what} ({format_bytes(one.expected)}) × max_ckpt_num={keep}",
                keep * one,
                "lower max_ckpt_num, or a larger volume (storage_gib)",
            ),
        )
    if layout.hf_ckpt_num:
        hf = hf_checkpoint_bytes(counts)
        terms.append(
            Term(
                "hf_checkpoints",
                f"HF checkpoint ({format_bytes(hf.expected)}) × hf_ckpt_num={layout.hf_ckpt_num}",
                layout.hf_ckpt_num * hf,
                "lower hf_ckpt_num, or a larger volume (storage_gib)",
            )
        )
    return terms
