"""What the GPU and Megatron images' Python stacks must hold, checked where a mismatch would
otherwise show only at run time: in the images' build step (``python -m core.image_checks gpu``
or ``megatron``) and, for Transformer Engine, before a Megatron model is built.

- GPU image (``images/Dockerfile.gpu``): vLLM's compiled ops import, and every CUDA runtime
  they and torch load has one major version (vllm 0.33.0's ``_C_stable_libtorch.abi3.so``
  needs ``libcudart.so.13``; a CUDA 12 torch under it fails only at the first engine); and
  DeepSpeed's op builder, which compiles its CUDA ops just in time on the cluster, finds an
  nvcc of torch's CUDA version (its ``assert_no_cuda_mismatch``, which every CUDA op build
  runs first).
- Megatron image (``images/Dockerfile.megatron``) and the Megatron backend: a Transformer
  Engine that has GPT-OSS's learnable attention sinks. megatron-bridge 0.6.2's GPT-OSS
  provider sets ``softmax_type = "learnable"`` (``models/gpt_oss/gpt_oss_bridge.py``) and
  megatron-core 0.19.2 passes ``softmax_type`` to TE's ``DotProductAttention`` only from TE
  2.8.0 on (``extensions/transformer_engine.py``, ``TEDotProductAttention.__init__``: an
  ``assert is_te_min_version("2.8.0")``, which ``python -O`` drops, raised deep inside the
  model build). Without TE, megatron-core's local attention implements the sinks itself.

- The node's NVIDIA driver, when a process of the GPU image starts (``start_step_process``,
  ``trainer.entry.step_main``): the image states the oldest driver its CUDA runs on
  (``LINGO_MIN_NVIDIA_DRIVER``, 580 for CUDA 13: vllm 0.33's ``_C`` needs
  ``libcudart.so.13``), and a step on an older node stops at once with one line naming the
  driver, instead of at the first engine with a CUDA error. No build can check it: a build
  has no GPU and no driver.

The version rules here are facts of the pinned wheels; ``tests/pipelines/test_image_versions.py``
holds the Dockerfiles and constraint files to them.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

TE_MIN_FOR_SOFTMAX_TYPE = "2.8.0"
"""The first Transformer Engine whose attention takes ``softmax_type`` (megatron-core 0.19.2)."""

VLLM_COMPILED_OPS = (
    "vllm._C_stable_libtorch",
    "vllm._moe_C_stable_libtorch",
    "vllm.cumem_allocator",
    "vllm.vllm_flash_attn._vllm_fa2_C",
    "vllm.vllm_flash_attn._vllm_fa3_C",
)
"""The compiled extensions of the vllm 0.33.0 wheel that GPT-OSS rollouts use: the custom ops
(imported by ``vllm.platforms.cuda``), the fused MoE ops, the sleep-mode allocator, and the
flash-attention kernels with sinks (FA3 on Hopper, FA2 elsewhere)."""


class ImageCheckError(RuntimeError):
    """An image's software stack cannot run what the project asks of it."""


MIN_DRIVER_ENV = "LINGO_MIN_NVIDIA_DRIVER"
"""Set by an image to the oldest NVIDIA driver branch its CUDA runtime runs on."""

MIN_DRIVER_FOR_CUDA = {12: 525, 13: 580}
"""The oldest driver branch of each CUDA major (NVIDIA's CUDA compatibility table: CUDA 12.x
runs on R525 and newer, CUDA 13.x on R580 and newer; an older driver refuses the runtime with
"CUDA driver version is insufficient for CUDA runtime version")."""

PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
"""The kernel module's version line (mounted into GPU containers by the NVIDIA toolkit)."""


def _proc_driver_version(path: Path = PROC_DRIVER_VERSION) -> str | None:
    """``550.54.15`` from ``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ...``
    (or ``... Open Kernel Module for aarch64  580.65.06 ...``); None without the file."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    match = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else None


def _nvidia_smi_driver_version() -> str | None:
    """``nvidia-smi --query-gpu=driver_version``'s first line; None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        result = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = result.stdout.split()
    return lines[0] if result.returncode == 0 and lines else None


def _nvml_driver_version() -> str | None:
    """``nvmlSystemGetDriverVersion`` through ``libnvidia-ml.so.1``; None without it."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        buffer = ctypes.create_string_buffer(96)
        if nvml.nvmlSystemGetDriverVersion(buffer, ctypes.c_uint(len(buffer))) != 0:
            return None
        return buffer.value.decode() or None
    finally:
        nvml.nvmlShutdown()


DRIVER_SOURCES: tuple[tuple[str, Callable[[], str | None]], ...] = (
    (str(PROC_DRIVER_VERSION), _proc_driver_version),
    ("nvidia-smi", _nvidia_smi_driver_version),
    ("NVML", _nvml_driver_version),
)
"""Where the driver's version is read, in order: the first that answers gives it."""


def nvidia_driver_version(
    sources: tuple[tuple[str, Callable[[], str | None]], ...] = DRIVER_SOURCES,
) -> tuple[str, str] | None:
    """``(version, where it was read)`` of the node's NVIDIA driver; None when no source
    answers (no GPU, or none made visible to this container)."""
    for name, read in sources:
        version = read()
        if version:
            return version, name
    return None


def driver_problem(found: tuple[str, str] | None, minimum: int) -> str | None:
    """Why the driver ``found`` (``nvidia_driver_version``'s answer) cannot run an image that
    needs driver branch ``minimum`` or newer; None when it can, or when no driver was found
    (a CPU node: torch says so itself when CUDA is asked for)."""
    if found is None:
        return None
    version, where = found
    try:
        branch = _release(version)[0]
    except ValueError:
        return f"NVIDIA driver version {version!r} (from {where}) is not a version"
    if branch >= minimum:
        return None
    reason = (
        "vllm 0.33's compiled ops (_C) and torch are CUDA 13 builds that load "
        "libcudart.so.13, which runs only on R580 and newer drivers"
        if minimum == MIN_DRIVER_FOR_CUDA[13]
        else f"its CUDA runtime runs only on R{minimum} and newer drivers"
    )
    return (
        f"NVIDIA driver {version} (from {where}) is older than R{minimum}, which this image "
        f"needs: {reason}; run the step on nodes with driver {minimum} or newer "
        "(images/README.md, 'Node driver')"
    )


def require_supported_driver(
    environ: Mapping[str, str] | None = None,
    read: Callable[[], tuple[str, str] | None] | None = None,
) -> None:
    """Refuse to start on a node whose driver is older than the image's
    ``LINGO_MIN_NVIDIA_DRIVER``; nothing to check in an image that does not set it.

    Raises:
        ImageCheckError: one line naming the driver, the branch needed and why.
    """
    environ = os.environ if environ is None else environ
    minimum = environ.get(MIN_DRIVER_ENV)
    if not minimum:
        return
    if not minimum.isdigit():
        raise ImageCheckError(f"{MIN_DRIVER_ENV}={minimum!r}: expected a driver branch (580)")
    problem = driver_problem((read or nvidia_driver_version)(), int(minimum))
    if problem:
        raise ImageCheckError(problem)


def transformer_engine_version() -> str | None:
    """The installed Transformer Engine's version (from its package metadata, as pip and
    megatron-core's ``get_te_version`` read it); None when it is not installed."""
    for name in ("transformer-engine", "transformer_engine"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, ...]:
    """``2.8.0+40c69e7`` / ``2.9.0.dev0`` / ``2.10`` → ``(2, 8, 0)`` / ``(2, 9, 0)`` / ``(2, 10)``:
    the release numbers, local and pre-release parts dropped (NGC builds carry a ``+sha``; a
    ``2.9.0`` pre-release already has what 2.8.0 added)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def transformer_engine_problem(softmax_type: str, version: str | None) -> str | None:
    """Why a Transformer Engine ``version`` (None: not installed) cannot build attention with
    ``softmax_type`` (megatron-core's ``vanilla``, ``off-by-one`` or ``learnable``); None
    when it can."""
    if softmax_type == "vanilla" or version is None:
        return None  # plain softmax, or megatron-core's local attention (no TE)
    if _release(version) >= _release(TE_MIN_FOR_SOFTMAX_TYPE):
        return None
    return (
        f"Transformer Engine {version} is older than {TE_MIN_FOR_SOFTMAX_TYPE}, the first "
        f"whose attention takes softmax_type={softmax_type!r} (GPT-OSS's learnable attention "
        "sinks, set by megatron-bridge's GPT-OSS provider; megatron-core 0.19.2 "
        "extensions/transformer_engine.py). Use the project's Megatron image "
        "(images/Dockerfile.megatron checks its TE when it is built) or install "
        f"transformer-engine>={TE_MIN_FOR_SOFTMAX_TYPE}"
    )


def require_transformer_engine(softmax_type: str) -> None:
    """Raise ``ImageCheckError`` when the installed Transformer Engine cannot build attention
    with ``softmax_type``."""
    problem = transformer_engine_problem(softmax_type, transformer_engine_version())
    if problem:
        raise ImageCheckError(problem)


def import_problems(modules: tuple[str, ...] | list[str]) -> list[str]:
    """``module: why`` for each module that does not import (a compiled extension whose
    shared libraries are missing raises ``ImportError`` naming the library)."""
    problems = []
    for module in modules:
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as error:
            problems.append(f"{module}: {error}")
    return problems


def loaded_cuda_runtimes(maps: str | None = None) -> dict[int, list[str]]:
    """The CUDA runtime libraries (``libcudart.so.<major>``) mapped into this process, by
    major version (``maps``: the text of ``/proc/self/maps``, read when None)."""
    if maps is None:
        maps = Path("/proc/self/maps").read_text()
    found: dict[int, list[str]] = {}
    for path in sorted(set(re.findall(r"(/\S*libcudart\.so\.(\d+)\S*)", maps))):
        found.setdefault(int(path[1]), []).append(path[0])
    return found


def cuda_runtime_problem(torch_cuda: str | None, runtimes: dict[int, list[str]]) -> str | None:
    """Why the loaded CUDA runtimes do not agree with torch's CUDA (``torch.version.cuda``;
    None: a CPU torch); None when they agree."""
    if torch_cuda is None:
        return "torch is a CPU build: the GPU image needs a CUDA torch"
    major = int(torch_cuda.split(".")[0])
    others = {m: paths for m, paths in runtimes.items() if m != major}
    if others:
        return (
            f"torch is built for CUDA {torch_cuda}, but CUDA runtimes of another major version "
            f"are loaded: {others}; base image, torch and vLLM must share one CUDA major "
            "(images/README.md)"
        )
    return None


def check_gpu_image() -> list[str]:
    """The GPU image's problems (empty: none): vLLM's compiled ops, their CUDA runtime against
    torch's, and DeepSpeed's op builder against torch's CUDA."""
    import torch

    problems = import_problems(VLLM_COMPILED_OPS)
    runtime = cuda_runtime_problem(torch.version.cuda, loaded_cuda_runtimes())
    if runtime:
        problems.append(runtime)
    from deepspeed.ops.op_builder.builder import (
        CUDAMismatchException,
        MissingCUDAException,
        assert_no_cuda_mismatch,
    )

    try:  # what every CUDA op build runs first (OpBuilder.builder), with no GPU needed
        assert_no_cuda_mismatch("lingo-rl GPU image")
    except (CUDAMismatchException, MissingCUDAException) as error:
        problems.append(f"DeepSpeed's op builder: {error}")
    return problems


MEGATRON_COMPILED_OPS = ("fast_hadamard_transform",)
"""Compiled extensions the Megatron image builds itself: fast-hadamard-transform's CUDA op
(megatron-bridge 0.6.2 requires it; its sdist is built against the image's torch)."""


def check_megatron_image() -> list[str]:
    """The Megatron image's problems (empty: none): a Transformer Engine with learnable
    attention sinks (the image's GPU attention for GPT-OSS), and the extensions it built
    import against its torch."""
    problems = import_problems(MEGATRON_COMPILED_OPS)
    version = transformer_engine_version()
    if version is None:
        problems.append(
            "Transformer Engine is not installed: the Megatron image runs GPT-OSS with it"
        )
    elif problem := transformer_engine_problem("learnable", version):
        problems.append(problem)
    return problems


def check_node_driver() -> list[str]:
    """The node's driver against this image's ``LINGO_MIN_NVIDIA_DRIVER`` (empty: fine)."""
    try:
        require_supported_driver()
    except ImageCheckError as error:
        return [str(error)]
    return []


CHECKS = {"gpu": check_gpu_image, "megatron": check_megatron_image, "driver": check_node_driver}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check an image's software stack.")
    parser.add_argument("image", choices=sorted(CHECKS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    problems = CHECKS[args.image]()
    for problem in problems:
        log.error("image check %s: %s", args.image, problem)
    if problems:
        return 1
    log.info("image check %s: passed", args.image)
    return 0


if __name__ == "__main__":
    sys.exit(main())
