"""The single-process backend: plain PyTorch AdamW on CPU or one GPU; and the micro-batch
loop every backend that trains a Hugging Face module shares (``HFModuleBackend``)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from trainer.backends.config import OptimConfig
from trainer.backends.interface import DataParallel, LossFn, ResponseBatch
from trainer.backends.schedule import optimizer_factory, rebase_schedule, scheduler_factory


class HFModuleBackend:
    """What the backends that train a Hugging Face module (``self.module``, with
    ``self.reference`` when KL is on) share: the plain micro-batch loop and log-probs."""

    module: torch.nn.Module
    reference: torch.nn.Module | None

    def forward_backward(
        self, micro_batches: Sequence[ResponseBatch], loss_fn: LossFn
    ) -> list[dict[str, float]]:
        """Each micro-batch's forward on the HF module, its loss, its backward."""
        stats = []
        for k, micro in enumerate(micro_batches):
            log_probs, entropy = micro.hf_log_probs(self.module, True)
            loss, micro_stats = loss_fn(k, log_probs, entropy)
            self.backward(loss)
            stats.append(micro_stats)
        return stats

    @torch.no_grad()
    def log_probs(
        self, micro_batches: Sequence[ResponseBatch], reference: bool = False
    ) -> list[torch.Tensor]:
        if reference and self.reference is None and is_peft(self.unwrapped()):
            # LoRA: the reference is the frozen base itself, with the adapter switched off
            with self.unwrapped().disable_adapter():
                return [micro.hf_log_probs(self.module, False)[0] for micro in micro_batches]
        module = self.reference if reference else self.module
        return [micro.hf_log_probs(module, False)[0] for micro in micro_batches]

    def save_policy(self, directory: Path, base_model: str | Path, dtype) -> None:
        """The policy as a Hugging Face directory (``save_hf_pretrained``)."""
        self.save_hf_pretrained(directory, base_model, dtype)


def is_peft(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a peft model (a LoRA adapter on a frozen base)."""
    return hasattr(module, "peft_config")


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference model: the starting policy, frozen (taken before any partitioning)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def reference_copy(model: torch.nn.Module, with_reference: bool) -> torch.nn.Module | None:
    """The KL reference a backend keeps beside ``model``: a frozen copy, or None without KL
    and under LoRA, whose starting policy is its frozen base (the adapter's ``B`` starts at
    zero; ``modules_to_save`` keep their originals): ``log_probs(..., reference=True)`` then
    runs the base with the adapter switched off, and no second model is held."""
    if not with_reference or is_peft(model):
        return None
    return frozen_copy(model)


class TorchBackend(HFModuleBackend):
    """Single process (CPU or one GPU), plain PyTorch AdamW."""

    forward_is_collective = False

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        total_steps: int,
        with_reference: bool = False,
    ) -> None:
        self.module = model
        self.cfg = cfg
        self.reference = reference_copy(model, with_reference)
        device = next(model.parameters()).device
        self.data_parallel = DataParallel(0, 1, device)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer_factory(cfg)(params)
        self.scheduler = scheduler_factory(cfg, total_steps)(self.optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def save_checkpoint(self, directory: Path) -> None:
        trainable = {
            n: p.detach().cpu() for n, p in self.module.named_parameters() if p.requires_grad
        }
        torch.save(
            {
                "trainable": trainable,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            },
            directory / "backend.pt",
        )

    def load_checkpoint(self, directory: Path) -> None:
        state = torch.load(directory / "backend.pt", map_location="cpu", weights_only=False)
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, value in state["trainable"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def set_base_learning_rate(self, learning_rate: float) -> None:
        rebase_schedule(self.optimizer, self.scheduler, learning_rate)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def hf_weights(self, trainable_only: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
        return (
            (n, p.detach())
            for n, p in self.module.named_parameters()
            if p.requires_grad or not trainable_only
        )

    def save_hf_pretrained(self, directory: Path, base_model: str | Path, dtype) -> None:
        """The model's directory; a peft model (LoRA) writes its adapter alone."""
        self.module.save_pretrained(directory)

    def unwrapped(self) -> torch.nn.Module:
        return self.module

    def close(self) -> None:
        """Nothing to release."""
