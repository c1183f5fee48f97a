"""The learning-rate schedule (warmup, then constant / linear / cosine) and the AdamW
optimizer the PyTorch and DeepSpeed backends build from an ``OptimConfig``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from trainer.backends.config import OptimConfig


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning-rate multiplier at ``step`` (0-based optimizer step).

    Linear warmup over ``warmup_steps`` from 1/warmup to 1; then ``constant`` (1),
    ``linear`` (1 → min_lr_ratio) or ``cosine`` (min + (1 − min)·½(1 + cos(π·progress))) to the end.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_scheduler == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def optimizer_factory(cfg: OptimConfig) -> Callable[[object], torch.optim.Optimizer]:
    def make(params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params, lr=cfg.learning_rate, betas=cfg.betas, weight_decay=cfg.weight_decay
        )

    return make


def scheduler_factory(cfg: OptimConfig, total_steps: int):
    def make(optimizer: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total_steps, cfg)
        )

    return make


def rebase_schedule(optimizer, scheduler, learning_rate: float) -> None:
    """Continue a ``LambdaLR`` schedule (restored from a checkpoint) from a new base rate.

    A checkpoint restores the rate it was made with; a resume with another
    ``optim.learning_rate`` calls this so that the schedule goes on from the new one.
    """
    scheduler.base_lrs = [learning_rate for _ in scheduler.base_lrs]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
