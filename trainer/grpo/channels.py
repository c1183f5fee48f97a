"""The channels between GRPO's coordinator and its rollout processes: the job's store, a
``Channel`` (a gloo process group of its own, outside every default group; ``open_channels``
builds the coordinator's and each engine's), the start-up handshake in the store
(``announce_ready``, ``wait_until_ready``) and the torch releases each side runs
(``check_torch_releases``, warned against ``MEASURED_RELEASE_PAIRS``). See
``trainer.grpo.remote`` for the engines that use them."""

from __future__ import annotations

import json
import logging
import os
import pickle
import platform
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from capacity.measured import tensor_bytes

log = logging.getLogger(__name__)

CHANNEL_TIMEOUT = timedelta(hours=2)
"""How long a channel member waits for the next message by default (runs give theirs:
``collective_timeout_s``): a training step, an eval or a checkpoint of a large model happen
between two (a dead peer is noticed at once: its connection closes)."""


def job_store(timeout: timedelta = CHANNEL_TIMEOUT) -> dist.Store:
    """The torchrun job's key-value store: the elastic agent's (``TORCHELASTIC_USE_AGENT_STORE``,
    what torchrun and PyTorchJobs start), else one hosted by rank 0 at
    ``MASTER_ADDR:MASTER_PORT``; keys are prefixed with the restart attempt."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent and rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"lingo-rl/{attempt}", store)


CHANNEL_PICKLE_PROTOCOL = 4
"""The channels' pickle protocol, stated rather than Python's default: the two ends may run
two images (docs/megatron.md, "Two torch releases in one job"), and a numpy 2 array pickled
with protocol 5 (Python 3.14's default) names ``numpy._core``, which numpy 1.x cannot load;
with protocol 4 numpy 2 writes the names both read."""


def channel_pickle(obj) -> bytes:
    """``obj`` as the channels send it (``CHANNEL_PICKLE_PROTOCOL``)."""
    return pickle.dumps(obj, protocol=CHANNEL_PICKLE_PROTOCOL)


class Channel:
    """A gloo process group of ``members`` (global ranks; member 0 leads) outside every
    default group: the coordinator and the rollout processes. Objects go as pickled byte
    tensors (the job's own processes), tensors as they are.

    Args:
        store: the job's store (``job_store``); ``name`` keys the group in it.
        members: the global ranks of the group, the leader first.
        rank: this process's global rank (one of ``members``).
    """

    def __init__(
        self,
        store: dist.Store,
        members: Sequence[int],
        rank: int,
        name: str = "rollout",
        timeout: timedelta = CHANNEL_TIMEOUT,
    ) -> None:
        self.members = list(members)
        self.index = self.members.index(rank)
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"channel/{name}", store), self.index, len(self.members), timeout
        )
        self.broadcast_bytes = 0
        """Bytes of the broadcasts so far: received (a member), or sent to every other member
        (the leader, counted once per receiver)."""
        self.broadcasts = 0
        """Broadcast collectives so far (an object is two: its size, then its bytes)."""

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """The leader's ``tensor`` into every member's (same shape and dtype)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        self.broadcasts += 1
        receivers = len(self.members) - 1 if self.index == 0 else 1
        self.broadcast_bytes += tensor_bytes([tensor]) * receivers

    def broadcast_object(self, obj=None):
        """The leader's ``obj`` on every member (others pass nothing)."""
        data = channel_pickle(obj) if self.index == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.broadcast_tensor(size)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.index == 0
            else torch.empty(int(size), dtype=torch.uint8)
        )
        self.broadcast_tensor(buffer)
        return obj if self.index == 0 else pickle.loads(buffer.numpy().tobytes())

    def gather_objects(self, obj) -> list | None:
        """Every member's ``obj`` on the leader, by member index (None elsewhere)."""
        data = channel_pickle(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in self.members]
        self.group.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        width = max(int(s) for s in sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.index != 0:
            self.group.gather([], [mine], options).wait()
            return None
        out = [torch.empty(width, dtype=torch.uint8) for _ in self.members]
        self.group.gather([out], [mine], options).wait()
        return [
            pickle.loads(buf[: int(n)].numpy().tobytes()) for buf, n in zip(out, sizes, strict=True)
        ]

    def close(self) -> None:
        """Shut the group down (after the last message: at interpreter exit gloo can abort)."""
        if hasattr(self.group, "shutdown"):
            self.group.shutdown()


_BIT_EXACT = (
    "measured in one job: the store, this handshake and every channel message bit-exact, a "
    "64 MiB weight bucket included, whichever side hosts the store"
)
MEASURED_RELEASE_PAIRS: dict[frozenset[str], str] = {
    frozenset({"2.9", "2.13"}): f"torch 2.9.0 (for NGC 25.10's 2.9.0a0) and 2.13.0 {_BIT_EXACT}",
    frozenset({"2.9", "2.14"}): f"torch 2.9.0 (for NGC 25.10's 2.9.0a0) and 2.14.0 {_BIT_EXACT}",
}
"""Pairs of torch releases (major.minor) whose processes were run as one job's two sides
with ``bench/channel_compat.py`` (the job's TCPStore and gloo channels, both orders), and
what it found (docs/megatron.md, "Two torch releases in one job")."""


def torch_release(version: str) -> str:
    """The release (``major.minor``) of a torch version string (``2.9.0a0+145a3a7bda.nv25.10``:
    ``2.9``), by which the handshake compares the members' builds."""
    return ".".join(version.split("+")[0].split(".")[:2])


def runtime_versions() -> dict[str, str]:
    """This process's torch and Python versions, as the channel members compare them."""
    return {"torch": torch.__version__, "python": platform.python_version()}


def _numeric(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split(".") if part.isdigit())


def _late_ranks(
    store: dist.Store, ranks: Sequence[int], key: Callable[[int], str], timeout: timedelta
) -> list[int]:
    """Wait until every rank's ``key(rank)`` is in the store; the ranks whose key is still
    missing after ``timeout`` (none: all arrived)."""
    try:
        store.wait([key(rank) for rank in ranks], timeout)
    except RuntimeError:  # torch's DistStoreError on a timeout
        return [rank for rank in ranks if not store.check([key(rank)])]
    return []


def _versions_key(rank: int) -> str:
    return f"versions/{rank}"


def check_torch_releases(
    store: dist.Store, members: Sequence[int], rank: int, timeout: timedelta
) -> dict[int, dict[str, str]] | None:
    """The channels' handshake, in the store, before their first collective: process
    ``rank`` publishes its torch and Python versions; the coordinator (rank 0) waits for
    every member's, logs them once, and warns when their torch releases differ (the
    trainers' image and the engines' carry two torch builds), saying what was measured of
    that pair. Returns the members' versions by rank on the coordinator (None elsewhere).

    Raises:
        TimeoutError: on the coordinator, a member has not published after ``timeout``.
    """
    store.set(_versions_key(rank), json.dumps(runtime_versions()))
    if rank != 0:
        return None
    late = _late_ranks(store, members, _versions_key, timeout)
    if late:
        raise TimeoutError(
            f"rollout channel members {late} did not start within "
            f"{timeout.total_seconds():.0f} s (collective_timeout_s): look for their errors "
            "in the job's logs"
        )
    versions = {r: json.loads(store.get(_versions_key(r))) for r in members}
    by_build: dict[tuple[str, str], list[int]] = {}
    for r, v in versions.items():
        by_build.setdefault((v["torch"], v["python"]), []).append(r)
    sides = "; ".join(f"torch {t} (Python {py}) on ranks {rs}" for (t, py), rs in by_build.items())
    log.info("rollout channel members: %s", sides)
    releases = sorted({torch_release(v["torch"]) for v in versions.values()}, key=_numeric)
    if len(releases) > 1:
        pairs = [frozenset({a, b}) for i, a in enumerate(releases) for b in releases[i + 1 :]]
        found = [MEASURED_RELEASE_PAIRS[pair] for pair in pairs if pair in MEASURED_RELEASE_PAIRS]
        unmeasured = [
            " and ".join(sorted(pair, key=_numeric))
            for pair in pairs
            if pair not in MEASURED_RELEASE_PAIRS
        ]
        if unmeasured:
            found.append(
                f"torch {', '.join(unmeasured)} not measured together: run "
                "bench/channel_compat.py with both images' Python before relying on it, or "
                "give both images one torch release"
            )
        log.warning(
            'two torch releases in one job (%s): %s; %s (docs/megatron.md, "Two torch '
            'releases in one job")',
            " and ".join(releases),
            sides,
            "; ".join(found),
        )
    return versions


def open_channels(
    store: dist.Store,
    rollout_ranks: Sequence[int],
    engine_leads: Sequence[int],
    rank: int,
    timeout: timedelta = CHANNEL_TIMEOUT,
) -> tuple[Channel | None, Channel | None]:
    """This process's channels: the messages' (the coordinator, rank 0, and every rollout
    process) and the weights' (the coordinator and each engine's first process, the one that
    loads them); None where it is not a member. With one process per engine they are one.
    Each member first says which torch it runs (``check_torch_releases``)."""
    rollout_ranks, engine_leads = list(rollout_ranks), list(engine_leads)
    messages = weights = None
    if rank == 0 or rank in rollout_ranks:
        check_torch_releases(store, (0, *rollout_ranks), rank, timeout)
        messages = Channel(store, (0, *rollout_ranks), rank, timeout=timeout)
    if engine_leads == rollout_ranks:
        return messages, messages
    if rank == 0 or rank in engine_leads:
        weights = Channel(store, (0, *engine_leads), rank, name="weights", timeout=timeout)
    return messages, weights


def _ready_key(rank: int) -> str:
    return f"ready/{rank}"


def announce_ready(store: dist.Store, rank: int) -> None:
    """Process ``rank`` is ready for the collectives it shares with the other side (a rollout
    process: its engine is built; a training process: its policy is loaded)."""
    store.set(_ready_key(rank), "1")


def wait_until_ready(
    store: dist.Store, ranks: Sequence[int], timeout: timedelta, what: str
) -> None:
    """Wait, outside every collective, until the processes ``ranks`` (``what``, for the
    error) have announced they are ready.

    Raises:
        TimeoutError: one has not after ``timeout`` (``rollout.start_timeout_s``).
    """
    waiting = [rank for rank in ranks if not store.check([_ready_key(rank)])]
    if not waiting:
        return
    started = time.monotonic()
    late = _late_ranks(store, waiting, _ready_key, timeout)
    if late:
        raise TimeoutError(
            f"{what} {late} not ready after {timeout.total_seconds():.0f} s "
            "(rollout.start_timeout_s): look for their errors in the job's logs, or give "
            "them longer"
        )
    log.info("waited %.1f s for %s %s", time.monotonic() - started, what, waiting)
