"""A kept pipeline YAML's run form, as KFP hands it to the ``configure`` step: the preset the
pipeline carries (a constant of that task) and the form's parameter values."""

import functools
from pathlib import Path
from typing import Any

import yaml

from pipelines.run_form import FORM_FIELDS, configure_outputs


@functools.cache
def _read(path: Path, mtime_ns: int) -> dict:
    return next(
        yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    )


def _spec(path: Path) -> dict:
    """The pipeline spec at ``path`` (read once while the file is unchanged; do not modify)."""
    path = Path(path)
    return _read(path, path.stat().st_mtime_ns)


def _configure_constant(path: Path, name: str) -> str:
    tasks = _spec(path)["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    return tasks["configure"]["inputs"]["parameters"][name]["runtimeValue"]["constant"]


def carried_preset(path: Path) -> str:
    """The preset JSON of the ``configure`` task of the pipeline at ``path``."""
    return _configure_constant(path, "preset")


def carried_job_platform(path: Path) -> str:
    """The training jobs' platform fields the ``configure`` task of ``path`` carries."""
    return _configure_constant(path, "job_platform")


def form_defaults(path: Path) -> dict[str, Any]:
    """The form fields' defaults of the pipeline at ``path``, typed as KFP passes them to a
    step (the YAML writes integers as floats: 9.0)."""
    parameters = _spec(path)["root"]["inputDefinitions"]["parameters"]
    names = {field.name for field in FORM_FIELDS}
    return {
        name: int(spec["defaultValue"])
        if spec["parameterType"] == "NUMBER_INTEGER"
        else spec["defaultValue"]
        for name, spec in parameters.items()
        if name in names
    }


def configure_run(path: Path, overrides: str = "", **changed: Any) -> dict[str, Any]:
    """The ``configure`` step's outputs for a run of the pipeline at ``path`` whose form
    changes ``changed`` (the other fields at their defaults) and holds ``overrides``."""
    return configure_outputs(
        carried_preset(path), form_defaults(path) | changed, overrides, carried_job_platform(path)
    )
