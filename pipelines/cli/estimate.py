"""``lingo presets`` and ``lingo estimate``: what each preset is and whether it fits."""

from __future__ import annotations

from typing import Annotated

import typer

from pipelines.cli.app import app, clear_errors, echo, parse_sets
from pipelines.presets import (
    PRESETS,
    Preset,
    UnknownPresetError,
    get_preset,
)


@app.command()
def presets() -> None:
    """List the named configurations."""
    for name, preset in PRESETS.items():
        echo(f"{name:14s} {preset.description}")


@app.command()
@clear_errors
def estimate(
    model: Annotated[
        str | None,
        typer.Option(
            help="Model preset (gpt-oss-20b, gpt-oss-120b, tiny-gpt-oss), a model "
            "directory or a config.json [default: gpt-oss-20b, or the --preset's model]."
        ),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(
            help="Layout preset: g5.12xlarge-x6-openrlhf, g5.12xlarge-x6-openrlhf-12train, "
            "g5.12xlarge-x6-openrlhf-hybrid, p5en.48xlarge-x2-megatron, tiny-cpu "
            "[default: g5.12xlarge-x6-openrlhf, or the --preset's hardware]."
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help="A pipeline preset: print its GRPO placement plan and estimate its SFT and "
            "GRPO steps as configured (processes, batch, lengths, engines) on its hardware "
            "(or --layout's machines), as the pipeline's capacity check does."
        ),
    ] = None,
    sets: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a layout field, KEY=VALUE (repeatable), e.g. micro_train_batch_size=2.",
        ),
    ] = None,
) -> None:
    """Estimate GPU memory, host memory and storage of a GRPO/SFT layout, with a verdict.

    Exits with status 1 when the layout does not fit."""
    from capacity import (
        LayoutDoesNotFit,
        LayoutError,
        ModelSpecError,
        check_layout,
        render_estimate,
    )
    from trainer.placement import PlacementError

    overrides = parse_sets(sets)
    try:
        if preset is not None:
            _estimate_preset(get_preset(preset), model, layout, overrides)
            return
        model, layout = model or "gpt-oss-20b", layout or "g5.12xlarge-x6-openrlhf"
        echo(render_estimate(model, layout, overrides))
        check_layout(model, layout, overrides)
    except (ModelSpecError, LayoutError, PlacementError, UnknownPresetError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    except LayoutDoesNotFit:
        raise typer.Exit(1) from None


def _estimate_preset(
    preset: Preset, model: str | None, layout: str | None, overrides: dict[str, str]
) -> None:
    """``lingo estimate --preset``: the placement plan, then SFT's and GRPO's tables."""
    from capacity import MODEL_PRESETS, Verdict, format_table
    from pipelines.preset_capacity import run_estimates

    if model is None:  # the preset's model, where the planner knows it by name
        name = "tiny-gpt-oss" if preset.model.source == "tiny" else preset.model.source
        model = name.rsplit("/", 1)[-1] if name.rsplit("/", 1)[-1] in MODEL_PRESETS else name
    plan, estimates = run_estimates(preset, model, layout, overrides)
    echo(plan.render())
    for step, result in estimates.items():
        echo(f"\n{step.upper()}\n{format_table(result)}")
    if any(e.verdict is Verdict.DOES_NOT_FIT for e in estimates.values()):
        raise typer.Exit(1)
