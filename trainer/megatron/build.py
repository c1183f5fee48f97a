"""Building the Megatron backend from the converted checkpoint (``build_megatron_backend``):
the layout checked against the HF config and the world size, Megatron-Core's parallel state,
the actor (DDP) and the reference loaded from ``optim.megatron.checkpoint``, the distributed
optimizer."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch

from trainer.backends.config import OptimConfig
from trainer.distributed import DistInfo
from trainer.megatron.backend import (
    MegatronBackend,
    ParallelContext,
    load_model_state,
    require_megatron,
    unwrap,
)
from trainer.megatron.vocab_parallel import VocabShard

log = logging.getLogger(__name__)

# --- building it from the checkpoint --------------------------------------------------------


def _checkpoint_metadata(use_distributed_optimizer: bool) -> dict:
    """``sharded_state_dict`` metadata as megatron-bridge's checkpointing writes it."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _provider(auto_bridge, layout, settings, dtype: torch.dtype):
    """megatron-bridge's provider for the HF model, with the layout and recompute options."""
    from trainer.megatron import bridge as mb

    provider = auto_bridge.to_megatron_provider(load_weights=False)
    mb._configure_provider(provider, auto_bridge.hf_pretrained.config, dtype)
    mb._set_sizes(provider, mb.MegatronSizes.of(layout))
    provider.recompute_granularity = settings.recompute_granularity
    provider.recompute_method = settings.recompute_method
    provider.recompute_num_layers = settings.recompute_num_layers
    if settings.recompute_modules:
        provider.recompute_modules = list(settings.recompute_modules)
    provider.perform_initialization = False  # every weight comes from the checkpoint
    provider.calculate_per_token_loss = False  # the loop normalizes its own loss
    provider.variable_seq_lengths = False  # every micro-batch of a call has one length
    provider.finalize()
    return provider


def _load_weights(model: list[torch.nn.Module], checkpoint: Path, metadata: dict) -> None:
    """The converted checkpoint's weights into ``model`` (resharded to this layout)."""
    from megatron.core import dist_checkpointing

    keys = ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]
    sharded = {
        key: unwrap(chunk).sharded_state_dict(metadata=dict(metadata))
        for key, chunk in zip(keys, model, strict=True)
    }
    loaded = dist_checkpointing.load(sharded, str(checkpoint), strict="raise_all")
    for key, chunk in zip(keys, model, strict=True):
        load_model_state(unwrap(chunk), loaded[key], checkpoint)


def build_megatron_backend(
    cfg: OptimConfig,
    total_steps: int,
    dist_info: DistInfo,
    hf_dir: str | Path,
    with_reference: bool,
    seed: int = 0,
    pad_id: int = 0,
    training: bool = True,
) -> MegatronBackend:
    """The Megatron backend for ``cfg.megatron``: layout checked against ``hf_dir``'s config
    and the world size, parallel state set up, actor (DDP) and reference loaded from
    ``cfg.megatron.checkpoint``, distributed optimizer built.

    ``training=False`` checks the layout as one that only scores and exports (no
    ``forward_backward``): a MoE model with TP > 1 may then lack sequence parallelism
    (``validate_layout``'s ``training`` rules).

    Raises:
        ImportError: megatron-core / megatron-bridge missing, or Python < 3.12.
        ValueError: no checkpoint given; ``LayoutError`` for a layout that cannot run.
        MegatronCheckpointError: no checkpoint there, or one in another dtype than the layout.
    """
    require_megatron()
    from megatron.bridge import AutoBridge
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from trainer.megatron import bridge as mb

    settings = cfg.megatron
    layout, checkpoint = _checked_layout(settings, hf_dir, dist_info.world_size, training)
    dtype = layout.torch_dtype
    metadata = _checkpoint_metadata(settings.use_distributed_optimizer)
    cleanup = contextlib.ExitStack()
    try:
        sizes = layout.parallel_sizes
        timeout = dist_info.timeout
        cleanup.enter_context(
            mb.megatron_parallel(sizes, vpp=layout.vpp, seed=seed, timeout=timeout)
        )
        auto_bridge = AutoBridge.from_hf_pretrained(str(hf_dir), torch_dtype=dtype)
        on_cpu = not torch.cuda.is_available()
        stored = (checkpoint, metadata)
        actor = _model(auto_bridge, layout, settings, stored, on_cpu, trained=True)
        optimizer = _optimizer(cfg, dtype, actor)
        model_config = get_model_config(actor[0])
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.grad_scale_func = optimizer.scale_loss
        reference = None
        if with_reference:
            reference = _model(auto_bridge, layout, settings, stored, on_cpu, trained=False)
        device = dist_info.device if on_cpu else torch.device("cuda", torch.cuda.current_device())
        backend = MegatronBackend(
            model=actor,
            optimizer=optimizer,
            cfg=cfg,
            total_steps=total_steps,
            parallel=ParallelContext.from_parallel_state(device, layout.sequence_parallel),
            vocab=_vocab_shard(auto_bridge, actor, layout.tp),
            pad_id=pad_id,
            schedule=get_forward_backward_func(),
            reference=reference,
            bridge=auto_bridge,
            dtype=dtype,
            checkpoint_metadata=metadata,
            cleanup=cleanup,
        )
    except BaseException:
        cleanup.close()
        raise
    log.info(
        "Megatron backend: layout %s (tp %d pp %d ep %d etp %d dp %d, %s) from %s",
        *(layout.name, layout.tp, layout.pp, layout.ep, layout.etp, layout.dp),
        *(layout.params_dtype, settings.checkpoint),
    )
    return backend


def _model(auto_bridge, layout, settings, checkpoint, on_cpu: bool, trained: bool):
    """The model's chunks loaded from ``checkpoint`` (``(iteration directory, sharded-state
    metadata)``): ``trained``, the actor wrapped in Megatron-Core's DDP; else the frozen
    reference."""
    from megatron.core.distributed import DistributedDataParallelConfig

    directory, metadata = checkpoint
    provider = _provider(auto_bridge, layout, settings, layout.torch_dtype)
    if trained:
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        )
        model = provider.provide_distributed_model(
            ddp_config=ddp, wrap_with_ddp=True, use_cpu_initialization=on_cpu
        )
    else:
        model = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=on_cpu
        )
    _load_weights(model, directory, metadata)
    if not trained:
        for chunk in model:
            chunk.eval().requires_grad_(False)
    return model


def _checked_layout(settings, hf_dir: str | Path, world_size: int, training: bool):
    """``(layout, checkpoint iteration directory)``: the layout checked against ``hf_dir``'s
    config and the world size, the checkpoint given and saved in the layout's dtype."""
    from trainer.megatron import bridge as mb
    from trainer.megatron.layout import validate_layout

    if not settings.checkpoint:
        raise ValueError(
            "optim.megatron.checkpoint: set it to the Megatron checkpoint convert_megatron "
            f"wrote from {hf_dir}"
        )
    layout = validate_layout(
        hf_dir, settings.layout, world_size=world_size, training=training
    ).layout
    checkpoint = mb.checkpoint_iteration_dir(settings.checkpoint)
    saved = mb.checkpoint_dtype(settings.checkpoint)
    if saved != layout.torch_dtype:
        raise mb.MegatronCheckpointError(
            f"{settings.checkpoint} holds {saved} weights but layout {layout.name!r} trains in "
            f"{layout.params_dtype}; convert again with that dtype or change params_dtype"
        )
    return layout, checkpoint


def _optimizer(cfg: OptimConfig, dtype: torch.dtype, actor: list[torch.nn.Module]):
    """Megatron-Core's (distributed) Adam for ``cfg``, optionally offloaded to the host."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    settings = cfg.megatron
    offload = settings.optimizer_offload_fraction
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.learning_rate,
            min_lr=cfg.learning_rate * cfg.min_lr_ratio,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            clip_grad=cfg.max_grad_norm,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            optimizer_cpu_offload=offload > 0,
            optimizer_offload_fraction=offload,
            use_precision_aware_optimizer=offload > 0,
            overlap_cpu_optimizer_d2h_h2d=offload > 0,
        ),
        actor,
        config_overrides={},  # weight decay on every parameter, as the other backends
    )


def _vocab_shard(auto_bridge, actor: list[torch.nn.Module], tp: int) -> VocabShard:
    """This rank's columns of the (padded) vocabulary in the last stage's logits."""
    from megatron.core import parallel_state as mpu

    columns = unwrap(actor[-1]).vocab_size // tp
    return VocabShard(
        start=mpu.get_tensor_model_parallel_rank() * columns,
        size=auto_bridge.hf_pretrained.config.vocab_size,
        group=mpu.get_tensor_model_parallel_group() if tp > 1 else None,
    )
