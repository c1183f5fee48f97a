"""The estimate as a table, and the entry points the CLI and the pipeline call."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capacity.estimate import Estimate, estimate
from capacity.layouts import Layout
from capacity.quantities import GIB, MIB, Verdict, format_count
from capacity.sync_time import describe_sync

logger = logging.getLogger(__name__)

LABEL_WIDTH = 62
NUMBER_WIDTH = 9


class LayoutDoesNotFit(RuntimeError):
    """A layout cannot hold the run; carries the estimate and its table.

    Attributes:
        estimate: the estimate that failed.
        table: the rendered table (also the exception message).
    """

    def __init__(self, estimate: Estimate, table: str) -> None:
        failing = [r.label for r in estimate.resources if r.verdict is Verdict.DOES_NOT_FIT]
        super().__init__(
            f"layout {estimate.layout.name!r} cannot run {estimate.model.name}: "
            f"{'; '.join(failing)} does not fit\n{table}"
        )
        self.estimate = estimate
        self.table = table


def _unit(result: Estimate) -> tuple[str, float]:
    """GiB, or MiB when every resource's high total is under 8 GiB (the CPU layouts)."""
    largest = max(r.total.high for r in result.resources)
    return ("MiB", MIB) if largest < 8 * GIB else ("GiB", GIB)


def _describe_layout(layout: Layout) -> str:
    if layout.device == "cpu":
        where = f"CPU, {layout.host_memory_gib:g} GiB RAM"
    else:
        where = (
            f"{layout.nodes} nodes × {layout.gpus_per_node} GPUs ({layout.gpu_memory_gib:g} GiB), "
            f"{layout.host_memory_gib:g} GiB RAM/node"
        )
    trainers = "training processes" if layout.device == "cpu" else "training GPUs"
    if layout.trainer.zero and layout.training_gpus == 1 and not layout.zero_stage:
        backend = "plain PyTorch"
    elif layout.trainer.zero:
        backend = f"DeepSpeed ZeRO-{layout.zero_stage}"
    else:
        backend = (
            f"Megatron TP={layout.tensor_parallel} PP={layout.pipeline_parallel} "
            f"EP={layout.expert_parallel}"
        )
    if layout.adam_offload:
        backend += ", adam offload"
    rollout = "rollouts with the training model"
    if layout.rollout_gpus:
        mode = "hybrid" if layout.hybrid else "non-hybrid"
        rollout = (
            f"{layout.rollout_gpus} rollout GPUs ({mode}, {layout.vllm_num_engines} vLLM engines "
            f"TP={layout.vllm_tensor_parallel_size})"
        )
    return (
        f"{where}; {layout.training_gpus} {trainers} ({backend}); {rollout}; "
        f"{layout.dtype}, {layout.attn_implementation} attention, micro-batch "
        f"{layout.micro_train_batch_size} × {layout.sequence_length} tokens"
    )


def format_table(result: Estimate) -> str:
    """Render an estimate as a fixed-width table in GiB.

    Args:
        result: the estimate.

    Returns:
        The table (GiB; MiB for small CPU runs): a header, then per resource its total,
        capacity and verdict, its terms, an optional detail line and the advice when it does
        not simply fit.
    """
    counts = result.parameters
    unit, scale = _unit(result)

    def size(value: float) -> str:
        return f"{value / scale:>{NUMBER_WIDTH}.1f}"

    lines = [
        f"{result.model.name}: {format_count(counts.total)} parameters "
        f"({format_count(counts.active)} active, {format_count(result.trainable_parameters)} "
        f"trainable) on layout {result.layout.name}",
        _describe_layout(result.layout),
        "",
        f"{f'resource / term ({unit})':<{LABEL_WIDTH}}{'low':>{NUMBER_WIDTH}}"
        f"{'expected':>{NUMBER_WIDTH}}{'high':>{NUMBER_WIDTH}}{'capacity':>{NUMBER_WIDTH}}"
        f"  verdict",
    ]
    for resource in result.resources:
        total = resource.total
        lines.append(
            f"{resource.label[:LABEL_WIDTH]:<{LABEL_WIDTH}}{size(total.low)}"
            f"{size(total.expected)}{size(total.high)}{size(resource.capacity)}"
            f"  {resource.verdict.value}"
        )
        for term in resource.terms:
            label = f"  {term.label}"[:LABEL_WIDTH]
            lines.append(
                f"{label:<{LABEL_WIDTH}}{size(term.bytes.low)}{size(term.bytes.expected)}"
                f"{size(term.bytes.high)}"
            )
        if resource.detail:
            lines.append(f"  {resource.detail}")
        for advice in resource.advice:
            lines.append(f"  advice: {advice}")
    if result.sync is not None:
        lines.append("")
        lines.append(describe_sync(result.sync))
    lines.append("")
    lines.append(f"verdict: {result.verdict.value}")
    return "\n".join(lines)


def render_estimate(
    model: str | Path | Mapping[str, Any],
    layout: str | Layout,
    overrides: Mapping[str, str] | None = None,
) -> str:
    """Estimate ``model`` on ``layout`` and return the table (what ``lingo estimate`` prints).

    Args:
        model: a preset name (``gpt-oss-20b``), a model directory or ``config.json`` path,
            or a config mapping.
        layout: a layout preset name (``g5.12xlarge-x6-openrlhf``) or a ``Layout``.
        overrides: ``--set key=value`` pairs, values as typed.

    Returns:
        The table.

    Raises:
        ModelSpecError: the model cannot be read.
        LayoutError: unknown preset or field, or an invalid value.
    """
    return format_table(estimate(model, layout, overrides))


def check_layout(
    model: str | Path | Mapping[str, Any],
    layout: str | Layout,
    overrides: Mapping[str, str] | None = None,
) -> Estimate:
    """Fail fast before heavy steps: return the estimate, or raise when something cannot fit.

    Args:
        model: as for ``render_estimate``.
        layout: as for ``render_estimate``.
        overrides: as for ``render_estimate``.

    Returns:
        The estimate (its verdict may be "tight"; that is logged as a warning).

    Raises:
        LayoutDoesNotFit: some resource's expected use exceeds its capacity.
    """
    result = estimate(model, layout, overrides)
    table = format_table(result)
    if not result.fits:
        raise LayoutDoesNotFit(result, table)
    if result.verdict is Verdict.TIGHT:
        logger.warning(
            "layout %s is tight for %s:\n%s", result.layout.name, result.model.name, table
        )
    else:
        logger.info("layout %s fits %s", result.layout.name, result.model.name)
    return result
