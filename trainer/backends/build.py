"""Building a step's training backend: ``make_backend`` picks one from ``BACKENDS`` by
``OptimConfig.backend``; ``build_backend`` also loads the model it trains (partitioned under
DeepSpeed ZeRO-3: ``trainer.backends.loading``) and returns the Hugging Face policy an
in-process rollout engine samples with (wrapped by ``BackendRequest.adapt``: LoRA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.backends.config import OptimConfig
from trainer.backends.deepspeed import DeepSpeedBackend
from trainer.backends.interface import TrainingBackend
from trainer.backends.loading import load_training_model
from trainer.backends.torch import TorchBackend
from trainer.distributed import DistInfo


@dataclass(frozen=True)
class BackendRequest:
    """What a step asks of its training backend."""

    model_dir: str | Path
    """The Hugging Face model it starts from."""
    optim: OptimConfig
    dtype: torch.dtype
    info: DistInfo
    total_steps: int
    """Optimizer steps of the run (the LR schedule's length)."""
    micro_batch_size: int
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step on each data-parallel replica (DeepSpeed's)."""
    gradient_checkpointing: bool = False
    with_reference: bool = False
    """Keep the starting model, frozen, for KL (``log_probs(..., reference=True)``)."""
    seed: int = 0
    pad_id: int = 0
    adapt: Callable[[torch.nn.Module], torch.nn.Module] | None = None
    """Wraps the loaded module before the backend is built (LoRA GRPO: a peft adapter, the
    base frozen, so the optimizer holds the adapter alone); None: trained as loaded."""


@dataclass(frozen=True)
class _Built:
    """What ``make_backend`` hands a ``BACKENDS`` entry."""

    model: torch.nn.Module | None
    cfg: OptimConfig
    total_steps: int
    info: DistInfo
    micro_batch_size: int
    gradient_accumulation_steps: int
    bf16: bool
    with_reference: bool
    hf_dir: str | Path | None
    ds_config: dict | None
    seed: int
    pad_id: int


def _torch(b: _Built) -> TrainingBackend:
    if b.info.world_size > 1:
        raise ValueError(
            f"backend 'torch' runs one process, but {b.info.world_size} were launched; "
            "use backend 'deepspeed' for several processes"
        )
    return TorchBackend(b.model, b.cfg, b.total_steps, with_reference=b.with_reference)


def _deepspeed(b: _Built) -> TrainingBackend:
    return DeepSpeedBackend(
        b.model,
        b.cfg,
        b.total_steps,
        b.info,
        b.micro_batch_size,
        b.gradient_accumulation_steps,
        b.bf16,
        with_reference=b.with_reference,
        ds_config=b.ds_config,
        reference_dir=b.hf_dir,
    )


def _megatron(b: _Built) -> TrainingBackend:
    """Megatron builds its own actor (and reference) from ``cfg.megatron.checkpoint`` with
    ``hf_dir``'s config; the HF ``model`` is not trained here (frozen: a rollout copy)."""
    if b.hf_dir is None:
        raise ValueError(
            "backend 'megatron' needs the Hugging Face model directory (hf_dir) for its "
            "config and tokenizer; it runs in the GRPO step only"
        )
    from trainer.megatron.build import build_megatron_backend

    backend = build_megatron_backend(
        b.cfg, b.total_steps, b.info, b.hf_dir, b.with_reference, b.seed, b.pad_id
    )
    if b.model is not None:
        b.model.requires_grad_(False)
    return backend


BACKENDS: dict[str, Callable[[_Built], TrainingBackend]] = {
    "torch": _torch,
    "deepspeed": _deepspeed,
    "megatron": _megatron,
}
"""The training backends by ``OptimConfig.backend``."""


def make_backend(
    model: torch.nn.Module | None,
    cfg: OptimConfig,
    total_steps: int,
    dist_info: DistInfo,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    bf16: bool = False,
    *,
    with_reference: bool = False,
    hf_dir: str | Path | None = None,
    ds_config: dict | None = None,
    seed: int = 0,
    pad_id: int = 0,
) -> TrainingBackend:
    """The backend named by ``cfg.backend`` (``BACKENDS``).

    ``with_reference``: also keep the starting model, frozen, for KL (``log_probs(...,
    reference=True)``): a copy of ``model``, or under DeepSpeed ZeRO-3 loaded partitioned from
    ``hf_dir``. ``ds_config``: DeepSpeed's configuration when the caller built ``model`` with
    it (``deepspeed_config``). Megatron builds its own actor (and reference) from
    ``cfg.megatron.checkpoint`` with ``hf_dir``'s config; ``model`` is not trained there.
    """
    built = _Built(
        model,
        cfg,
        total_steps,
        dist_info,
        micro_batch_size,
        gradient_accumulation_steps,
        bf16,
        with_reference,
        hf_dir,
        ds_config,
        seed,
        pad_id,
    )
    return BACKENDS[cfg.backend](built)


def build_backend(request: BackendRequest) -> tuple[TrainingBackend, torch.nn.Module]:
    """The training backend of ``request`` and the Hugging Face policy it was built from: the
    module it trains (DeepSpeed, torch), or a frozen copy of the starting model (Megatron,
    which trains its own), for an in-process engine to sample with. Under ZeRO-3 the policy is
    built partitioned (no rank ever holds the whole model) and the backend says that a forward
    of it is collective (``TrainingBackend.forward_is_collective``). Collective: every rank
    calls it."""
    r = request
    policy, ds_config = load_training_model(
        r.model_dir, r.dtype, r.optim, r.info, r.micro_batch_size, r.gradient_accumulation_steps
    )
    if r.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    if r.adapt is not None:
        policy = r.adapt(policy)
    backend = make_backend(
        policy,
        r.optim,
        r.total_steps,
        r.info,
        r.micro_batch_size,
        r.gradient_accumulation_steps,
        bf16=r.dtype == torch.bfloat16,
        with_reference=r.with_reference,
        hf_dir=r.model_dir,
        ds_config=ds_config,
        seed=r.seed,
        pad_id=r.pad_id,
    )
    return backend, policy
