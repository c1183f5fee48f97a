"""Compile the pipeline to KFP v2 IR YAML."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pipelines.presets import Preset, pipeline_arguments

COMPILED_PIPELINE = Path(__file__).parent / "compiled" / "lingo_pipeline.yaml"
"""The compiled pipeline kept in the repo (default preset); a test checks it for drift."""


class CompileError(ValueError):
    """The pipeline cannot be compiled to the path asked for, or kfp refuses it."""


YAML_SUFFIXES = (".yaml", ".yml")


def compile_pipeline(output: Path, preset: Preset | None = None) -> Path:
    """Write the pipeline's IR YAML to ``output`` (a temp file renamed over it when complete);
    a preset sets the parameters' defaults and the Kubernetes platform settings
    (``preset.hardware.platform``).

    Raises:
        CompileError: ``output`` is not a ``.yaml`` file, or kfp refuses the pipeline (its
            message).
        RunInputError: the preset's inputs that can be checked on this machine would fail a
            step (``pipelines.preflight``), or ``output`` cannot be written (a folder, not
            writable, a name too long).
    """
    from kfp import compiler

    from pipelines.pipeline import build_pipeline
    from pipelines.platform import get_platform
    from pipelines.preflight import RunInputError, check_run_inputs, output_file_problems

    if problems := output_file_problems(output):
        raise RunInputError("; ".join(problems))
    if preset is not None:
        check_run_inputs(preset, local=False)

    if output.suffix not in YAML_SUFFIXES:
        raise CompileError(
            f"--output {output}: the pipeline is compiled to YAML; name a .yaml file"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    pipeline = build_pipeline(get_platform(preset.hardware.platform) if preset else None)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.stem}.", suffix=output.suffix, dir=output.parent)
    os.close(fd)
    try:
        compiler.Compiler().compile(
            pipeline,
            tmp,
            pipeline_parameters=pipeline_arguments(preset) if preset else None,
        )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the file gets the usual mode
        os.replace(tmp, output)
    except (ValueError, TypeError, KeyError) as exc:
        raise CompileError(f"kfp cannot compile the pipeline: {type(exc).__name__}: {exc}") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    return output
