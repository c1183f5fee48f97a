"""Rollout engines in processes of their own (dedicated, non-hybrid placement).

In one GRPO job the placement plan (``trainer.placement``) makes the first ranks training
processes and the last ones rollout-only processes, each running an engine on its own
device. The trainer's coordinator (rank 0) drives them over ``torch.distributed`` (gloo on
CPU, NCCL on GPU) with ``RemoteRolloutEngine``, which has the rollout-engine interface the
loop already uses (``generate``, ``sync_weights``, ``token_log_probs``): prompts and seeds go
out, each engine generates its contiguous share of the prompt slots, the rollouts come back;
after each update the policy's weights go to each engine once, in buckets of at most
``bucket_bytes``, the next drawn while one is on the wire (``weight_transfer.pipelined``):
to a vLLM engine's TP workers straight from the coordinator (``DirectTransfer``: NCCL on
GPUs, gloo without; the engine's first process only relays the RPCs), to an HF engine's
process (the one that loads them) over a channel. A rollout process runs ``serve`` until
the coordinator says stop.

The job is split in two worlds (``run_grpo``): the training processes' default process
group holds only them, so DeepSpeed, checkpoints and every barrier see exactly the world
they would see without engines; the coordinator and the rollout processes talk over a
``Channel``, a gloo process group of their own built from the job's store, outside every
default group; an HF engine's weights travel on a second one, of the coordinator and each
engine's first process only (``trainer.grpo.channels``), so no process receives weights it drops.
Every message is a collective over its channel, in the same order on every member, so a lost
member stops the others: torchrun then ends the job (a failing process ends all of them, exit
non-zero). With
several training processes, only the coordinator talks to the engines; ``SharedRemote``
hands the rollouts (and the sync check's scores) to the other training processes over their
own group, and has them take part in the weight stream (ZeRO-3 gathers each parameter
collectively).

Start-up: either side can take long to get ready (an engine builds vLLM: minutes at 20B; the
trainers load and partition the policy), and a process waiting in a collective for the other
side waits only its group's timeout. So each side says in the job's store when it is ready
(``announce_ready``: a rollout process once its engine is built, a training process before
the first collective that needs the engines) and waits there for the other
(``wait_until_ready``, bounded by ``rollout.start_timeout_s``) before it enters one.

Two images, two torch builds: in the Megatron branch the trainers run NGC's torch and the
engines the GPU image's, in one job. Before a channel's first collective its members say
which torch and Python they run (``check_torch_releases``); the coordinator logs the set once,
and warns when the torch releases differ, with what was measured of that pair
(``MEASURED_RELEASE_PAIRS``; ``bench/channel_compat.py`` measures a pair).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import torch

from capacity.measured import tensor_bytes
from trainer.distributed import DistInfo, broadcast_object
from trainer.grpo.channels import Channel
from trainer.grpo.rollout import (
    LocalRequests,
    Rollout,
    RolloutEngine,
    group_size,
)
from trainer.grpo.vllm_weights import weight_buckets
from trainer.grpo.weight_transfer import GlooSender, TransferChoice, open_sender, pipelined

log = logging.getLogger(__name__)

GENERATE, SYNC, LOG_PROBS, STOP, CONNECT = "generate", "sync", "log_probs", "stop", "connect"
BUCKET, END = "bucket", "end"


@dataclass
class Generated:
    """An engine's answer to a generate request: its rollouts and where its time went."""

    rollouts: list[Rollout]
    busy_s: float
    """Seconds it spent generating them."""
    idle_s: float
    """Seconds it had waited for work since its previous generate answer (the rollout
    side's idle time: while the trainer updated, synced or evaluated)."""


def engine_slots(n_prompts: int, engines: int, engine: int) -> range:
    """The prompt slots engine ``engine`` of ``engines`` generates: a contiguous share, the
    first ``n_prompts % engines`` engines taking one more."""
    base, extra = divmod(n_prompts, engines)
    start = engine * base + min(engine, extra)
    return range(start, start + base + (engine < extra))


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a weight stream into buckets of at most ``bucket_bytes`` (a larger tensor is a
    bucket of its own; ``vllm_weights.weight_buckets``); each tensor is copied once, as it is
    drawn, so the producer may free it."""
    copies = ((name, tensor.detach().clone()) for name, tensor in named_tensors)
    return weight_buckets(copies, bucket_bytes)


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], device) -> tuple[list, torch.Tensor]:
    """One byte tensor holding the bucket, and how to cut it back: (name, dtype, shape)."""
    spec = [(name, t.dtype, tuple(t.shape)) for name, t in bucket]
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])
    return spec, flat.to(device)


def _unflat(spec: list, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for name, dtype, shape in spec:
        size = torch.empty((), dtype=dtype).element_size()
        count = torch.Size(shape).numel() * size
        chunk = flat[offset : offset + count]
        if offset % size:  # view() needs an offset that is a multiple of the element size
            chunk = chunk.clone()
        yield name, chunk.view(dtype).view(shape)
        offset += count


@dataclass(frozen=True)
class DirectTransfer:
    """The coordinator's direct weight transport to dedicated vLLM engines
    (``trainer.grpo.weight_transfer``): one group of the coordinator (rank 0) and every TP
    worker of every engine, engine after engine.

    Attributes:
        choice: ``nccl`` or ``lingo_gloo``.
        workers: each engine's TP workers, engine order.
        host: the address the workers reach the coordinator at.
        timeout: how long a broadcast waits for the workers.
    """

    choice: TransferChoice
    workers: tuple[int, ...]
    host: str
    timeout: timedelta

    @property
    def world_size(self) -> int:
        return 1 + sum(self.workers)

    def init_infos(self, port: int) -> list[dict]:
        """Each engine's ``init_weight_transfer_engine`` payload (``vllm_transfer``'s init
        info): the group's address, its size, and where the engine's workers start in it."""
        transport = "nccl" if self.choice.transport == "nccl" else "gloo"
        return [
            {
                "master_address": self.host,
                "master_port": port,
                "world_size": self.world_size,
                "rank_offset": 1 + sum(self.workers[:engine]),
                "transport": transport,
                "timeout_s": self.timeout.total_seconds(),
            }
            for engine in range(len(self.workers))
        ]


class RemoteRolloutEngine:
    """The coordinator's handle on the dedicated engines (rank 0 of the job).

    Args:
        engine_ranks: each engine's lead rank (the one that answers and loads the weights),
            engine order.
        channel: the coordinator's (leader) and every rollout rank's ``Channel``.
        bucket_bytes: largest weight bucket sent at once.
        weights: the channel of the coordinator and the engines' lead ranks, on which the
            weights travel (``open_channels``; None: ``channel``); with ``direct``, only the
            buckets' names, dtypes and shapes.
        direct: send the weights to every engine worker from here (vLLM engines); None: over
            ``weights`` to the engines' lead ranks, which load them (HF engines).
    """

    overlaps = True

    def __init__(
        self,
        engine_ranks: Sequence[int],
        channel: Channel,
        bucket_bytes: int = 64 << 20,
        weights: Channel | None = None,
        direct: DirectTransfer | None = None,
    ) -> None:
        self.engine_ranks = list(engine_ranks)
        self.direct = direct
        self.sender: GlooSender | None = None
        self.channel = channel
        self.weights = weights or channel
        self.bucket_bytes = bucket_bytes
        self.closed = False
        self.in_flight: int | None = None
        """The prompt count of the generate request the engines are working on."""
        self.last_busy_s = self.last_idle_s = 0.0

    def _send(self, message: tuple) -> None:
        if self.in_flight is not None and message[0] != STOP:
            raise RuntimeError(
                f"{message[0]} while a generate request is in flight: collect it first (the "
                "engines answer one request at a time)"
            )
        self.channel.broadcast_object(message)

    def _engine_answers(self) -> list:
        """Each engine's answer (its lead rank's), engine order."""
        answers = self.channel.gather_objects(None)
        return [answers[self.channel.members.index(r)] for r in self.engine_ranks]

    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        self.submit(prompts, seeds)
        return self.collect()

    def submit(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> None:
        """Start generating (the engines work while the caller does something else); nothing
        else may be sent before ``collect``."""
        if self.in_flight is not None:
            raise RuntimeError("a generate request is already in flight: collect it first")
        group_size(prompts, seeds)
        self._send((GENERATE, list(prompts), [list(s) for s in seeds]))
        self.in_flight = len(prompts)

    def collect(self) -> list[Rollout]:
        """The rollouts of the request in flight (waits for every engine). ``last_busy_s`` and
        ``last_idle_s`` say, for the slowest engine, how long it generated and how long it had
        waited for this request."""
        if self.in_flight is None:
            raise RuntimeError("no generate request in flight")
        n_prompts, self.in_flight = self.in_flight, None
        out: list[Rollout] = []
        answers = self._engine_answers()
        for engine, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                raise RuntimeError(f"rollout engine {engine} failed: {answer!r}") from answer
        for engine, answer in enumerate(answers):
            first = engine_slots(n_prompts, len(self.engine_ranks), engine).start
            out += [replace(r, prompt_index=first + r.prompt_index) for r in answer.rollouts]
        self.last_busy_s = max(a.busy_s for a in answers)
        self.last_idle_s = max(a.idle_s for a in answers)
        return out

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Each bucket to every engine once: to each vLLM worker straight from here
        (``direct``), or to each engine's lead rank; the next bucket is drawn (gathered) while
        one is on the wire (``pipelined``). Returns the weight bytes sent (each receiving
        process counted)."""
        if self.direct is not None and self.sender is None:
            self._connect()
        self._send((SYNC, self.sender is not None))
        sent = 0
        for bucket in pipelined(buckets(named_tensors, self.bucket_bytes)):
            spec, flat = flatten_bucket(bucket, torch.device("cpu"))
            self.weights.broadcast_object((BUCKET, spec, flat.numel()))
            if self.sender is not None:
                self.sender.send(flat)
                sent += tensor_bytes([flat]) * (self.sender.world_size - 1)
            else:
                self.weights.broadcast_tensor(flat)
                sent += tensor_bytes([flat]) * (len(self.weights.members) - 1)
        self.weights.broadcast_object((END,))
        failures = [a for a in self._engine_answers() if isinstance(a, BaseException)]
        if failures:
            raise RuntimeError(f"a rollout engine failed to load the weights: {failures[0]!r}")
        return sent

    def _connect(self) -> None:
        """Open the direct group: each engine's lead has its workers join it (at their
        ``rank_offset``) while this process joins as rank 0."""
        direct = self.direct
        sender = open_sender(direct.choice, direct.host, direct.world_size, direct.timeout)
        self._send((CONNECT, direct.init_infos(sender.port)))
        sender.connect()
        answers = self._engine_answers()
        failures = [a for a in answers if isinstance(a, BaseException)]
        if failures:
            raise RuntimeError(
                f"a rollout engine's workers failed to join the {direct.choice.transport} "
                f"weight group: {failures[0]!r}"
            )
        self.sender = sender
        log.info(
            "weight group: the coordinator and %d vLLM workers of %d engines over %s",
            direct.world_size - 1,
            len(direct.workers),
            direct.choice.transport,
        )

    def token_log_probs(self, prompt: list[int], response: list[int]) -> list[float]:
        """Engine 0's log-probs of ``response`` after ``prompt``."""
        return self.token_log_probs_per_engine(prompt, response)[0]

    def token_log_probs_per_engine(
        self, prompt: list[int], response: list[int]
    ) -> list[list[float]]:
        """Every engine's log-probs of the probe (each loaded the weights on its own: the
        sync check compares each with the policy)."""
        self._send((LOG_PROBS, list(prompt), list(response)))
        answers = self._engine_answers()
        for engine, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                raise RuntimeError(f"rollout engine {engine} failed to score: {answer!r}")
        return answers

    def sleep(self) -> None:
        """Nothing to free here: the engines own their devices."""

    def close(self) -> None:
        """Tell the engines to stop (once); a request still in flight is collected first."""
        if not self.closed:
            self.closed = True
            if self.in_flight is not None:
                self.collect()
            self._send((STOP,))
            self.channel.close()
            if self.weights is not self.channel:
                self.weights.close()
            if self.sender is not None:
                self.sender.close()


class EngineFollower(LocalRequests):
    """A rollout process of a multi-process engine that another process of it runs (a vLLM
    engine of tensor parallel ``k`` is ``k`` processes of the plan; its first one starts
    vLLM's workers on the engine's GPUs): it takes part in every message, answers nothing
    (the coordinator reads each engine's first process only) and receives no weights (they
    go to the engine's first process, which loads them)."""

    overlaps = False

    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        return []

    def sleep(self) -> None:
        """Nothing to free."""

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return 0

    def token_log_probs(self, prompt: list[int], response: list[int]) -> list[float]:
        return []

    def token_log_probs_per_engine(
        self, prompt: list[int], response: list[int]
    ) -> list[list[float]]:
        return []


def serve(
    engine: RolloutEngine,
    engine_index: int,
    engines: int,
    channel: Channel,
    weights: Channel | None = None,
) -> int:
    """Run a rollout process: answer the coordinator until it says stop; returns the number
    of generate requests served. ``weights``: the channel the weights come on (an engine's
    lead rank; None: a process that receives none, ``EngineFollower``). An engine error goes
    back to the coordinator as the answer (it raises there, naming the engine), and this
    process keeps serving until the coordinator stops it."""
    served, idle = 0, 0.0
    while True:
        waiting = time.monotonic()
        kind, *args = channel.broadcast_object()
        idle += time.monotonic() - waiting
        if kind == STOP:
            log.info("rollout engine %d: stop after %d requests", engine_index, served)
            if hasattr(engine, "close"):  # an engine with processes of its own
                engine.close()
            channel.close()
            if weights is not None and weights is not channel:
                weights.close()
            return served
        answer: object
        if kind == GENERATE:
            prompts, seeds = args
            mine = engine_slots(len(prompts), engines, engine_index)
            started = time.monotonic()
            answer = _attempt(engine.generate, [prompts[s] for s in mine], [seeds[s] for s in mine])
            if not isinstance(answer, BaseException):
                answer = Generated(answer, time.monotonic() - started, idle)
                idle = 0.0
            served += 1
        elif kind == CONNECT and weights is None:
            answer = None  # its engine's lead has the workers join
        elif kind == CONNECT:
            (infos,) = args
            answer = _attempt(engine.join_transfer, infos[engine_index])
        elif kind == SYNC and weights is None:
            answer = _attempt(engine.sync_weights, ())  # its engine's lead loads them
        elif kind == SYNC and args[0]:  # the trainer sends to the workers: relay the RPCs
            answer = _attempt(engine.receive_weights, weights)
        elif kind == SYNC:
            received = _ReceivedWeights(weights)
            answer = _attempt(engine.sync_weights, received)
            for _ in received:  # drain what a failed load left, to stay in step
                pass
        elif kind == LOG_PROBS:
            prompt, response = args
            answer = _attempt(engine.token_log_probs, prompt, response)
        else:
            raise RuntimeError(f"rollout engine {engine_index}: unknown message {kind!r}")
        channel.gather_objects(answer)


def _attempt(call, *args):
    try:
        return call(*args)
    except Exception as exc:  # the coordinator raises it, naming this engine
        log.exception("rollout engine call failed")
        return exc


class _ReceivedWeights:
    """The weight buckets the coordinator broadcasts, as a (name, tensor) stream (in host
    memory; an engine on a GPU copies each tensor onto its device as it loads it)."""

    def __init__(self, channel: Channel) -> None:
        self.channel, self.done = channel, False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while not self.done:
            message = self.channel.broadcast_object()
            if message[0] == END:
                self.done = True
                return
            _, spec, size = message
            flat = torch.empty(size, dtype=torch.uint8)
            self.channel.broadcast_tensor(flat)
            yield from _unflat(spec, flat)


class SharedRemote:
    """The dedicated engines as every training process sees them when there are several.

    The coordinator (training rank 0) holds the ``RemoteRolloutEngine``; the step's rollouts,
    the engines' timings and the sync check's scores go from it to the other training
    processes over their default group; every process draws the whole weight stream (under
    ZeRO-3 each parameter is gathered collectively), and only the coordinator sends it.
    """

    overlaps = True

    def __init__(self, remote: RemoteRolloutEngine | None, info: DistInfo) -> None:
        self.remote = remote
        self.info = info
        self.last_busy_s = self.last_idle_s = 0.0

    def _from_coordinator(self, value=None):
        return broadcast_object(value, self.info)

    def submit(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> None:
        if self.remote is not None:
            self.remote.submit(prompts, seeds)

    def collect(self) -> list[Rollout]:
        answer = None
        if self.remote is not None:
            answer = (self.remote.collect(), self.remote.last_busy_s, self.remote.last_idle_s)
        rollouts, self.last_busy_s, self.last_idle_s = self._from_coordinator(answer)
        return rollouts

    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        self.submit(prompts, seeds)
        return self.collect()

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The bytes the coordinator sent (0 on the other training processes)."""
        if self.remote is not None:
            return self.remote.sync_weights(named_tensors)
        for _ in named_tensors:  # this process's part of each collective gather
            pass
        return 0

    def token_log_probs(self, prompt: list[int], response: list[int]) -> list[float]:
        return self.token_log_probs_per_engine(prompt, response)[0]

    def token_log_probs_per_engine(
        self, prompt: list[int], response: list[int]
    ) -> list[list[float]]:
        scores = None
        if self.remote is not None:
            scores = self.remote.token_log_probs_per_engine(prompt, response)
        return self._from_coordinator(scores)

    def sleep(self) -> None:
        """Nothing to free here: the engines own their devices."""

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
