"""Makes this Python look like the GPU machine's: only its image's packages and the carried
wheels can be imported.

Put this folder on ``PYTHONPATH``: Python imports ``sitecustomize`` at start-up, and this one
hides every installed top-level module whose distributions are neither in the GPU image
(``tools/build_gpu_wheels.GPU_IMAGE_PACKAGES``, with the requirements of their versions
installed here) nor carried (``WHEELS``, ``SOURCE_BUILDS``), as if it were not installed:
``import`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` returns None, as
optional imports expect. Distributions
named in ``GPU_MACHINE_ALSO_HIDE`` (comma-separated) are hidden too. Versions are this
environment's, not the image's: what it proves is that the checks import nothing else.
"""

import importlib.machinery
import importlib.util
import os
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _available() -> set[str]:
    spec = importlib.util.spec_from_file_location(
        "build_gpu_wheels", _ROOT / "tools" / "build_gpu_wheels.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    carried = {s.split("==")[0] for s in (*tool.WHEELS, *tool.SOURCE_BUILDS)}
    names = _with_requirements(tool.GPU_IMAGE_PACKAGES) | carried | {"lingo-rl"}
    also = {n for n in os.environ.get("GPU_MACHINE_ALSO_HIDE", "").split(",") if n}
    return {_normalized(n) for n in names} - {_normalized(n) for n in also}


def _with_requirements(names) -> set[str]:
    """``names`` and, for those installed here, their requirements (no extras), recursively."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    seen, pending = set(), [_normalized(n) for n in names]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            listed = requires(name) or []
        except PackageNotFoundError:
            continue
        for line in listed:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(_normalized(requirement.name))
    return seen


def _hidden() -> frozenset[str]:
    available = _available()
    return frozenset(
        top
        for top, dists in packages_distributions().items()
        if not any(_normalized(d) in available for d in dists)
    )


class _GpuMachinePathFinder(importlib.machinery.PathFinder):
    hidden: frozenset[str] = frozenset()

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in cls.hidden:
            return None
        return super().find_spec(fullname, path, target)


_GpuMachinePathFinder.hidden = _hidden()
sys.meta_path[:] = [
    _GpuMachinePathFinder if finder is importlib.machinery.PathFinder else finder
    for finder in sys.meta_path
]
