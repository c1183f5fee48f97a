"""The DeepSpeed backend: ZeRO-0/1/2/3 under torchrun (gloo on CPU, nccl on GPU), optional
CPU offload, and the DeepSpeed configuration of a run (``deepspeed_config``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from trainer.backends.config import OptimConfig
from trainer.backends.interface import DataParallel
from trainer.backends.schedule import optimizer_factory, rebase_schedule, scheduler_factory
from trainer.backends.torch import HFModuleBackend, is_peft, reference_copy
from trainer.distributed import DistInfo


class DeepSpeedBackend(HFModuleBackend):
    """DeepSpeed ZeRO-0/1/2/3 under torchrun (gloo on CPU, nccl on GPU), optional CPU offload.

    ``ds_config``: the configuration the model was built with (``deepspeed_config``; under
    ZeRO-3 the policy comes partitioned from ``trainer.zero3.load_partitioned``); None builds
    it here and partitions a whole ``model`` in ``deepspeed.initialize``. Under ZeRO-3 the KL
    reference is loaded partitioned from ``reference_dir`` into an engine without optimizer;
    under LoRA it is the policy's own frozen base with the adapter off (``reference_copy``).
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
        from trainer.zero3 import (
            init_deepspeed_comm,
            load_partitioned,
            mark_expert_leaves,
            share_fp32_master,
        )

        init_deepspeed_comm(dist_info.device)  # a clear ImportError without DeepSpeed
        import deepspeed

        self.cfg = cfg
        self.world_size = dist_info.world_size
        self.gas = gradient_accumulation_steps
        self.data_parallel = DataParallel(dist_info.rank, dist_info.world_size, dist_info.device)
        self.forward_is_collective = cfg.zero_stage == 3 and dist_info.world_size > 1
        if ds_config is None:
            ds_config = deepspeed_config(
                cfg, dist_info.device, micro_batch_size, gradient_accumulation_steps, bf16
            )
        self.ds_config = ds_config
        self.reference = None
        self._reference_engine = None
        if with_reference and cfg.zero_stage == 3 and not is_peft(model):
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
            # ZeRO-0/1/2: a copy, whole on every rank; LoRA: none, the base with the adapter off
            self.reference = reference_copy(model, True)
        if cfg.zero_stage == 3:
            mark_expert_leaves(model)  # before initialize, which hooks the modules
        # offloaded: DeepSpeed's CPU Adam (ds_config["optimizer"]) runs the update
        optimizer = None if cfg.offload_optimizer else optimizer_factory(cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=params,
            optimizer=optimizer,
            lr_scheduler=scheduler_factory(cfg, total_steps),
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
        self._settle()
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

    def hf_weights(self, trainable_only: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
        """One parameter at a time (``trainable_only``: those the update changes, a LoRA
        adapter's); under ZeRO-3 gathered whole, valid only until the next item (the consumer
        copies it). Collective: every rank iterates to the end."""
        if self.cfg.zero_stage == 3:
            from trainer.zero3 import gathered_parameters

            self._settle()
            return gathered_parameters(self.engine.module, trainable_only)
        return (
            (n, p.detach())
            for n, p in self.engine.module.named_parameters()
            if p.requires_grad or not trainable_only
        )

    def _settle(self) -> None:
        """Before gathering outside a forward: wait for and release what ZeRO-3 still has in
        flight or gathered. A forward without a backward (an eval) leaves the prefetch of the
        parameters its trace's backward would use in flight, and a gather of one of them then
        fails ("Cannot partition a param in flight", DeepSpeed 0.19
        ``partition_parameters.py`` ``_partition_param``); ``empty_partition_cache``
        (``release_and_reset_all``) waits for and releases every parameter."""
        self.engine.empty_partition_cache()

    def save_hf_pretrained(self, directory: Path, base_model: str | Path, dtype) -> None:
        if is_peft(self.engine.module):  # the adapter alone (adapter_config.json + tensors)
            adapter = {n: t.detach().cpu().clone() for n, t in self.hf_weights(True)}
            if self.engine.global_rank == 0:
                self.engine.module.save_pretrained(directory, state_dict=adapter)
            return
        if self.cfg.zero_stage == 3:  # streamed: no rank ever holds the whole model
            from transformers import AutoConfig

            from trainer.zero3 import save_gathered

            config = AutoConfig.from_pretrained(base_model)
            writer = self.engine.global_rank == 0
            self._settle()
            save_gathered(self.engine.module, directory, config, dtype, writer)
            return
        from core.modeling import load_causal_lm

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
