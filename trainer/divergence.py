"""The divergence guard: a training step whose result is not finite, whose loss spikes or
falls back to a uniform guess, or whose gradients have vanished, stops the run before anything
is saved from it.

A diverging learning rate can leave the loss finite for the step that breaks the model (the
loss is computed before the update), so the guard checks what the update produced: the loss,
the gradient norm, and the updated weights. It runs after every optimizer step and before any
checkpoint, best-policy save, merge or export, so no saved state is non-finite; its counters
travel with the checkpoints, so a resumed run carries on counting.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.backends.interface import NonFiniteLossError
from trainer.checkpoint import latest_checkpoint, list_checkpoints
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
                yield _partition(param) if hasattr(param, "ds_tensor") else param


def _partition(param) -> torch.Tensor:
    """The weights a ZeRO-3 partition holds, without its padding. DeepSpeed gives every rank a
    partition of ``ceil(numel / ranks)`` elements made with ``torch.empty`` and copies in only
    the weights that fall in it (``partition_parameters.py``, ``_partition_param``): the last
    ranks' tails, and a small tensor's whole partition on ranks past its end, are
    uninitialized memory, which may hold anything (NaN included)."""
    tensor = param.ds_tensor
    size = tensor.numel()
    group = getattr(param, "ds_process_group", None)
    rank = dist.get_rank(group=group) if dist.is_available() and dist.is_initialized() else 0
    held = max(0, min(size, int(param.ds_numel) - rank * size))
    return tensor.narrow(0, 0, held) if tensor.dim() == 1 else tensor


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


@dataclass
class _Verdict:
    """What went wrong at a step, and the first step whose weights were already bad."""

    problem: str
    bad_from: int
    """Checkpoints from this step on hold bad weights: a loss or gradient computed at step t
    is that of the weights after step t - 1; an update that broke the weights, of step t."""


class DivergenceGuard:
    """Checks each optimizer step's outcome; raises ``TrainingDivergedError`` when it diverged.

    What it watches, and when it fails:

    - the loss, the gradient norm or the updated weights are not finite;
    - a cross-entropy loss (``uniform_loss`` given: SFT) above the uniform guess ln V that
      is ``max_loss_spike`` times its running average (the average of the sane steps so far,
      ln V before the first): the update before it blew the model up;
    - a cross-entropy loss back at or above ln V after its running average fell below
      ln V / 2: the model forgot what it learned and guesses uniformly;
    - the gradient norm is 0 for ``max_zero_grad_steps`` steps in a row (steps without
      learning signal, e.g. GRPO groups with equal rewards, neither count nor reset), or
      once with a loss of exactly ln V (the model outputs the uniform distribution).

    Its counters are the run's, not the process's: ``state_dict`` goes into every checkpoint
    and ``load_state_dict`` restores it on resume. A checkpoint saved while the gradient is
    0 is recorded as not healthy, and resume refuses it (``trainer.checkpoint``). On failure
    the checkpoints whose weights were already bad are set aside (renamed
    ``.diverged-step-N``, kept for inspection), so the message names the true last good
    checkpoint and a rerun in the same work directory resumes from it.

    Args:
        step_name: the pipeline step, for the message (``SFT``, ``GRPO``).
        checkpoints: the run's checkpoint directory, to name the last good checkpoint.
        info: this process's place in the job (the weight check is summed over ranks, so
            every rank decides the same).
        max_zero_grad_steps: fail when the gradient norm is 0 this many steps in a row; 0
            never fails for it.
        uniform_loss: ln(vocabulary size) when the loss is a token cross-entropy (SFT);
            ``None`` (GRPO's policy loss) leaves the loss checks to finiteness.
        max_loss_spike: the factor over the running average that is a spike; 0: off.
    """

    def __init__(
        self,
        step_name: str,
        checkpoints: Path,
        info: DistInfo,
        max_zero_grad_steps: int,
        uniform_loss: float | None = None,
        max_loss_spike: float = 0.0,
    ) -> None:
        self.step_name = step_name
        self.checkpoints = checkpoints
        self.info = info
        self.max_zero_grad_steps = max_zero_grad_steps
        self.uniform_loss = uniform_loss
        self.max_loss_spike = max_loss_spike
        self.zero_grad_steps = 0
        self.zero_grad_since: int | None = None
        """The first step of the current run of zero gradients."""
        self.loss_average: float | None = None
        """Running average of the sane steps' losses (cross-entropy only)."""
        self.last: dict[str, float] = {}

    def state_dict(self) -> dict:
        """The counters a checkpoint keeps (JSON), with whether its weights look healthy."""
        healthy = self.zero_grad_steps == 0 or not self.max_zero_grad_steps
        return {
            "healthy": healthy,
            "problem": None
            if healthy
            else (
                f"it was saved while the gradient norm was 0 ({self.zero_grad_steps} step(s) "
                f"in a row since step {self.zero_grad_since}): its weights are saturated"
            ),
            "bad_from": None if healthy else self.zero_grad_since - 1,
            "zero_grad_steps": self.zero_grad_steps,
            "zero_grad_since": self.zero_grad_since,
            "loss_average": self.loss_average,
            "last": self.last,
        }

    def load_state_dict(self, state: dict) -> None:
        """Carry on the counters of the checkpoint a run resumes from."""
        self.zero_grad_steps = int(state.get("zero_grad_steps", 0))
        self.zero_grad_since = state.get("zero_grad_since")
        self.loss_average = state.get("loss_average")

    def check(self, step: int, loss: float, grad_norm: float, module, signal: bool = True) -> None:
        """Check optimizer step ``step`` (1-based); ``module`` is the backend's module."""
        self.last = {"step": step, "loss": loss, "grad_norm": grad_norm}
        verdict = None
        if not math.isfinite(loss):
            verdict = _Verdict(f"the loss is {loss}", step - 1)
        elif not math.isfinite(grad_norm):
            verdict = _Verdict(f"the gradient norm is {grad_norm}", step - 1)
        elif not math.isfinite(all_reduce_sum(weights_square_sum(module), self.info)):
            verdict = _Verdict(
                "the updated weights are not finite (or too large to square in float32)", step
            )
        else:
            verdict = self._loss_verdict(step, loss)
        if verdict is None and signal:
            verdict = self._zero_grad_verdict(step, loss, grad_norm)
        if verdict is None:
            if self.uniform_loss is not None:
                average = self.loss_average
                self.loss_average = loss if average is None else 0.9 * average + 0.1 * loss
            return
        raise TrainingDivergedError(self._message(step, verdict))

    def _loss_verdict(self, step: int, loss: float) -> _Verdict | None:
        uniform = self.uniform_loss
        if uniform is None:
            return None
        average = self.loss_average if self.loss_average is not None else uniform
        if self.max_loss_spike and loss > uniform and loss > self.max_loss_spike * average:
            return _Verdict(
                f"the loss {loss:.4g} is {loss / average:.3g}× its running average "
                f"{average:.4g} (optim.max_loss_spike {self.max_loss_spike:g} sets the factor)",
                step - 1,
            )
        if self.loss_average is not None and self.loss_average <= uniform / 2 and loss >= uniform:
            return _Verdict(
                f"the loss {loss:.4g} is back at or above ln(vocabulary) = {uniform:.4f}, a "
                f"uniform guess, after its running average fell to {self.loss_average:.4g}",
                step - 1,
            )
        return None

    def _zero_grad_verdict(self, step: int, loss: float, grad_norm: float) -> _Verdict | None:
        if grad_norm > ZERO_GRAD_NORM:
            self.zero_grad_steps, self.zero_grad_since = 0, None
            return None
        self.zero_grad_steps += 1
        if self.zero_grad_since is None:
            self.zero_grad_since = step
        bad_from = self.zero_grad_since - 1
        uniform = self.uniform_loss
        if uniform is not None and abs(loss - uniform) <= 1e-4 * uniform:
            return _Verdict(
                f"the model outputs the uniform distribution (loss {loss:.4f} = ln(vocabulary), "
                "gradient norm 0)",
                bad_from,
            )
        if self.max_zero_grad_steps and self.zero_grad_steps >= self.max_zero_grad_steps:
            return _Verdict(
                f"the gradient norm has been 0 for {self.zero_grad_steps} steps in a row (the "
                "model saturated; optim.max_zero_grad_steps sets how many)",
                bad_from,
            )
        return None

    def _message(self, step: int, verdict: _Verdict) -> str:
        aside = set_aside_from(self.checkpoints, verdict.bad_from) if self.info.is_main else []
        set_aside = (
            f"the checkpoints from step {verdict.bad_from} on held weights already bad and are "
            f"set aside ({', '.join(p.name for p in aside)}, kept for inspection); "
            if aside
            else ""
        )
        last = latest_checkpoint(self.checkpoints)
        where = (
            f"the last good checkpoint is {last} (a rerun in the same work directory resumes "
            "from it)"
            if last
            else f"no good checkpoint is left in {self.checkpoints} (a rerun starts over)"
        )
        return (
            f"{self.step_name} diverged at step {step}: {verdict.problem}. Nothing from this "
            f"step was saved; {set_aside}{where}. Lower optim.learning_rate (or check the "
            "data) and rerun."
        )


def set_aside_from(checkpoints: Path, first_bad: int) -> list[Path]:
    """Rename the checkpoints of steps ``first_bad`` and later to ``.diverged-step-N``."""
    moved = []
    for number, directory in list_checkpoints(checkpoints):
        if number >= first_bad:
            aside = directory.with_name(f".diverged-{directory.name}")
            if aside.exists():
                shutil.rmtree(aside)  # an earlier divergence's, of the same step
            os.replace(directory, aside)
            moved.append(aside)
    return moved
