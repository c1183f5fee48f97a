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

The version rules here are facts of the pinned wheels; ``tests/pipelines/test_image_versions.py``
holds the Dockerfiles and constraint files to them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
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


def check_megatron_image() -> list[str]:
    """The Megatron image's problems (empty: none): a Transformer Engine with learnable
    attention sinks (the image's GPU attention for GPT-OSS)."""
    version = transformer_engine_version()
    if version is None:
        return ["Transformer Engine is not installed: the Megatron image runs GPT-OSS with it"]
    problem = transformer_engine_problem("learnable", version)
    return [problem] if problem else []


CHECKS = {"gpu": check_gpu_image, "megatron": check_megatron_image}


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
