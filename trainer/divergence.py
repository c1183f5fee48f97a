"""The divergence guard: a training step whose result is not finite, or whose gradients have
vanished for several steps, stops the run before anything is saved from it.

A diverging learning rate can leave the loss finite for the step that breaks the model (the
loss is computed before the update), so the guard checks what the update produced: the loss,
the gradient norm, and the updated weights. It runs after every optimizer step and before any
checkpoint, best-policy save, merge or export, so no saved state is non-finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from trainer.backends.interface import NonFiniteLossError
from trainer.checkpoint import latest_checkpoint
from trainer.distributed import DistInfo, all_reduce_sum

ZERO_GRAD_NORM = 1e-12
"""A gradient norm at or below this counts as vanished (a saturated model gives exactly 0)."""


class TrainingDivergedError(NonFiniteLossError):
    """The run diverged; nothing from the failing step was saved."""


def _local_trainable(module) -> Iterator[torch.Tensor]:
    """This rank's share of the trainable weights (ZeRO-3: its partition; Megatron: its
    chunks' shards)."""
    modules = module if isinstance(module, list | tuple) else [module]
    for chunk in modules:
        for param in chunk.parameters():
            if param.requires_grad:
                yield getattr(param, "ds_tensor", param)


def weights_square_sum(module) -> float:
    """Σ w² over this rank's trainable weights, accumulated in float32.

    Not finite when any weight is NaN or infinite, or so large (|w| ≳ 1.8e19) that its square
    overflows float32: such a model cannot give finite activations.
    """
    total = torch.zeros((), dtype=torch.float32)
    for tensor in _local_trainable(module):
        if tensor.numel():
            total = total + torch.sum(torch.square(tensor.detach()), dtype=torch.float32).cpu()
    return float(total)


class DivergenceGuard:
    """Checks each optimizer step's outcome; raises ``TrainingDivergedError`` when it diverged.

    Args:
        step_name: the pipeline step, for the message (``SFT``, ``GRPO``).
        checkpoints: the run's checkpoint directory, to name the last good checkpoint.
        info: this process's place in the job (the weight check is summed over ranks, so
            every rank decides the same).
        max_zero_grad_steps: fail when the gradient norm is 0 this many steps in a row
            (steps without learning signal, e.g. GRPO groups with equal rewards, do not
            count); 0 never fails for it.
    """

    def __init__(
        self, step_name: str, checkpoints: Path, info: DistInfo, max_zero_grad_steps: int
    ) -> None:
        self.step_name = step_name
        self.checkpoints = checkpoints
        self.info = info
        self.max_zero_grad_steps = max_zero_grad_steps
        self.zero_grad_steps = 0

    def check(self, step: int, loss: float, grad_norm: float, module, signal: bool = True) -> None:
        """Check optimizer step ``step`` (1-based); ``module`` is the backend's module."""
        problem = None
        if not math.isfinite(loss):
            problem = f"the loss is {loss}"
        elif not math.isfinite(grad_norm):
            problem = f"the gradient norm is {grad_norm}"
        elif not math.isfinite(all_reduce_sum(weights_square_sum(module), self.info)):
            problem = "the updated weights are not finite (or too large to square in float32)"
        elif signal:
            self.zero_grad_steps = self.zero_grad_steps + 1 if grad_norm <= ZERO_GRAD_NORM else 0
            if self.max_zero_grad_steps and self.zero_grad_steps >= self.max_zero_grad_steps:
                problem = (
                    f"the gradient norm has been 0 for {self.zero_grad_steps} steps in a row "
                    "(the model saturated; optim.max_zero_grad_steps sets how many)"
                )
        if problem is None:
            return
        last = latest_checkpoint(self.checkpoints)
        where = (
            f"the last good checkpoint is {last} (a rerun in the same work directory resumes "
            "from it)"
            if last
            else f"no checkpoint was written yet in {self.checkpoints}"
        )
        raise TrainingDivergedError(
            f"{self.step_name} diverged at step {step}: {problem}. Nothing from this step was "
            f"saved; {where}. Lower optim.learning_rate (or check the data) and rerun."
        )
