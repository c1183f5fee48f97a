"""fast-hadamard-transform's sdist, built as images/Dockerfile.megatron builds it (issue #39).

megatron-bridge 0.6.2 requires ``fast-hadamard-transform>=1.1.0``, published only as an sdist
whose ``setup.py`` imports torch (and ``wheel``) at the top. pip builds an sdist in an
isolated environment by default, which holds setuptools and wheel but no torch, so the
Megatron image builds it with ``--no-build-isolation`` against its own torch. This test does
both builds with this environment's CPU torch (``pip wheel``: nothing is installed here):
the isolated one fails on ``import torch``, the other builds the wheel. There is no nvcc on
this machine, so the CUDA extension is skipped (``FAST_HADAMARD_TRANSFORM_SKIP_CUDA_BUILD``);
the image compiles it with NGC's nvcc and its build check imports it
(``core.image_checks.MEGATRON_COMPILED_OPS``). Both build from source
(``FAST_HADAMARD_TRANSFORM_FORCE_BUILD``).

Needs PyPI (pip's own index settings); skipped, saying so, where the sdist cannot be fetched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _version() -> str:
    text = (ROOT / "images" / "Dockerfile.megatron").read_text()
    return re.search(r"^ARG FAST_HADAMARD_TRANSFORM_VERSION=(\S+)", text, re.M).group(1)


def _pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_the_sdist_builds_only_without_build_isolation(tmp_path):
    version = _version()
    # metadata is prepared on download: without the CUDA build it needs no nvcc
    env = {**os.environ, "FAST_HADAMARD_TRANSFORM_SKIP_CUDA_BUILD": "TRUE"}
    fetched = _pip(
        "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
        "-d", str(tmp_path), f"fast-hadamard-transform=={version}", env=env,
    )  # fmt: skip
    if fetched.returncode != 0:
        pytest.skip(f"cannot fetch fast-hadamard-transform {version}: {fetched.stderr[-300:]}")
    (sdist,) = tmp_path.glob("fast_hadamard_transform-*.tar.gz")
    isolated = _pip("wheel", "--no-deps", "-w", str(tmp_path / "isolated"), str(sdist), env=env)
    assert isolated.returncode != 0
    assert "No module named 'torch'" in isolated.stdout + isolated.stderr
    # as the image builds it: from source (without FORCE_BUILD its setup.py looks for a
    # prebuilt wheel named after torch's CUDA version, which a CPU torch does not have)
    env["FAST_HADAMARD_TRANSFORM_FORCE_BUILD"] = "TRUE"
    built = _pip(
        "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
        "-w", str(tmp_path / "wheel"), str(sdist), env=env,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert list((tmp_path / "wheel").glob(f"fast_hadamard_transform-{version}-*.whl"))
