"""The named Megatron layouts, as plain fields, and the parallel sizes a layout gives.

A Megatron layout (``trainer.megatron.layout.MegatronLayout``, which checks it against the
model and the capacity planner) is named by a preset and overrides: ``"tiny-cpu"``, or
``{"preset": "verl-gpt-oss-8x8-h100", "pp": 4}``, or plain fields. The presets' fields live
here, below the trainer, so that the plan of a run knows a Megatron branch's parallel sizes
(``megatron_sizes``) without building the trainer's model of the layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster.nodes import H100_GIB
from plan.parallel_sizes import ParallelSizes
from plan.specs import whole

MEGATRON_MACHINE_FIELDS = ("nodes", "gpus_per_node", "gpu_memory_gib")
"""Megatron layout fields that the machines decide (``cluster.hardware.Hardware``'s
``megatron_fields``): a preset's layout does not state them."""


class UnknownMegatronLayoutError(ValueError):
    """A layout names a preset that is not in ``MEGATRON_LAYOUT_PRESETS``."""


def verl_gpt_oss_fields(nodes: int = 8, gpu_memory_gib: float = H100_GIB) -> dict[str, Any]:
    """verl's gpt-oss Megatron recipe on ``nodes`` × 8 H100/H800: TP 8, EP 8, ETP 1, PP = nodes.

    Rollouts run colocated vLLM engines of TP 4; actor, gradients, optimizer and reference
    are offloaded to the host between phases (the recipe's ``offload=True``), recompute is
    full.
    """
    return {
        "name": f"verl-gpt-oss-{nodes}x8-h100",
        "tp": 8,
        "pp": nodes,
        "ep": 8,
        "etp": 1,
        "cp": 1,
        "sequence_parallel": True,
        "params_dtype": "bf16",
        "nodes": nodes,
        "gpus_per_node": 8,
        "gpu_memory_gib": gpu_memory_gib,
        "rollout_tp": 4,
        "planner": {
            "micro_train_batch_size": 1,
            "prompt_max_len": 1024,
            "generate_max_len": 1024,
            "adam_offload": True,
            "ref_offload": True,
            "gradient_checkpointing": True,
            "attn_implementation": "flash",
        },
    }


MEGATRON_LAYOUT_PRESETS: dict[str, dict[str, Any]] = {
    # verl's reference: 8 nodes × 8 H100/H800, TP 8, EP 8, PP = nodes, rollout TP 4.
    "verl-gpt-oss-8x8-h100": verl_gpt_oss_fields(8),
    # The CPU round trip of the tiny model: one process, nothing split, fp32.
    "tiny-cpu": {"name": "tiny-cpu", "params_dtype": "fp32"},
}
"""The named layouts: the fields each states (the others keep ``MegatronLayout``'s
defaults)."""


def megatron_layout_fields(layout: str | Mapping[str, Any]) -> dict[str, Any]:
    """A layout's fields: a preset name, or a mapping (``{"preset": name, **overrides}`` or
    plain fields); the preset's fields first, the overrides over them.

    Raises:
        UnknownMegatronLayoutError: the preset is not a named layout (the message names them).
    """
    fields = {"preset": layout} if isinstance(layout, str) else dict(layout)
    preset = fields.pop("preset", None)
    if preset is None:
        return fields
    if preset not in MEGATRON_LAYOUT_PRESETS:
        raise UnknownMegatronLayoutError(
            f"preset: unknown Megatron layout {preset!r}; presets: "
            f"{', '.join(sorted(MEGATRON_LAYOUT_PRESETS))}"
        )
    return {**MEGATRON_LAYOUT_PRESETS[preset], **fields}


def megatron_sizes(layout: str | Mapping[str, Any]) -> ParallelSizes:
    """The parallel sizes (tp, pp, ep, etp, cp, dp) a layout gives; a size it does not state
    is 1 (``dp``: derived from the world, ``ParallelSizes.for_world``).

    Raises:
        UnknownMegatronLayoutError: the layout names an unknown preset.
        ParallelSizesError: a size below 1.
    """
    fields = megatron_layout_fields(layout)
    stated = {name: fields.get(name) for name in ParallelSizes.names()}
    return ParallelSizes(**{k: whole(v, k) for k, v in stated.items() if v is not None})
