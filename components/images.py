"""Container images of the components: the one place they are named.

Override at compile time with the environment variables ``LINGO_CPU_IMAGE``,
``LINGO_GPU_IMAGE`` and ``LINGO_MEGATRON_IMAGE`` (read when ``components`` is first imported,
i.e. before compiling).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lingo-rl")
except PackageNotFoundError:  # a source tree that was not pip-installed
    __version__ = "0.0.0+unknown"

CPU_IMAGE = os.environ.get("LINGO_CPU_IMAGE", f"ghcr.io/lingo-rl/lingo-rl-cpu:{__version__}")
"""Data prep, eval and orchestration steps."""

GPU_IMAGE = os.environ.get("LINGO_GPU_IMAGE", f"ghcr.io/lingo-rl/lingo-rl-gpu:{__version__}")
"""SFT and GRPO steps (CUDA torch, DeepSpeed, vLLM)."""

MEGATRON_IMAGE = os.environ.get(
    "LINGO_MEGATRON_IMAGE", f"ghcr.io/lingo-rl/lingo-rl-megatron:{__version__}"
)
"""The Megatron branch: conversion, GRPO on Megatron-Core, export (Python 3.12, TE)."""

TRAINER_IMAGES = {"gpu": GPU_IMAGE, "megatron": MEGATRON_IMAGE}
"""The image a trainer backend's processes run in, by ``plan.TrainerSpec.image``."""
