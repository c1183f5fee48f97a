"""How the policy's weights reach the rollout engines: which transport a run uses, and the
trainer's side of the direct one.

``select_transfer`` picks the transport from what the run is (device, colocated or dedicated
engines, engine family, whether the coordinator can import vLLM) and ``log_transfer`` says it
once per process:

- colocated HF: ``shared`` — the engine samples with the trained module (or an in-process copy).
- colocated vLLM: ``in_process_reload`` — vLLM's worker lives in the training process, the
  buckets go through its layerwise reload in place; nothing leaves the process (CUDA IPC would
  exchange handles to memory the worker can already read).
- dedicated HF: ``channel`` — the coordinator's gloo channel to each engine process, which is
  the process that loads them.
- dedicated vLLM on CUDA: ``nccl`` — one NCCL group of the coordinator (rank 0) and every
  TP worker of every engine (vLLM's ``nccl`` weight-transfer rendezvous and
  ``PyNcclCommunicator``, ``vllm/distributed/weight_transfer/nccl_common.py``); each worker
  receives each bucket straight from the trainer's GPU.
- dedicated vLLM without a GPU (CPU tests, the CPU demo), or where the coordinator's image
  has no vLLM: ``lingo_gloo`` — the same group over gloo, host memory.

In both dedicated vLLM transports the engine's client process (the rollout rank that built
the engine) only relays the RPCs (bucket names, dtypes and shapes): no weight byte goes through
it, so every byte an engine's process receives is one it loads (``relay_factor`` 1.0).

The buckets are pipelined (``pipelined``): the next one is drawn (a ZeRO-3 gather, a Megatron
export) on a side thread while the current one is on the wire, at most two alive at once.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from plan.engines import Transport, engine_spec

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class TransferChoice:
    """The transport of a run's weight syncs, and why it was chosen."""

    transport: Transport
    direct: bool
    """The trainer sends to every engine worker itself (no engine process forwards bytes)."""
    reason: str

    def describe(self) -> str:
        return f"{self.transport} ({self.reason})"


def select_transfer(
    device: str, colocate: bool, engine: str, sender_has_vllm: bool = True
) -> TransferChoice:
    """The weight-sync transport of a run.

    Args:
        device: the training device type, ``cuda`` or ``cpu``.
        colocate: the engines share the training processes (``rollout.colocate``).
        engine: ``rollout.engine``; its ``plan.EngineSpec`` gives the colocated and the
            dedicated transport.
        sender_has_vllm: the coordinator can import vLLM (its ``PyNcclCommunicator``); the
            Megatron branch's trainer image has none.

    Raises:
        ValueError: an unknown engine (``plan.UnknownSpecError``) or device.
    """
    spec = engine_spec(engine)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: cuda or cpu")
    if colocate:
        return TransferChoice(spec.colocated_transfer, False, spec.colocated_reason)
    if spec.dedicated_transfer != "nccl":
        return TransferChoice(spec.dedicated_transfer, True, spec.dedicated_reason)
    # NCCL needs the trainer's GPU and vLLM's PyNcclCommunicator; else gloo, host memory
    if device == "cuda" and sender_has_vllm:
        return TransferChoice("nccl", True, spec.dedicated_reason)
    if device == "cuda":
        return TransferChoice(
            "lingo_gloo",
            True,
            "dedicated vLLM on CUDA, but the trainer cannot import vLLM (no PyNcclCommunicator): "
            "gloo through host memory",
        )
    return TransferChoice("lingo_gloo", True, "dedicated vLLM without a GPU: gloo")


_LOGGED: set[TransferChoice] = set()


def log_transfer(choice: TransferChoice) -> bool:
    """Log the run's transport once per process; True when this call logged it."""
    if choice in _LOGGED:
        return False
    _LOGGED.add(choice)
    log.info("weight sync transport: %s", choice.describe())
    return True


def vllm_importable() -> bool:
    """The coordinator can import vLLM (for the NCCL transport's communicator)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pipelined(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """``items``, drawn on a side thread at most ``depth`` ahead of the caller: while the
    caller sends item k, item k+1 is being drawn (a ZeRO-3 gather of the next bucket), and no
    more than ``depth`` items (the one the caller holds included) are alive at once.

    The drawing thread runs on the caller's CUDA device (a new thread starts on device 0).
    An error while drawing raises here, in the caller, at the item it stopped.
    """
    if depth < 1:
        raise ValueError(f"depth={depth}: at least 1")
    slots = threading.Semaphore(depth)
    handoff: queue.Queue = queue.Queue()
    stop = threading.Event()
    done = object()
    cuda = torch.cuda.current_device() if torch.cuda.is_available() else None

    def draw() -> None:
        if cuda is not None:
            torch.cuda.set_device(cuda)
        try:
            for item in items:
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                handoff.put(item)
            handoff.put(done)
        except BaseException as exc:  # raised in the caller's thread
            handoff.put(exc)

    thread = threading.Thread(target=draw, name="weight-bucket-gather", daemon=True)
    thread.start()
    try:
        while True:
            item = handoff.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            del item
            slots.release()
    finally:
        stop.set()
        thread.join()


def relay_factor(received: dict[str, int], needed: dict[str, int]) -> float:
    """The worst, over an engine's processes, of bytes a process received ÷ bytes it loads
    (1.0: nobody forwards; a process that receives bytes it does not load, a relay, makes it
    infinite).

    Args:
        received: bytes received per engine process.
        needed: bytes each of them loads (a TP worker takes the whole of each bucket: its
            loaders keep its shard).
    """
    worst = 0.0
    for process, got in received.items():
        want = needed.get(process, 0)
        if got and not want:
            return float("inf")
        if want:
            worst = max(worst, got / want)
    return worst


@dataclass
class SendStats:
    """What a sender put on the wire: per bucket, its bytes and the collectives it took."""

    buckets: int = 0
    bytes: int = 0
    collectives: int = 0
    seconds: list[float] = field(default_factory=list)

    @property
    def collectives_per_bucket(self) -> float:
        return self.collectives / self.buckets if self.buckets else 0.0


def free_port(host: str = "") -> tuple[socket.socket, int]:
    """A bound listening socket and its port (handed to the store, no race on the port)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    return listener, listener.getsockname()[1]


class GlooSender:
    """The trainer's end (rank 0) of the ``lingo_gloo`` group: one broadcast per bucket of its
    flat bytes, from host memory. Plain torch (no vLLM import): the workers join with vLLM's
    ``stateless_init_torch_distributed_process_group``, whose store prefix (``tcp://host:port``)
    and gloo backend this mirrors.

    Args:
        host: the address the workers reach this process at.
        world_size: 1 + every engine's TP workers.
        timeout: how long a broadcast waits for the workers.
    """

    transport = "lingo_gloo"

    def __init__(self, host: str, world_size: int, timeout: timedelta) -> None:
        self.host, self.world_size, self.timeout = host, world_size, timeout
        self.listener, self.port = free_port()
        self.group = None
        self.stats = SendStats()

    def connect(self) -> None:
        """Host the group's store and join it (returns once every worker has joined)."""
        fd = self.listener.detach()
        store = dist.TCPStore(
            self.host,
            self.port,
            self.world_size,
            is_master=True,
            timeout=self.timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
            multi_tenant=True,
        )
        prefix = dist.PrefixStore(f"tcp://{self.host}:{self.port}", store)
        self.group = dist.ProcessGroupGloo(prefix, 0, self.world_size, self.timeout)

    def send(self, flat: torch.Tensor) -> None:
        """Broadcast one bucket's bytes (a uint8 tensor) to every worker."""
        started = time.monotonic()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([flat.cpu()], options).wait(self.timeout)
        self._count(flat, started)

    def _count(self, flat: torch.Tensor, started: float) -> None:
        self.stats.buckets += 1
        self.stats.collectives += 1
        self.stats.bytes += flat.numel() * (self.world_size - 1)
        self.stats.seconds.append(time.monotonic() - started)

    def close(self) -> None:
        if self.group is not None and hasattr(self.group, "shutdown"):
            self.group.shutdown()
        self.group = None


class NcclSender(GlooSender):
    """The trainer's end (rank 0) of the ``nccl`` group: vLLM's rendezvous
    (``nccl_common.trainer_init``: a ``StatelessProcessGroup`` store, then a
    ``PyNcclCommunicator`` on this process's GPU), one broadcast per bucket from the GPU."""

    transport = "nccl"

    def __init__(self, host: str, world_size: int, timeout: timedelta) -> None:
        self.host, self.world_size, self.timeout = host, world_size, timeout
        self.listener, self.port = free_port()
        self.listener.close()  # vLLM's StatelessProcessGroup binds the port itself
        self.group = None
        self.stats = SendStats()

    def connect(self) -> None:
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError as exc:
            raise ImportError(
                "the nccl weight transport needs vLLM in the trainer's image (pip install "
                "'lingo-rl[vllm]'), or select lingo_gloo"
            ) from exc
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = trainer_init(
            {"master_address": self.host, "master_port": self.port, "world_size": self.world_size},
            rank=0,
        )

    def send(self, flat: torch.Tensor) -> None:
        """Broadcast one bucket's bytes from the GPU the group was opened on (from any
        thread: a new thread starts on device 0)."""
        started = time.monotonic()
        with torch.cuda.device(self.device):
            on_device = flat.to(self.device, non_blocking=True)
            stream = torch.cuda.current_stream()
            self.group.broadcast(on_device, src=0, stream=stream)
            stream.synchronize()
        self._count(flat, started)

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
        self.group = None


def open_sender(
    choice: TransferChoice, host: str, world_size: int, timeout: timedelta
) -> GlooSender:
    """The trainer's end of a direct transport (``nccl`` or ``lingo_gloo``), not yet joined."""
    if choice.transport == "nccl":
        return NcclSender(host, world_size, timeout)
    if choice.transport == "lingo_gloo":
        return GlooSender(host, world_size, timeout)
    raise ValueError(f"weight transport {choice.transport!r} has no trainer-side sender")
