"""What the capacity check and the placement plan say of a preset: the GRPO step's placement
plan, the machines the estimates run on, and the estimates themselves (``lingo estimate``,
the preflight check, the notebook)."""

from __future__ import annotations

from pipelines.presets import Preset, run_plan


def grpo_plan(preset: Preset):
    """The GRPO step's ``trainer.placement.PlacementPlan`` on the preset's branch
    (``Preset.backend``): training processes on its job's nodes, dedicated rollout engines on
    the nodes after them."""
    from trainer.placement import step_placement

    return step_placement(run_plan(preset).grpo)


def capacity_layout(preset: Preset, layout: str | None = None):
    """The machines the capacity check estimates on: ``hardware``'s (or the planner's layout
    preset ``layout``, ``lingo estimate --layout``), as a ``capacity.Layout``."""
    from capacity.layouts import hardware_layout

    return layout or hardware_layout(preset.hardware)


def run_estimates(preset: Preset, model: str, layout: str | None = None, overrides=None):
    """``(plan, {"sft": Estimate, "grpo": Estimate})`` of ``preset`` as the capacity check
    estimates it (``overrides``: planner layout fields, after the preset's own)."""
    from trainer.capacity_check import run_estimates as estimates

    # the preset's backend branch, as the pipeline runs it
    run = run_plan(preset, layout_overrides=overrides or {})
    return estimates(model, capacity_layout(preset, layout), run)
