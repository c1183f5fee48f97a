"""Training backends behind one small interface: plain PyTorch, DeepSpeed ZeRO-0/1/2/3, and
Megatron-Core (``trainer.megatron.backend``, GRPO only).

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

import copy
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from pydantic import ConfigDict, Field, model_validator

from eval.config_model import ConfigModel
from trainer.distributed import DistInfo

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; the last checkpoint is left as it was."""


RECOMPUTE_MODULES = frozenset({"core_attn", "moe_act", "layernorm", "mlp", "moe"})
"""Megatron-Core's ``recompute_modules`` choices that apply to GPT-OSS (selective recompute)."""


class MegatronSettings(ConfigModel):
    """How the Megatron backend (``optim.backend: megatron``) builds and trains the policy.

    Attributes:
        layout: a ``trainer.megatron.layout`` preset name (``verl-gpt-oss-8x8-h100``,
            ``tiny-cpu``) or a mapping (``{"preset": name, **overrides}`` or plain fields).
        checkpoint: the Megatron ``torch_dist`` checkpoint to start from (``convert_megatron``'s
            output); the actor, and the reference when KL is on, load their weights from it.
        recompute_granularity: activation recompute: ``full`` (whole layers) or ``selective``
            (``recompute_modules`` only); ``None`` keeps every activation.
        recompute_method: ``uniform`` or ``block`` (``full`` only).
        recompute_num_layers: layers per recompute unit (``uniform``) or recomputed layers per
            pipeline stage (``block``); ``full`` only.
        recompute_modules: submodules recomputed by ``selective`` (default ``core_attn``).
        use_distributed_optimizer: shard the optimizer state (and fp32 master weights) over
            data-parallel ranks.
        optimizer_offload_fraction: share of the optimizer state and update kept on the host
            (Megatron-Core's ``HybridDeviceOptimizer``); > 0 needs the distributed optimizer.
    """

    model_config = ConfigDict(extra="forbid")

    layout: str | dict[str, Any]
    checkpoint: str | None = None
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = Field(None, ge=1)
    recompute_modules: list[str] = Field(default_factory=list)
    use_distributed_optimizer: bool = True
    optimizer_offload_fraction: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _consistent(self) -> MegatronSettings:
        from trainer.megatron.layout import resolve_megatron_layout

        resolve_megatron_layout(self.layout)  # LayoutError (a ValueError) names the field
        problems = []
        granularity = self.recompute_granularity
        full = granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            problems.append(
                "recompute_granularity=full needs recompute_method (uniform|block) and "
                "recompute_num_layers (e.g. uniform, 1: every layer recomputed)"
            )
        if not full and (self.recompute_method or self.recompute_num_layers):
            problems.append(
                "recompute_method / recompute_num_layers apply to recompute_granularity=full only"
            )
        if self.recompute_modules and granularity != "selective":
            problems.append("recompute_modules applies to recompute_granularity=selective only")
        unknown = sorted(set(self.recompute_modules) - RECOMPUTE_MODULES)
        if unknown:
            problems.append(
                f"recompute_modules {unknown} unknown; choose from {sorted(RECOMPUTE_MODULES)}"
            )
        if self.optimizer_offload_fraction > 0 and not self.use_distributed_optimizer:
            problems.append(
                "optimizer_offload_fraction > 0 needs use_distributed_optimizer=true (Megatron-"
                "Core offloads through its precision-aware distributed optimizer)"
            )
        if problems:
            raise ValueError("optim.megatron: " + "; ".join(problems))
        return self

    def resolved_layout(self):
        """The layout as a ``trainer.megatron.layout.MegatronLayout``."""
        from trainer.megatron.layout import resolve_megatron_layout

        return resolve_megatron_layout(self.layout)


class OptimConfig(ConfigModel):
    """Optimizer, schedule and backend settings shared by SFT and GRPO.

    ``megatron`` (GRPO only) needs the ``megatron`` settings block; ``zero_stage``,
    ``offload_optimizer`` and ``offload_params`` are DeepSpeed's.
    """

    model_config = ConfigDict(extra="forbid")

    backend: Literal["torch", "deepspeed", "megatron"] = "torch"
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_zero_grad_steps: int = Field(3, ge=0)
    """Fail the run when the gradient norm is 0 this many optimizer steps in a row (a
    saturated, diverged model); 0: never (see trainer/divergence.py)."""
    zero_stage: Literal[0, 1, 2, 3] = 3
    offload_optimizer: bool = False
    offload_params: bool = False
    megatron: MegatronSettings | None = None

    @model_validator(mode="after")
    def _backend_settings(self) -> OptimConfig:
        if self.backend == "megatron":
            if self.megatron is None:
                raise ValueError(
                    "optim.backend=megatron needs an optim.megatron block with at least a layout "
                    "(a preset such as 'verl-gpt-oss-8x8-h100' or 'tiny-cpu', or its fields)"
                )
            if self.offload_optimizer or self.offload_params:
                raise ValueError(
                    "optim.offload_optimizer / offload_params are DeepSpeed settings; with "
                    "backend=megatron set optim.megatron.optimizer_offload_fraction instead"
                )
        elif self.megatron is not None:
            raise ValueError(
                f"optim.megatron is set but optim.backend is {self.backend!r}; set "
                "backend=megatron or drop the megatron block"
            )
        return self


class ProcessSettings(ConfigModel):
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
        return self._all_reduce(value, "SUM")

    def all_reduce_max(self, value: float) -> float:
        """The largest of a number over the replicas (itself when there is one)."""
        return self._all_reduce(value, "MAX")

    def _all_reduce(self, value: float, op: str) -> float:
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=self.group)
        return float(t.item())


class ResponseBatch(Protocol):
    """A micro-batch of prompt + response rows as the GRPO loop lays it out
    (``trainer.grpo.layout.Micro``): rows right-aligned, so every response ends in the last
    column, and per-token values come back as ``[B, width]`` aligned with ``mask``."""

    ids: torch.Tensor
    """``[B, T]`` token ids, left-padded."""
    attention: torch.Tensor
    """``[B, T]`` 1 on real tokens."""
    mask: torch.Tensor
    """``[B, width]`` 1 on the response tokens."""

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

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy's weights under Hugging Face names, one tensor at a time, on every rank
        (for a rollout engine's ``sync_weights``). Collective: every rank iterates it."""
        ...

    def save_hf_pretrained(self, directory: Path, base_model: str | Path, dtype) -> None:
        """Write the policy's weights and config as a Hugging Face directory into
        ``directory`` (global rank 0 writes; collective)."""
        ...

    def unwrapped(self) -> torch.nn.Module: ...

    def close(self) -> None:
        """Release what the backend set up (Megatron's parallel state)."""
        ...


class _HFModuleBackend:
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
        module = self.reference if reference else self.module
        return [micro.hf_log_probs(module, False)[0] for micro in micro_batches]


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference model: the starting policy, frozen (taken before any partitioning)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


class TorchBackend(_HFModuleBackend):
    """Single process (CPU or one GPU), plain PyTorch AdamW."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        total_steps: int,
        with_reference: bool = False,
    ) -> None:
        self.module = model
        self.cfg = cfg
        self.reference = _frozen_copy(model) if with_reference else None
        device = next(model.parameters()).device
        self.data_parallel = DataParallel(0, 1, device)
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

    def set_base_learning_rate(self, learning_rate: float) -> None:
        rebase_schedule(self.optimizer, self.scheduler, learning_rate)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((n, p.detach()) for n, p in self.module.named_parameters())

    def save_hf_pretrained(self, directory: Path, base_model: str | Path, dtype) -> None:
        self.module.save_pretrained(directory)

    def unwrapped(self) -> torch.nn.Module:
        return self.module

    def close(self) -> None:
        """Nothing to release."""


class DeepSpeedBackend(_HFModuleBackend):
    """DeepSpeed ZeRO-0/1/2/3 under torchrun (gloo on CPU, nccl on GPU), optional CPU offload.

    ``ds_config``: the configuration the model was built with (``deepspeed_config``; under
    ZeRO-3 the policy comes partitioned from ``trainer.zero3.load_partitioned``); None builds
    it here and partitions a whole ``model`` in ``deepspeed.initialize``. Under ZeRO-3 the KL
    reference is loaded partitioned from ``reference_dir`` into an engine without optimizer.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        total_steps: int,
        dist_info: DistInfo,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        bf16: bool = False,
        with_reference: bool = False,
        ds_config: dict | None = None,
        reference_dir: str | Path | None = None,
    ) -> None:
        from trainer.zero3 import init_deepspeed_comm, load_partitioned, share_fp32_master

        init_deepspeed_comm(dist_info.device)  # a clear ImportError without DeepSpeed
        import deepspeed

        self.cfg = cfg
        self.world_size = dist_info.world_size
        self.gas = gradient_accumulation_steps
        self.data_parallel = DataParallel(dist_info.rank, dist_info.world_size, dist_info.device)
        if ds_config is None:
            ds_config = deepspeed_config(
                cfg, dist_info.device, micro_batch_size, gradient_accumulation_steps, bf16
            )
        self.ds_config = ds_config
        self.reference = None
        self._reference_engine = None
        if with_reference and cfg.zero_stage == 3:
            # partitioned like the policy, in an engine of its own without an optimizer
            if reference_dir is None:
                raise ValueError(
                    "ZeRO-3 with a KL reference needs reference_dir (the starting model's HF "
                    "directory): the reference is loaded partitioned, never copied whole"
                )
            dtype = next(model.parameters()).dtype
            reference = load_partitioned(reference_dir, dtype, ds_config, dist_info.device)
            inference = {k: v for k, v in ds_config.items() if k != "optimizer"}
            self._reference_engine = deepspeed.initialize(model=reference, config=inference)[0]
            self.reference = self._reference_engine.module.eval().requires_grad_(False)
        elif with_reference:
            self.reference = _frozen_copy(model)  # ZeRO-0/1/2: every rank holds it whole
        # offloaded: DeepSpeed's CPU Adam (ds_config["optimizer"]) runs the update
        optimizer = None if cfg.offload_optimizer else _optimizer_factory(cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=params,
            optimizer=optimizer,
            lr_scheduler=_scheduler_factory(cfg, total_steps),
            config=ds_config,
        )
        if cfg.zero_stage == 3:
            share_fp32_master(self.optimizer)
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

    def set_base_learning_rate(self, learning_rate: float) -> None:
        rebase_schedule(self.optimizer, self.scheduler, learning_rate)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model on rank 0 (SFT's merge takes it; GRPO streams: ``hf_weights``,
        ``save_hf_pretrained``)."""
        from trainer.zero3 import gathered_parameters

        model = self.engine.module
        if self.cfg.zero_stage != 3:
            return (
                {k: v.detach().cpu() for k, v in model.state_dict().items()}
                if self.engine.global_rank == 0
                else None
            )
        state: dict[str, torch.Tensor] = {}
        for name, tensor in gathered_parameters(model):
            if self.engine.global_rank == 0:
                state[name] = tensor.cpu().clone()
        if self.engine.global_rank != 0:
            return None
        persistent = set(model.state_dict())  # non-persistent buffers (rotary) are not weights
        for name, buf in model.named_buffers():
            if name in persistent:
                state[name] = buf.detach().cpu().clone()
        return state

    def unwrapped(self) -> torch.nn.Module:
        return self.engine.module

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """One parameter at a time; under ZeRO-3 gathered whole, valid only until the next
        item (the consumer copies it). Collective: every rank iterates to the end."""
        if self.cfg.zero_stage == 3:
            from trainer.zero3 import gathered_parameters

            return gathered_parameters(self.engine.module)
        return ((n, p.detach()) for n, p in self.engine.module.named_parameters())

    def save_hf_pretrained(self, directory: Path, base_model: str | Path, dtype) -> None:
        if self.cfg.zero_stage == 3:  # streamed: no rank ever holds the whole model
            from transformers import AutoConfig

            from trainer.zero3 import save_gathered

            config = AutoConfig.from_pretrained(base_model)
            writer = self.engine.global_rank == 0
            save_gathered(self.engine.module, directory, config, dtype, writer)
            return
        from eval.modeling import load_causal_lm

        weights = self.full_state_dict()
        if self.engine.global_rank != 0:
            return
        model = load_causal_lm(base_model, dtype)
        model.load_state_dict(weights, strict=True)
        model.save_pretrained(directory)

    def close(self) -> None:
        """Nothing to release (the process group belongs to the caller)."""


def deepspeed_config(
    cfg: OptimConfig,
    device: torch.device,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    bf16: bool = False,
    zero_settings: dict | None = None,
) -> dict:
    """The DeepSpeed configuration of a run: given to ``deepspeed.initialize`` and, under
    ZeRO-3, to the partitioned load before it (``trainer.zero3.load_partitioned``).

    ``zero_settings``: extra ``zero_optimization`` entries (``trainer.zero3.gather_windows``).
    """
    pin = device.type == "cuda"
    zero: dict = {"stage": cfg.zero_stage, **(zero_settings or {})}
    if cfg.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if cfg.offload_params and cfg.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
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
    return ds_config


def make_backend(
    model: torch.nn.Module,
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
    """The backend named by ``cfg.backend``.

    ``with_reference``: also keep the starting model, frozen, for KL (``log_probs(...,
    reference=True)``): a copy of ``model``, or under DeepSpeed ZeRO-3 loaded partitioned from
    ``hf_dir``. ``ds_config``: DeepSpeed's configuration when the caller built ``model`` with
    it (``deepspeed_config``). Megatron builds its own actor (and reference) from
    ``cfg.megatron.checkpoint`` with ``hf_dir``'s config; ``model`` is not trained there.
    """
    if cfg.backend == "megatron":
        if hf_dir is None:
            raise ValueError(
                "backend 'megatron' needs the Hugging Face model directory (hf_dir) for its "
                "config and tokenizer; it runs in the GRPO step only"
            )
        from trainer.megatron.backend import build_megatron_backend

        return build_megatron_backend(
            cfg,
            total_steps,
            dist_info,
            hf_dir,
            with_reference=with_reference,
            seed=seed,
            pad_id=pad_id,
        )
    if cfg.backend == "deepspeed":
        return DeepSpeedBackend(
            model,
            cfg,
            total_steps,
            dist_info,
            micro_batch_size,
            gradient_accumulation_steps,
            bf16,
            with_reference=with_reference,
            ds_config=ds_config,
            reference_dir=hf_dir,
        )
    if dist_info.world_size > 1:
        raise ValueError(
            f"backend 'torch' runs one process, but {dist_info.world_size} were launched; "
            "use backend 'deepspeed' for several processes"
        )
    return TorchBackend(model, cfg, total_steps, with_reference=with_reference)
