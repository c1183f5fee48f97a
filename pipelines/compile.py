"""Compile a preset's pipeline to KFP v2 IR YAML, byte for byte the same every time."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pipelines.presets import Preset

COMPILED_DIR = Path(__file__).parent / "compiled"
"""Every preset's compiled pipeline, ``<preset>.yaml``, kept in the repo; a test checks each
for drift."""


def compiled_path(preset_name: str) -> Path:
    """Where the kept YAML of preset ``preset_name`` is."""
    return COMPILED_DIR / f"{preset_name}.yaml"


class CompileError(ValueError):
    """The pipeline cannot be compiled to the path asked for, or kfp refuses it."""


YAML_SUFFIXES = (".yaml", ".yml")


def compile_pipeline(output: Path, preset: Preset) -> Path:
    """Write ``preset``'s pipeline (``pipelines.pipeline.build_pipeline``: its run form's
    parameters default to the preset's values, its tasks get the Kubernetes platform settings
    of ``preset.hardware.platform``) to ``output``, a temp file renamed over it when complete.

    The bytes depend only on the code, the preset and the image names: no parameter is a
    dict, whose order in the YAML's header comment KFP leaves to protobuf's map order.

    Raises:
        CompileError: ``output`` is not a ``.yaml`` file, or kfp refuses the pipeline (its
            message).
        RunInputError: the preset's inputs that can be checked on this machine would fail a
            step (``pipelines.preflight``), or ``output`` cannot be written (a folder, not
            writable, a name too long).
    """
    from kfp import compiler

    from pipelines.pipeline import build_pipeline
    from pipelines.preflight import RunInputError, check_run_inputs, output_file_problems

    if problems := output_file_problems(output):
        raise RunInputError("; ".join(problems))
    check_run_inputs(preset, local=False)

    if output.suffix not in YAML_SUFFIXES:
        raise CompileError(
            f"--output {output}: the pipeline is compiled to YAML; name a .yaml file"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.stem}.", suffix=output.suffix, dir=output.parent)
    os.close(fd)
    try:
        compiler.Compiler().compile(build_pipeline(preset), tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the file gets the usual mode
        os.replace(tmp, output)
    except (ValueError, TypeError, KeyError) as exc:
        raise CompileError(f"kfp cannot compile the pipeline: {type(exc).__name__}: {exc}") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    return output
