"""Capacity planner: will a model's SFT/GRPO run fit a cluster layout?

Per training rank and rollout GPU memory, host memory per node and checkpoint storage, each
with low/expected/high bounds and a verdict. ``render_estimate`` is what ``lingo estimate``
prints; ``check_layout`` is the pipeline's fail-fast check. See ``docs/capacity.md``.
"""

from capacity.estimate import Estimate, estimate, estimate_layout
from capacity.layouts import LAYOUT_PRESETS, Layout, LayoutError, resolve_layout
from capacity.model_presets import MODEL_PRESETS
from capacity.model_spec import (
    ModelSpec,
    ModelSpecError,
    ParameterCount,
    count_parameters,
    load_model_spec,
)
from capacity.quantities import Bounds, Resource, Term, Verdict
from capacity.report import LayoutDoesNotFit, check_layout, format_table, render_estimate

__all__ = [
    "LAYOUT_PRESETS",
    "MODEL_PRESETS",
    "Bounds",
    "Estimate",
    "Layout",
    "LayoutDoesNotFit",
    "LayoutError",
    "ModelSpec",
    "ModelSpecError",
    "ParameterCount",
    "Resource",
    "Term",
    "Verdict",
    "check_layout",
    "count_parameters",
    "estimate",
    "estimate_layout",
    "format_table",
    "load_model_spec",
    "render_estimate",
    "resolve_layout",
]
