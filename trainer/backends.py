"""Training backends behind one small interface: plain PyTorch, and DeepSpeed ZeRO-0/1/2/3.

A training loop computes a micro-batch loss already normalized for the **whole global batch**
(e.g. summed token losses / tokens in the global batch, over every micro-batch and rank), calls
``backward`` for each micro-batch and ``step`` once per optimizer step. Backends make the
gradients the plain sum of those contributions, whatever the accumulation and data parallelism
(DeepSpeed averages over ranks and scales by 1/gradient_accumulation_steps; we undo both), so a
run on N processes follows the single-process run for the same global batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from trainer.distributed import DistInfo

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; the last checkpoint is left as it was."""


class OptimConfig(BaseModel):
    """Optimizer, schedule and backend settings shared by SFT and GRPO."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["torch", "deepspeed"] = "torch"
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(1.0, gt=0)
    zero_stage: Literal[0, 1, 2, 3] = 3
    offload_optimizer: bool = False
    offload_params: bool = False


class ProcessSettings(BaseModel):
    """How a training step runs its processes; shared by the SFT and GRPO configs."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """``auto``: bf16 on a GPU that supports it, else fp32."""
    gradient_checkpointing: bool = False
    seed: int = 42
    nproc: int = Field(1, ge=1)
    """Processes on this node (``torchrun --nproc_per_node``); >1 needs optim.backend=deepspeed."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpu_threads: int = Field(0, ge=0)
    """Torch threads per process on CPU; 0 keeps torch's default. Small models run fastest
    on 1 thread, and a busy machine slows multi-threaded ops down badly."""


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


def _optimizer_factory(cfg: OptimConfig) -> Callable[[object], torch.optim.Optimizer]:
    def make(params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params, lr=cfg.learning_rate, betas=cfg.betas, weight_decay=cfg.weight_decay
        )

    return make


def _scheduler_factory(cfg: OptimConfig, total_steps: int):
    def make(optimizer: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total_steps, cfg)
        )

    return make


class TrainingBackend(Protocol):
    """What a training loop needs from a backend."""

    module: torch.nn.Module
    """Call it for forward passes (it may be a wrapper, e.g. a DeepSpeed engine)."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> float:
        """Clip, update, advance the LR schedule, zero the grads; returns the grad norm."""
        ...

    def learning_rate(self) -> float: ...

    def save_checkpoint(self, directory: Path) -> None: ...

    def load_checkpoint(self, directory: Path) -> None: ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The complete model weights on rank 0 (gathered for ZeRO-3); None on other ranks."""
        ...

    def unwrapped(self) -> torch.nn.Module: ...


class TorchBackend:
    """Single process (CPU or one GPU), plain PyTorch AdamW."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, total_steps: int) -> None:
        self.module = model
        self.cfg = cfg
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = _optimizer_factory(cfg)(params)
        self.scheduler = _scheduler_factory(cfg, total_steps)(self.optimizer)

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

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def unwrapped(self) -> torch.nn.Module:
        return self.module


class DeepSpeedBackend:
    """DeepSpeed ZeRO-0/1/2/3 under torchrun (gloo on CPU, nccl on GPU), optional CPU offload."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        total_steps: int,
        dist_info: DistInfo,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        bf16: bool = False,
    ) -> None:
        try:
            import deepspeed
        except ImportError as exc:
            raise ImportError(
                "backend 'deepspeed' needs DeepSpeed: pip install 'lingo-rl[gpu]' "
                "(on CPU: DS_BUILD_OPS=0 pip install deepspeed)"
            ) from exc
        deepspeed.init_distributed(
            dist_backend="nccl" if dist_info.device.type == "cuda" else "gloo"
        )
        self.cfg = cfg
        self.world_size = dist_info.world_size
        self.gas = gradient_accumulation_steps
        zero: dict = {"stage": cfg.zero_stage}
        if cfg.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        if cfg.offload_optimizer:
            zero["offload_optimizer"] = {
                "device": "cpu",
                "pin_memory": dist_info.device.type == "cuda",
            }
        if cfg.offload_params and cfg.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": dist_info.device.type == "cuda"}
        ds_config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gradient_clipping": cfg.max_grad_norm,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if cfg.offload_optimizer:
            # DeepSpeed's CPU Adam runs the offloaded update; torch AdamW cannot.
            ds_config["optimizer"] = {
                "type": "AdamW",
                "params": {
                    "lr": cfg.learning_rate,
                    "betas": list(cfg.betas),
                    "weight_decay": cfg.weight_decay,
                },
            }
            optimizer = None
        else:
            optimizer = _optimizer_factory(cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=params,
            optimizer=optimizer,
            lr_scheduler=_scheduler_factory(cfg, total_steps),
            config=ds_config,
        )
        self.module = self.engine
        self._micro = 0

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides by gradient_accumulation_steps and averages over ranks; our loss is
        # already this micro-batch's share of the global batch, so scale both back.
        self.engine.backward(loss * self.gas * self.world_size)
        self._micro += 1
        if self._micro % self.gas != 0:
            self.engine.step()  # DeepSpeed's micro-step bookkeeping; updates only at the boundary

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def learning_rate(self) -> float:
        return self.engine.get_lr()[0]

    def save_checkpoint(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="deepspeed", save_latest=False)

    def load_checkpoint(self, directory: Path) -> None:
        self.engine.load_checkpoint(str(directory), tag="deepspeed")

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        import deepspeed

        model = self.engine.module
        if self.cfg.zero_stage != 3:
            return (
                {k: v.detach().cpu() for k, v in model.state_dict().items()}
                if self.engine.global_rank == 0
                else None
            )
        state: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if self.engine.global_rank == 0:
                    state[name] = param.detach().cpu().clone()
        if self.engine.global_rank != 0:
            return None
        persistent = set(model.state_dict())  # non-persistent buffers (rotary) are not weights
        for name, buf in model.named_buffers():
            if name in persistent:
                state[name] = buf.detach().cpu().clone()
        return state

    def unwrapped(self) -> torch.nn.Module:
        return self.engine.module

    def gathered_named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter, complete, on every rank (for a rollout engine's copy)."""
        import deepspeed

        out = []
        for name, param in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                out.append((name, param.detach().clone()))
        return out


def make_backend(
    model: torch.nn.Module,
    cfg: OptimConfig,
    total_steps: int,
    dist_info: DistInfo,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    bf16: bool = False,
) -> TrainingBackend:
    """The backend named by ``cfg.backend``."""
    if cfg.backend == "deepspeed":
        return DeepSpeedBackend(
            model, cfg, total_steps, dist_info, micro_batch_size, gradient_accumulation_steps, bf16
        )
    if dist_info.world_size > 1:
        raise ValueError(
            f"backend 'torch' runs one process, but {dist_info.world_size} were launched; "
            "use backend 'deepspeed' for several processes"
        )
    return TorchBackend(model, cfg, total_steps)
