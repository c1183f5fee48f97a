"""The typed training settings SFT and GRPO share: optimizer and schedule (``OptimConfig``),
the Megatron backend's settings (``MegatronSettings``) and how a step runs its processes
(``ProcessSettings``). This module imports only pydantic (the package's ``__init__`` imports
the backends, and with them torch).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from core.config_model import ConfigModel
from plan import TrainerSpec, trainer_spec

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

    backend: str = "torch"
    """A trainer backend of ``plan.TRAINERS`` (``torch``, ``deepspeed``, ``megatron``)."""
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
    max_loss_spike: float = Field(10.0, ge=0)
    """SFT (a token cross-entropy loss): fail the run when a step's loss is above ln(vocabulary)
    and this many times the running average of the steps before; 0: never. GRPO's policy
    loss is not a cross-entropy and is checked for finiteness only."""
    zero_stage: Literal[0, 1, 2, 3] = 3
    offload_optimizer: bool = False
    offload_params: bool = False
    megatron: MegatronSettings | None = None

    @field_validator("backend")
    @classmethod
    def _a_registered_backend(cls, backend: str) -> str:
        trainer_spec(backend)  # UnknownSpecError (a ValueError) naming the valid ones
        return backend

    @model_validator(mode="after")
    def _backend_settings(self) -> OptimConfig:
        if self.trainer.model_parallel:
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

    @property
    def trainer(self) -> TrainerSpec:
        """The spec of the backend (``plan.trainer_spec``)."""
        return trainer_spec(self.backend)

    @property
    def multi_process(self) -> bool:
        """The backend runs on several processes (``nproc`` > 1); ``torch`` does not."""
        return self.trainer.multi_process

    @property
    def partitioned_load(self) -> bool:
        """Whether the step's model is loaded partitioned: DeepSpeed ZeRO-3 builds it under
        ``zero.Init`` and fills it one tensor at a time, so no rank ever holds it whole
        (``trainer.backends.loading``). Otherwise every rank loads the whole model. The
        capacity check models the load with this same property."""
        return self.trainer.zero and self.zero_stage == 3


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
    collective_timeout_s: int = Field(3600, ge=1)
    """How long a process waits in one collective for the others before the run fails: the
    timeout of every process group the step creates (torch's default, 10 minutes for NCCL,
    is shorter than some waits of a large model: rank 0 saving it, or waiting on the rollout
    engines while the others wait on rank 0)."""

    @property
    def collective_timeout(self) -> timedelta:
        return timedelta(seconds=self.collective_timeout_s)
