"""What every check of ``bench/gpu_check.py`` shares: the sizes it runs at, its outcome
exceptions and its time limits. Only the standard library is imported."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class CheckFailed(AssertionError):
    """A check ran and its result is outside its bounds."""


class CheckSkipped(RuntimeError):
    """A check cannot run here; the runner reports it as a FAIL, never as fine."""


class DryRunSkip(CheckSkipped):
    """A check that cannot run in the CPU dry run, saying why: the dry run reports it as
    ``SKIP name … skipped: <why>``; with ``--device cuda`` it is a FAIL like any skip."""


class NeedsCuda(DryRunSkip):
    """The check's library cannot run on a CPU (NCCL, vLLM's CUDA graphs)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"needs CUDA ({what})")


class NeedsMegatronEnv(DryRunSkip):
    """The check runs in the Megatron env only (``--megatron-python``), which is not here."""

    def __init__(self, what: str) -> None:
        super().__init__(f"needs the Megatron env ({what})")


@dataclass(frozen=True)
class Sizes:
    """How big each check runs: the full run on a GPU, or the dry run's tiny shapes."""

    device: str
    dry_run: bool
    sft_steps: int
    grpo_steps: int
    planner_model: str
    """A ``capacity`` model preset whose layer shapes the planner check builds."""
    planner_layers: int
    prompt_len: int
    generate_len: int
    micro_batch: int
    rollout_prompts: int
    rollout_samples: int
    rollout_new_tokens: int
    dtype: str
    """Training dtype of the SFT, GRPO and DeepSpeed checks: bf16 on the GPU; the dry run
    trains in fp32 (bf16 matmuls on a CPU without bf16 units run ~100× slower)."""

    @classmethod
    def for_run(cls, dry_run: bool, device: str) -> Sizes:
        if dry_run:
            return cls(device, True, 2, 1, "tiny-gpt-oss", 2, 32, 32, 2, 2, 2, 8, "float32")
        return cls(device, False, 4, 2, "gpt-oss-20b", 2, 1024, 1024, 1, 8, 4, 128, "bfloat16")


@dataclass(frozen=True)
class Check:
    """A check and its time limits (seconds) in the full run and in the dry run."""

    run: Callable[[Sizes, Path], dict]
    full_limit_s: float
    dry_limit_s: float
    env: str = "main"
    """Its Python: ``main`` (the script's own) or ``megatron`` (``--megatron-python``)."""

    def limit_s(self, dry_run: bool) -> float:
        return self.dry_limit_s if dry_run else self.full_limit_s


def finite(values, what: str) -> None:
    """Raise ``CheckFailed`` naming ``what`` unless every value is a finite number."""
    bad = [v for v in values if not isinstance(v, int | float) or not math.isfinite(v)]
    if bad:
        raise CheckFailed(f"{what}: not finite: {bad[:3]}")
