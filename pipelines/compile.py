"""Compile the pipeline to KFP v2 IR YAML."""

from __future__ import annotations

from pathlib import Path

from pipelines.presets import Preset, pipeline_arguments

COMPILED_PIPELINE = Path(__file__).parent / "compiled" / "lingo_pipeline.yaml"
"""The compiled pipeline kept in the repo (default preset); a test checks it for drift."""


def compile_pipeline(output: Path, preset: Preset | None = None) -> Path:
    """Write the pipeline's IR YAML to ``output``; a preset sets the parameters' defaults and
    the Kubernetes platform settings (``preset.hardware.platform``).

    Raises:
        RunInputError: the preset's inputs that can be checked on this machine would fail a
            step (``pipelines.preflight``), or ``output`` cannot be written.
    """
    from kfp import compiler

    from pipelines.pipeline import build_pipeline
    from pipelines.platform import get_platform
    from pipelines.preflight import RunInputError, check_run_inputs, output_file_problems

    if problems := output_file_problems(output):
        raise RunInputError("; ".join(problems))
    if preset is not None:
        check_run_inputs(preset, local=False)

    output.parent.mkdir(parents=True, exist_ok=True)
    pipeline = build_pipeline(get_platform(preset.hardware.platform) if preset else None)
    compiler.Compiler().compile(
        pipeline,
        str(output),
        pipeline_parameters=pipeline_arguments(preset) if preset else None,
    )
    return output
