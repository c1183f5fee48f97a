"""Process-group helpers: one process, or many under ``torchrun`` (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_COLLECTIVE_TIMEOUT = timedelta(hours=1)
"""How long a process waits in one collective for the others when the config does not say
(``ProcessSettings.collective_timeout_s``); torch's own default, used when a group is made
without one, is 10 minutes for NCCL and 30 for gloo."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, local rank, its device, and how
    long its collectives wait for the other processes (its groups' timeout)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True inside a process started by ``torchrun`` (or a PyTorchJob)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(
    device: str = "auto",
    cpu_threads: int = 0,
    members: Sequence[int] | None = None,
    store=None,
    timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
) -> DistInfo:
    """Join the process group set up by torchrun, or describe a single process.

    ``device``: ``auto`` (CUDA when available), ``cpu`` or ``cuda``. ``cpu_threads`` > 0 sets
    torch's intra-op threads (on CPU). ``members``: the job is split (GRPO's dedicated
    engines) and this process's default group holds only these global ranks, built on
    ``store`` (the job's store); its rank is its place in ``members``. ``timeout``: how long
    a collective of the group waits for the other processes before it fails (given to the
    group explicitly: torch's default is 10 minutes for NCCL).
    """
    info = process_info(device, cpu_threads)
    if not launched_by_torchrun():
        return DistInfo(info.rank, info.world_size, info.local_rank, info.device, timeout)
    backend = "nccl" if info.device.type == "cuda" else "gloo"
    if members is not None:
        rank = list(members).index(info.rank)
        if not dist.is_initialized():
            world = dist.PrefixStore("world", store)
            dist.init_process_group(
                backend, store=world, rank=rank, world_size=len(members), timeout=timeout
            )
        return DistInfo(rank, len(members), info.local_rank, info.device, timeout)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), info.local_rank, info.device, timeout)


def process_info(device: str = "auto", cpu_threads: int = 0) -> DistInfo:
    """This process's place in its torchrun job (from the environment; no group is joined),
    with its device selected and its CPU threads set."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if cpu_threads and not use_cuda:
        torch.set_num_threads(cpu_threads)
    if not launched_by_torchrun():
        return DistInfo(0, 1, 0, torch.device("cuda" if use_cuda else "cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    return DistInfo(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=local_rank,
        device=torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"),
    )


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (the same seed on every rank)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def all_reduce_number(value: float, op, size: int, device, group=None) -> float:
    """``value`` reduced with ``op`` (a ``dist.ReduceOp``) over the ``size`` processes of
    ``group`` (None: the whole world); itself when there is one."""
    if size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def all_reduce_sum(value: float, info: DistInfo) -> float:
    """Sum a number over all processes (itself when there is one)."""
    return all_reduce_number(value, dist.ReduceOp.SUM, info.world_size, info.device)


def all_reduce_max(value: float, info: DistInfo) -> float:
    """The largest of a number over all processes (itself when there is one)."""
    return all_reduce_number(value, dist.ReduceOp.MAX, info.world_size, info.device)


def barrier(info: DistInfo) -> None:
    """Wait for every process (no-op for one)."""
    if info.world_size > 1:
        dist.barrier()


def broadcast_object(obj, info: DistInfo):
    """Rank 0's ``obj`` on every rank."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
