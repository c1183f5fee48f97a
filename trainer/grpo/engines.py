"""The rollout engines of a GRPO run, built from a registry keyed by ``rollout.engine``.

Each entry of ``ENGINES`` says how to build the engine a training process samples with when
the engines are colocated (``colocated``), the engine a rollout-only process serves when they
are dedicated (``rollout_only``), and which data-parallel ranks' prompts one colocated engine
generates (``colocated_ranks``). The recipe asks for an engine by the config's name and calls
what the ``RolloutEngine`` protocol has; the engine classes live in ``rollout`` (in-process
HF and vLLM), ``vllm_dedicated`` and ``remote`` (the engines in processes of their own).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from core.modeling import load_causal_lm, resolve_dtype
from plan.specs import lookup
from trainer.backends import DataParallel, TrainingBackend
from trainer.distributed import DistInfo
from trainer.grpo.config import GRPOConfig
from trainer.grpo.rollout import HFRolloutEngine, RolloutEngine
from trainer.grpo.weight_transfer import (
    TransferChoice,
    log_transfer,
    select_transfer,
    vllm_importable,
)
from trainer.placement import PlacementPlan
from trainer.sft.lora import apply_lora

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSite:
    """Where an engine is built: the run's config, the model it starts from, its tokenizer,
    the run's placement plan and this process."""

    cfg: GRPOConfig
    sft_model: str | Path
    tokenizer: object
    plan: PlacementPlan
    info: DistInfo

    @property
    def dtype_name(self) -> str:
        """The policy's dtype as vLLM names it (``bfloat16``)."""
        return str(resolve_dtype(self.cfg.dtype, self.info.device)).removeprefix("torch.")


@dataclass(frozen=True)
class EngineBuilders:
    """How one engine family is built (an entry of ``ENGINES``)."""

    colocated: Callable[[EngineSite, torch.nn.Module, TrainingBackend], RolloutEngine]
    """A training process's engine, given the HF policy and the backend that trains it."""
    rollout_only: Callable[[EngineSite], RolloutEngine]
    """A rollout-only process's engine, loaded from the SFT model."""
    colocated_ranks: Callable[[EngineSite, DataParallel], tuple[int, ...]]
    """The data-parallel ranks whose prompts this process's colocated engine generates."""


def _hf_colocated(site: EngineSite, policy: torch.nn.Module, backend: TrainingBackend):
    """HF generate on the trained module itself (nothing to sync; under ZeRO-3 partitioned,
    every rank stepping in lockstep) or, Megatron, on the HF copy of the policy."""
    rollout = site.cfg.rollout
    return HFRolloutEngine(policy, site.tokenizer, rollout, lockstep=backend.forward_is_collective)


def _vllm_colocated(site: EngineSite, policy: torch.nn.Module, backend: TrainingBackend):
    """The vLLM engine this process is a worker of in the plan (on its own GPU, with the other
    ranks of its engine), in the policy's dtype; it sleeps during the update on a GPU."""
    from trainer.grpo.vllm_rollout import VLLMRolloutEngine

    cfg, info = site.cfg, site.info
    engine = site.plan.engine_of(info.rank) if info.world_size > 1 else None
    return VLLMRolloutEngine(
        str(site.sft_model),
        site.tokenizer,
        cfg.rollout,
        cfg.seed,
        engine,
        info.world_size,
        dtype=site.dtype_name,
        sleep_mode=cfg.rollout.colocate and info.device.type == "cuda",
        record_routing=cfg.algorithm.router_replay == "rollout",
        bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
    )


def _hf_rollout_only(site: EngineSite):
    """A frozen copy of the SFT model; LoRA GRPO: with the run's adapter on it (its ``B`` zero
    until the first sync), so each sync moves the adapter's tensors alone, under the
    trainer's names."""
    dtype = resolve_dtype(site.cfg.dtype, site.info.device)
    model = apply_lora(load_causal_lm(site.sft_model, dtype, site.info.device), site.cfg.lora)
    return HFRolloutEngine(model.requires_grad_(False), site.tokenizer, site.cfg.rollout)


def _vllm_rollout_only(site: EngineSite):
    """A vLLM engine runs in processes of its own, started by the engine's first rank
    (``trainer.grpo.vllm_dedicated``); its other ranks only follow."""
    from trainer.grpo.remote import EngineFollower

    placement = site.plan.engine_of(site.info.rank)
    if site.info.rank != placement.ranks[0]:
        return EngineFollower()
    from trainer.grpo.vllm_dedicated import DedicatedVLLMEngine

    cfg = site.cfg
    return DedicatedVLLMEngine(
        str(site.sft_model),
        site.tokenizer,
        cfg.rollout,
        cfg.seed,
        placement,
        dtype=site.dtype_name,
        bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
        record_routing=cfg.algorithm.router_replay == "rollout",
    )


def _own_rank(site: EngineSite, dp: DataParallel) -> tuple[int, ...]:
    return (dp.rank,)


def _engine_ranks(site: EngineSite, dp: DataParallel) -> tuple[int, ...]:
    """All of the workers of this process's vLLM engine."""
    return site.plan.engine_of(site.info.rank).ranks


ENGINES: dict[str, EngineBuilders] = {
    "hf": EngineBuilders(_hf_colocated, _hf_rollout_only, _own_rank),
    "vllm": EngineBuilders(_vllm_colocated, _vllm_rollout_only, _engine_ranks),
}


def engine_builders(name: str) -> EngineBuilders:
    """The builders of the engine called ``name``; ``UnknownSpecError`` (a ValueError)
    listing the valid names, as ``plan.engine_spec`` says it."""
    return lookup(ENGINES, name, "rollout.engine", "rollout engine")


def weight_transport(cfg: GRPOConfig, device: torch.device, rank: int) -> TransferChoice:
    """The run's weight-sync transport (``trainer.grpo.weight_transfer.select_transfer``),
    logged once by the process that chose it when it is rank 0."""
    choice = select_transfer(
        device.type, cfg.rollout.colocate, cfg.rollout.engine, vllm_importable()
    )
    if rank == 0:
        log_transfer(choice)
    return choice


def colocated_engine(
    site: EngineSite, policy: torch.nn.Module, backend: TrainingBackend
) -> RolloutEngine:
    """The engine a training process samples with when the engines are colocated."""
    weight_transport(site.cfg, site.info.device, site.info.rank)
    return engine_builders(site.cfg.rollout.engine).colocated(site, policy, backend)


def rollout_only_engine(site: EngineSite) -> RolloutEngine:
    """A rollout-only process's engine, loaded from the SFT model (it then answers the
    coordinator, ``trainer.grpo.remote.serve``, until the run ends)."""
    engine = engine_builders(site.cfg.rollout.engine).rollout_only(site)
    log.info(
        "rank %d: rollout engine %d of %d on %s",
        site.info.rank,
        site.plan.engine_of(site.info.rank).index,
        len(site.plan.engines),
        site.info.device,
    )
    return engine


def engine_ranks(site: EngineSite, dp: DataParallel) -> tuple[int, ...]:
    """The data-parallel ranks whose prompts this rank's engine generates: every training
    rank's (dedicated engines), all of a colocated vLLM engine's workers, or this rank's own."""
    if site.plan.rollout_only_ranks:
        return tuple(range(dp.size))
    return engine_builders(site.cfg.rollout.engine).colocated_ranks(site, dp)


def serve_rollouts(site: EngineSite, store, channel, weights, start: timedelta) -> None:
    """A rollout-only process's whole run: build its engine, say it is ready, wait for the
    training coordinator, then answer it until the run ends (``trainer.grpo.remote``)."""
    from trainer.grpo import channels, remote

    engine = rollout_only_engine(site)
    channels.announce_ready(store, site.info.rank)
    channels.wait_until_ready(store, [0], start, "the training coordinator")
    index = site.plan.engine_of(site.info.rank).index
    remote.serve(engine, index, len(site.plan.engines), channel, weights)


def remote_engines(cfg: GRPOConfig, plan: PlacementPlan, channel, weights, info: DistInfo):
    """A training process's handle on the dedicated engines: the coordinator's
    ``RemoteRolloutEngine`` (None on the other training processes), shared with them over
    their default group when there are several (``SharedRemote``). vLLM engines get the
    weights from the coordinator directly (``weight_transport``: every TP worker in one
    group with it); HF engines over ``weights``."""
    from trainer.grpo import remote

    handle = None
    if channel is not None:
        choice = weight_transport(cfg, info.device, 0)
        direct = None
        if choice.transport in ("nccl", "lingo_gloo"):
            direct = remote.DirectTransfer(
                choice,
                tuple(e.tensor_parallel_size for e in plan.engines),
                os.environ.get("MASTER_ADDR", "127.0.0.1"),
                cfg.collective_timeout,
            )
        handle = remote.RemoteRolloutEngine(
            [e.ranks[0] for e in plan.engines],
            channel,
            cfg.rollout.sync_bucket_mb << 20,
            weights,
            direct,
        )
    return remote.SharedRemote(handle, info) if info.world_size > 1 else handle
