"""Rollout engines in processes of their own (dedicated, non-hybrid placement).

In one GRPO job the placement plan (``trainer.placement``) makes the first ranks training
processes and the last ones rollout-only processes, each running an engine on its own
device. The trainer's coordinator (rank 0) drives them over ``torch.distributed`` (gloo on
CPU, NCCL on GPU) with ``RemoteRolloutEngine``, which has the rollout-engine interface the
loop already uses (``generate``, ``sync_weights``, ``token_log_probs``): prompts and seeds go
out, each engine generates its contiguous share of the prompt slots, the rollouts come back;
after each update the policy's weights are broadcast to every engine in buckets of at most
``bucket_bytes``, streamed (a bucket is sent as soon as it is full, and the engine loads it
before the next arrives). A rollout process runs ``serve`` until the coordinator says stop.

Every message is a collective over ``group`` (the coordinator and the rollout ranks), in the
same order on every member, so a lost member stops the others: torchrun then ends the job
(a failing process ends all of them, exit non-zero).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from trainer.grpo.rollout import Rollout, RolloutEngine, group_size

log = logging.getLogger(__name__)

GENERATE, SYNC, LOG_PROBS, STOP = "generate", "sync", "log_probs", "stop"
BUCKET, END = "bucket", "end"


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
    bucket of its own); each tensor is copied once, so the producer may free it."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().clone()))
        size += nbytes
    if bucket:
        yield bucket


def _flat(bucket: list[tuple[str, torch.Tensor]], device) -> tuple[list, torch.Tensor]:
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


class RemoteRolloutEngine:
    """The coordinator's handle on the dedicated engines (rank 0 of the job).

    Args:
        engine_ranks: each engine's lead rank (the one that answers), engine order.
        group: the process group of the coordinator and every rollout rank (None: the world).
        device: where byte buffers go for the backend (CPU for gloo, the GPU for NCCL).
        bucket_bytes: largest weight bucket sent at once.
    """

    def __init__(
        self,
        engine_ranks: Sequence[int],
        group=None,
        device: torch.device | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        self.engine_ranks = list(engine_ranks)
        self.group = group
        self.device = device or torch.device("cpu")
        self.bucket_bytes = bucket_bytes
        self.closed = False

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def _answers(self) -> list:
        """Every member's answer, by group rank (the coordinator's is None)."""
        out: list = [None] * dist.get_world_size(self.group)
        dist.gather_object(None, out, dst=0, group=self.group)
        return out

    def _engine_answers(self) -> list:
        answers = self._answers()
        members = dist.get_process_group_ranks(self.group) if self.group else None
        index = [members.index(r) if members else r for r in self.engine_ranks]
        return [answers[i] for i in index]

    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        group_size(prompts, seeds)
        self._send((GENERATE, list(prompts), [list(s) for s in seeds]))
        out: list[Rollout] = []
        for engine, answer in enumerate(self._engine_answers()):
            first = engine_slots(len(prompts), len(self.engine_ranks), engine).start
            if isinstance(answer, BaseException):
                raise RuntimeError(f"rollout engine {engine} failed: {answer!r}") from answer
            out += [Rollout(first + r.prompt_index, r.response_ids, r.finished) for r in answer]
        return out

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._send((SYNC,))
        for bucket in buckets(named_tensors, self.bucket_bytes):
            spec, flat = _flat(bucket, self.device)
            dist.broadcast_object_list([(BUCKET, spec, flat.numel())], src=0, group=self.group)
            dist.broadcast(flat, src=0, group=self.group)
        dist.broadcast_object_list([(END,)], src=0, group=self.group)
        failures = [a for a in self._engine_answers() if isinstance(a, BaseException)]
        if failures:
            raise RuntimeError(f"a rollout engine failed to load the weights: {failures[0]!r}")

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

    def close(self) -> None:
        """Tell the engines to stop (once)."""
        if not self.closed:
            self.closed = True
            self._send((STOP,))


class EngineFollower:
    """A rollout process of a multi-process engine that another process of it runs (a vLLM
    engine of tensor parallel ``k`` is ``k`` processes of the plan; its first one starts
    vLLM's workers on the engine's GPUs): it takes part in every message and answers
    nothing (the coordinator reads each engine's first process only)."""

    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        return []

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:  # received and dropped: the engine's first process loads them
            pass

    def token_log_probs(self, prompt: list[int], response: list[int]) -> list[float]:
        return []


def serve(engine: RolloutEngine, engine_index: int, engines: int, group=None, device=None) -> int:
    """Run a rollout process: answer the coordinator until it says stop; returns the number
    of generate requests served. An engine error goes back to the coordinator as the
    answer (it raises there, naming the engine), and this process keeps serving until the
    coordinator stops it."""
    device = device or torch.device("cpu")
    served = 0
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        kind, *args = box[0]
        if kind == STOP:
            log.info("rollout engine %d: stop after %d requests", engine_index, served)
            if hasattr(engine, "close"):  # an engine with processes of its own
                engine.close()
            return served
        answer: object
        if kind == GENERATE:
            prompts, seeds = args
            mine = engine_slots(len(prompts), engines, engine_index)
            answer = _attempt(engine.generate, [prompts[s] for s in mine], [seeds[s] for s in mine])
            served += 1
        elif kind == SYNC:
            received = _ReceivedWeights(group, device)
            answer = _attempt(engine.sync_weights, received)
            for _ in received:  # drain what a failed load left, to stay in step
                pass
        elif kind == LOG_PROBS:
            prompt, response = args
            answer = _attempt(engine.token_log_probs, prompt, response)
        else:
            raise RuntimeError(f"rollout engine {engine_index}: unknown message {kind!r}")
        dist.gather_object(answer, None, dst=0, group=group)


def _attempt(call, *args):
    try:
        return call(*args)
    except Exception as exc:  # the coordinator raises it, naming this engine
        log.exception("rollout engine call failed")
        return exc


class _ReceivedWeights:
    """The weight buckets the coordinator broadcasts, as a (name, tensor) stream."""

    def __init__(self, group, device) -> None:
        self.group, self.device, self.done = group, device, False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while not self.done:
            box: list = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            if box[0][0] == END:
                self.done = True
                return
            _, spec, size = box[0]
            flat = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.broadcast(flat, src=0, group=self.group)
            yield from _unflat(spec, flat)
