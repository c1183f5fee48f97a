"""What a training loop needs from a backend (``TrainingBackend``), the micro-batches GRPO
hands it (``ResponseBatch``, with the ``LossFn`` it calls on them), and this rank's place
among the data-parallel replicas (``DataParallel``).

A training loop computes a micro-batch loss already normalized for the **whole global batch**
(e.g. summed token losses / tokens in the global batch, over every micro-batch and rank).
Backends make the gradients the plain sum of those contributions, whatever the accumulation and
data parallelism (DeepSpeed averages over ranks and scales by 1/gradient_accumulation_steps,
Megatron divides by the number of micro-batches and averages over data-parallel ranks; each
backend undoes its own), so a run on N processes follows the single-process run for the same
global batch.

Two ways to drive a backend:

- SFT calls ``module`` for each micro-batch, ``backward`` on its loss, and ``step`` once per
  optimizer step (plain PyTorch and DeepSpeed);
- GRPO hands the backend a whole mini-batch of micro-batches (``ResponseBatch``) and a loss
  function: ``forward_backward(micro_batches, loss_fn)`` runs the policy's forward on each,
  calls ``loss_fn(k, log_probs, entropy)`` and back-propagates, then the loop calls ``step``.
  The backend owns the forward, so Megatron can run it through its pipeline schedule (with
  pipeline parallelism no stage can call the whole model), while PyTorch and DeepSpeed run
  the plain loop over ``ResponseBatch.hf_log_probs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainer.distributed import all_reduce_number


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; the last checkpoint is left as it was."""


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among the data-parallel replicas (ranks that see different data).

    With plain PyTorch and DeepSpeed every process is a replica; with Megatron only the ranks
    of one data-parallel group are (the tensor/pipeline/expert-parallel ranks of a replica see
    the same micro-batches). Loss normalizers and metrics are summed over these replicas.
    """

    rank: int
    size: int
    device: torch.device
    group: Any = None
    """``torch.distributed`` process group; ``None``: the whole world."""

    def all_reduce_sum(self, value: float) -> float:
        """Sum a number over the replicas (itself when there is one)."""
        return all_reduce_number(value, dist.ReduceOp.SUM, self.size, self.device, self.group)

    def all_reduce_max(self, value: float) -> float:
        """The largest of a number over the replicas (itself when there is one)."""
        return all_reduce_number(value, dist.ReduceOp.MAX, self.size, self.device, self.group)


class ResponseBatch(Protocol):
    """A micro-batch of prompt + response rows as the GRPO loop lays it out
    (``trainer.grpo.micro_batch.Micro``): rows right-aligned, so every response ends in the last
    column, and per-token values come back as ``[B, width]`` aligned with ``mask``."""

    ids: torch.Tensor
    """``[B, T]`` token ids, left-padded."""
    attention: torch.Tensor
    """``[B, T]`` 1 on real tokens."""
    mask: torch.Tensor
    """``[B, width]`` 1 on the response tokens."""
    temperature: float
    """The log-probs and entropies are those of ``softmax(logits / temperature)``, the
    distribution the rollout engine sampled from (1: the raw logits)."""

    def hf_log_probs(
        self, module: torch.nn.Module, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, width]`` response log-probs (and entropies) from a Hugging Face causal LM."""
        ...


LossFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
"""``loss_fn(k, log_probs, entropy) -> (loss, stats)`` for micro-batch ``k`` of a
``forward_backward`` call: ``log_probs`` / ``entropy`` are ``[B, width]`` (with gradients),
``loss`` is this micro-batch's share of the global loss, ``stats`` plain floats."""


class TrainingBackend(Protocol):
    """What a training loop needs from a backend."""

    module: Any
    """Call it for forward passes (it may be a wrapper, e.g. a DeepSpeed engine); Megatron's
    is its list of model chunks, driven only through ``forward_backward`` / ``log_probs``."""
    data_parallel: DataParallel
    forward_is_collective: bool
    """Whether a forward of ``unwrapped()`` needs every rank (ZeRO-3 over several processes
    gathers each layer's parameters from all of them): an engine sampling with it must step
    in lockstep (``HFRolloutEngine(lockstep=True)``)."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def forward_backward(
        self, micro_batches: Sequence[ResponseBatch], loss_fn: LossFn
    ) -> list[dict[str, float]]:
        """Forward each micro-batch, ``loss_fn`` on its log-probs, backward; the gradients of
        every micro-batch accumulate. Call once per optimizer step (Megatron reduces the
        gradients over data-parallel ranks at the end of the call). Returns each micro-batch's
        ``stats``, on every rank."""
        ...

    def log_probs(
        self, micro_batches: Sequence[ResponseBatch], reference: bool = False
    ) -> list[torch.Tensor]:
        """``[B, width]`` response log-probs of each micro-batch, without gradients, under the
        policy or (``reference=True``) the frozen reference model."""
        ...

    def step(self) -> float:
        """Clip, update, advance the LR schedule, zero the grads; returns the grad norm."""
        ...

    def learning_rate(self) -> float: ...

    def save_checkpoint(self, directory: Path) -> None: ...

    def load_checkpoint(self, directory: Path) -> None: ...

    def set_base_learning_rate(self, learning_rate: float) -> None:
        """After ``load_checkpoint``: go on with the schedule from ``learning_rate`` (a resume
        with a changed ``optim.learning_rate``)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The complete model weights on rank 0 (gathered for ZeRO-3); None on other ranks."""
        ...

    def hf_weights(self, trainable_only: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy's weights under Hugging Face names, one tensor at a time, on every rank
        (for a rollout engine's ``sync_weights``); ``trainable_only``: only those the update
        changes (LoRA GRPO: the adapter's, under peft's names). Collective: every rank
        iterates it."""
        ...

    def save_hf_pretrained(self, directory: Path, base_model: str | Path, dtype) -> None:
        """Write the policy's weights and config as a Hugging Face directory into
        ``directory`` (global rank 0 writes; collective)."""
        ...

    def save_policy(self, directory: Path, base_model: str | Path, dtype) -> None:
        """Write the trained policy as the step's model output into ``directory``: a Hugging
        Face directory (``save_hf_pretrained``) or, Megatron, its own ``torch_dist``
        checkpoint, which the pipeline's ``export_hf`` step turns into one. Collective."""
        ...

    def unwrapped(self) -> torch.nn.Module: ...

    def close(self) -> None:
        """Release what the backend set up (Megatron's parallel state)."""
        ...
