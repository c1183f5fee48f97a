"""The project's vLLM weight-transfer backend, for dedicated vLLM engines: gloo over host
memory (``lingo_gloo``, no GPU) or NCCL from GPU to GPU (``nccl``), with the GPT-OSS reload
rules; registered as ``lingo``.

vLLM's weight-transfer API (``vllm/distributed/weight_transfer/``: ``init_weight_transfer_engine``,
then per update ``start_weight_update``, ``update_weights`` once per bucket,
``finish_weight_update``) loads a trainer's weights into a running engine whose workers are
in other processes. vLLM 0.32 ships CUDA-only backends (``nccl``: ``PyNcclCommunicator``;
``ipc``: CUDA IPC handles); its factory takes backends of one's own
(``WeightTransferEngineFactory.register_engine``). This one, ``BACKEND``, moves each bucket as
one byte tensor broadcast over a group of the sender and the engine's workers (the init
info's ``transport``): ``gloo``, built with vLLM's
``stateless_init_torch_distributed_process_group`` (a group outside every default group, so
neither side's torch.distributed world is touched), or ``nccl``, built as vLLM's own ``nccl``
backend builds its group (``nccl_common.stateless_init_process_group``: a
``StatelessProcessGroup`` store, then a ``PyNcclCommunicator`` on the worker's GPU). The sender
is the trainer itself (``trainer.grpo.weight_transfer``), rank 0, with every TP worker of every
engine after it (``rank_offset``): each worker receives each bucket once, straight from it.
The RPC carries names, dtypes and shapes (vLLM's msgpack); the bytes go over the group:
nothing is pickled. Over gloo the bucket is staged in host memory (each worker's weight loaders
copy it onto its device); over NCCL it arrives in the worker's GPU memory.

The workers load as vLLM's in-place reload does (layerwise reload: ``start`` saves the
kernel tensors, each bucket goes through the model's ``load_weights``, ``finish`` runs the
post-load processing), with the GPT-OSS rules of ``trainer.grpo.vllm_weights`` (experts one
at a time, sinks through their own loaders, the CPU experts' repack).

This module imports vLLM at the top: it is imported only where vLLM is installed, in vLLM's
worker processes (``WORKER_EXTENSION``: vLLM imports it there before the model loads, which
registers the backend) and by ``trainer.grpo.vllm_dedicated``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from trainer.grpo.vllm_weights import PolicyReload, VLLMWeights

log = logging.getLogger(__name__)

BACKEND = "lingo"
WORKER_EXTENSION = f"{__name__}.HostTransferExtension"


@dataclass
class HostTransferInitInfo(WeightTransferInitInfo):
    """Where the group of the sender (rank 0) and the engine's workers meets."""

    master_address: str
    master_port: int
    world_size: int
    """1 + the engine's workers."""
    rank_offset: int = 1
    client_pid: int | None = None
    """The process that drives the engine: when it dies, the engine's processes end too."""
    transport: str = "gloo"
    """``gloo`` (host memory) or ``nccl`` (GPU to GPU)."""
    timeout_s: float | None = None
    """How long a broadcast waits (gloo; None: torch's default)."""

    def __post_init__(self) -> None:
        if self.transport not in ("gloo", "nccl"):
            raise ValueError(f"weight transfer transport {self.transport!r}: gloo or nccl")


@dataclass
class HostTransferUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: its tensors, in the order their bytes follow each other."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"a weight bucket of {len(self.names)} names, {len(self.dtype_names)} dtypes "
                f"and {len(self.shapes)} shapes: give one of each per tensor"
            )


class HostWeightTransferEngine(WeightTransferEngine[HostTransferInitInfo, HostTransferUpdateInfo]):
    """The worker side: receive each bucket over the gloo group, load it into the model."""

    init_info_cls = HostTransferInitInfo
    update_info_cls = HostTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.group = None
        self.transport = "gloo"
        self.reload: PolicyReload | None = None
        self.received_bytes = 0
        """Weight bytes this worker received (the relay-factor check reads it)."""

    def init_transfer_engine(self, init_info: HostTransferInitInfo) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        config = self.parallel_config
        rank = init_info.rank_offset + config.data_parallel_index * config.world_size + config.rank
        self.transport = init_info.transport
        if self.transport == "nccl":
            from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

            self.group = stateless_init_process_group(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                torch.accelerator.current_device_index(),
            )
        else:
            timeout = (
                None if init_info.timeout_s is None else timedelta(seconds=init_info.timeout_s)
            )
            self.group = stateless_init_torch_distributed_process_group(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                "gloo",
                timeout=timeout,
            )
        if init_info.client_pid is not None:
            threading.Thread(
                target=_end_with, args=(init_info.client_pid,), name="end-with-client", daemon=True
            ).start()

    def start_weight_update(self) -> None:
        self.reload = PolicyReload(self.model, self.model_config)
        self.reload.start()

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on CPU
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: HostTransferUpdateInfo) -> None:
        if self.group is None or self.reload is None:
            raise RuntimeError(
                f"weight transfer backend {BACKEND!r}: update_weights before "
                "init_weight_transfer_engine and start_weight_update"
            )
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        sizes = [
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in zip(update_info.shapes, dtypes, strict=True)
        ]
        if self.transport == "nccl":
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self.group.broadcast(flat, src=0, stream=torch.cuda.current_stream())
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            self.group.broadcast(flat, 0).wait()
        self.received_bytes += flat.numel()
        named = [
            (name, _view(chunk, dtype, shape))
            for name, dtype, shape, chunk in zip(
                update_info.names, dtypes, update_info.shapes, flat.split(sizes), strict=True
            )
        ]
        self.reload.load(VLLMWeights(named))

    def finish_weight_update(self) -> None:
        reload, self.reload = self.reload, None
        if reload is not None:
            reload.finish()

    def shutdown(self) -> None:
        if self.transport == "nccl" and self.group is not None:
            self.group.destroy()
        self.group = None


def _end_with(client: int) -> None:
    """End this worker, and its engine core, once ``client`` is gone.

    vLLM's engine core does not watch its client: a rollout process killed by torchrun
    (SIGKILL, or SIGTERM while blocked in a collective) would leave the engine's processes
    running. A worker whose parent is the engine core (vLLM's multiprocess executor) ends it
    too; a worker inside the engine core (its parent is the client) ends it by ending itself.
    """
    parent = os.getppid()
    engine_core = parent if parent != client else None
    while True:
        time.sleep(1.0)
        try:
            os.kill(client, 0)
        except ProcessLookupError:
            break
    log.error("the rollout process %d is gone: ending the vLLM engine's processes", client)
    if engine_core is not None:
        with contextlib.suppress(ProcessLookupError):  # another worker ended it already
            os.kill(engine_core, signal.SIGKILL)
    os._exit(1)


def _view(chunk: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """``chunk``'s bytes as a ``dtype`` tensor of ``shape`` (copied when its offset in the
    bucket is not a multiple of the element size, which ``view`` needs)."""
    if chunk.storage_offset() % torch.empty((), dtype=dtype).element_size():
        chunk = chunk.clone()
    return chunk.view(dtype).view(shape)


class HostTransferExtension:
    """vLLM's ``worker_extension_cls`` for engines that use ``BACKEND``: vLLM imports this
    class in each worker process before the model loads (``WorkerWrapperBase.init_worker``),
    and importing this module registers the backend there (it is mixed into the worker)."""

    def weight_bytes_received(self) -> int:
        """Weight bytes this worker received since its transfer engine started (called over
        ``collective_rpc``: every worker answers for itself)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return int(getattr(engine, "received_bytes", 0))


# once per process (a module is imported once): vLLM's workers find the backend by name
WeightTransferEngineFactory.register_engine(BACKEND, HostWeightTransferEngine)
