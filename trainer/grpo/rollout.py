"""Rollout engines behind one small interface: a Hugging Face model with its KV cache, and vLLM.

An engine samples one response per seed of each prompt (token ids in, token ids out) and takes
the policy's new weights after each update (``sync_weights``). Every response has its own seed
(``core.seeds.sample_seed`` of the run seed, step, prompt slot and sample index), so no two
responses share a random stream and a rerun draws the same ones. Responses end with the first
stop token (``core.harmony.stop_token_ids``, as the eval's engines: ``<|return|>``,
``<|call|>``, the eos ids; kept in the response so the policy learns to stop) or at the
token limit. The engines are the project's one family (``generation.engines``): the HF
engine is a ``HFGenerator``, the vLLM ones ``VLLMGenerator`` s, as the eval's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from capacity.measured import tensor_bytes
from core.modeling import cache_keyword, output_cache
from generation.engines import HFGenerator
from generation.sampling import row_generators, sample_tokens
from trainer.grpo.algorithm import token_log_probs
from trainer.grpo.config import RolloutConfig
from trainer.grpo.routing import RoutingRecorder, routing_shape
from trainer.sft.lora import lora_parameters_fixed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollout:
    """One sampled response."""

    prompt_index: int
    response_ids: list[int]
    finished: bool
    """True when it ended with a stop token, False when cut by max_new_tokens."""
    log_probs: list[float] | None = None
    """The sampling policy's log-prob of each response token, ``log softmax(z / T)`` of the
    engine's logits ``z`` at ``rollout.temperature`` ``T`` (the trainer scores the rollouts
    at the same ``T``: ``micro_batch.Micro.temperature``): the behaviour policy of the
    rollout correction and of an off-policy update (``rollout.async_steps``), and what the
    mismatch metrics compare with the trainer's (``trainer.grpo.mismatch``). Recorded by the
    engines while they sample. Before nucleus filtering on the HF engine, after it on vLLM
    (``processed_logprobs``): the two agree at ``rollout.top_p`` 1, the default; below it
    vLLM's is the nucleus-renormalized one, higher by ``-log`` of the nucleus's mass
    (docs/grpo.md, "The policy is the tempered distribution")."""
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    """MoE models: the experts the engine routed each token to, an int16 array
    ``[positions, layers, k]`` over the prompt and the response but its last token (every
    token the engine ran), for routing replay (``trainer.grpo.routing``); an array, not
    lists: at gpt-oss-20b's 24 layers × top-4 a 4k-token rollout holds ~400k choices. The HF
    engine records it always, vLLM with ``algorithm.router_replay: rollout``; None
    otherwise."""

    def to_json(self) -> dict:
        """The rollout as JSON data (the routing as nested lists)."""
        data = asdict(self)
        if self.routed_experts is not None:
            data["routed_experts"] = self.routed_experts.tolist()
        return data

    @classmethod
    def from_json(cls, data: dict) -> Rollout:
        routes = data.get("routed_experts")
        if routes is not None:
            routes = np.asarray(routes, dtype=np.int16)
        return cls(**{**data, "routed_experts": routes})


class RolloutEngine(Protocol):
    overlaps: bool
    """True when the engine runs in other processes: ``submit`` hands a request over and
    returns, ``collect`` waits for its rollouts (``trainer.grpo.remote``), so this process
    can train meanwhile. False: ``collect`` runs the request here, in the caller's time
    (``LocalRequests``)."""
    last_busy_s: float
    """Seconds the engine spent generating the last collected request."""
    last_idle_s: float | None
    """Seconds the engine waited for that request (engines in other processes; else None)."""

    def submit(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> None:
        """Hand over a ``generate`` request (one at a time); ``collect`` returns its rollouts."""
        ...

    def collect(self) -> list[Rollout]:
        """The rollouts of the submitted request, once they are ready."""
        ...

    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        """One response per seed of each prompt (``seeds[i]``: prompt ``i``'s, all of one
        length ``n``), grouped: prompt 0's n responses first, then prompt 1's…"""
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the policy's updated weights (HF parameter names), streamed: each tensor is
        used before the next is drawn. Returns the weight bytes delivered (to each engine
        that received them, counted once per engine)."""
        ...

    def token_log_probs(self, prompt: list[int], response: list[int]) -> list[float]:
        """The engine's own log-probs of ``response`` after ``prompt`` (raw logits, no
        temperature, whatever ``rollout.temperature``): what the sync check compares with the
        policy's, scored at temperature 1 too (``weight_sync.probe_gap``)."""
        ...

    def token_log_probs_per_engine(
        self, prompt: list[int], response: list[int]
    ) -> list[list[float]]:
        """``token_log_probs`` of every copy of the weights the engine serves (each loaded
        them on its own, and the sync check compares each with the policy): one list for an
        engine in this process."""
        ...

    def sleep(self) -> None:
        """Free the device for the policy update (a colocated vLLM engine on a GPU; the next
        call wakes it); nothing for the others."""
        ...


class LocalRequests:
    """``submit`` and ``collect`` of an engine in this process: ``submit`` keeps the request,
    ``collect`` runs ``generate`` on it (nothing overlaps: the caller waits for it)."""

    last_busy_s: float = 0.0
    last_idle_s: float | None = None
    _request: tuple[list[list[int]], Sequence[Sequence[int]]] | None = None

    def submit(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> None:
        if self._request is not None:
            raise RuntimeError("a request is already submitted: collect it first")
        self._request = (prompts, seeds)

    def collect(self) -> list[Rollout]:
        if self._request is None:
            raise RuntimeError("nothing submitted to collect")
        (prompts, seeds), self._request = self._request, None
        started = time.monotonic()
        out = self.generate(prompts, seeds)
        self.last_busy_s = time.monotonic() - started
        return out


def group_size(prompts: Sequence, seeds: Sequence[Sequence[int]]) -> int:
    """``n``, the responses per prompt; every prompt must have ``n`` seeds."""
    if len(seeds) != len(prompts) or len({len(s) for s in seeds}) > 1 or (seeds and not seeds[0]):
        raise ValueError(
            f"{len(prompts)} prompts with seed lists of lengths {[len(s) for s in seeds]}: give "
            "each prompt the same number (≥ 1) of seeds"
        )
    return len(seeds[0]) if seeds else 0


def generate_group_slots(
    engine: RolloutEngine,
    prompts: Sequence[list[int]],
    seeds: Sequence[Sequence[int]],
    group: Sequence[int],
    rank: int,
    per_rank: int,
) -> list[Rollout]:
    """``rank``'s rollouts when one engine serves the ranks of ``group`` together.

    ``prompts`` and ``seeds`` are the whole step's (slot ``s`` belongs to rank
    ``s // per_rank``). The engine generates every slot of the group — the ranks of a vLLM
    engine in ``external_launcher`` mode must all submit the same requests — and ``rank``
    keeps its own slots, with prompt indices relative to its first slot.
    """
    rollouts = engine.generate(*group_slots_request(prompts, seeds, group, per_rank))
    return rank_slots(rollouts, group, rank, per_rank)


def group_slots_request(
    prompts: Sequence[list[int]],
    seeds: Sequence[Sequence[int]],
    group: Sequence[int],
    per_rank: int,
) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and seeds of every slot of the ranks in ``group`` (``generate_group_slots``)."""
    slots = [s for member in group for s in range(member * per_rank, (member + 1) * per_rank)]
    return [prompts[s] for s in slots], [list(seeds[s]) for s in slots]


def rank_slots(out: list[Rollout], group: Sequence[int], rank: int, per_rank: int) -> list[Rollout]:
    """``rank``'s rollouts of what the engine generated for ``group_slots_request``."""
    first = list(group).index(rank) * per_rank
    return [
        replace(r, prompt_index=r.prompt_index - first)
        for r in out
        if first <= r.prompt_index < first + per_rank
    ]


def cut_at_stop(ids: list[int], stop_ids: Collection[int], pad_id: int) -> tuple[list[int], bool]:
    """Response ids up to and including the first stop token; padding removed."""
    for i, token in enumerate(ids):
        if token in stop_ids:
            return ids[: i + 1], True
    while ids and ids[-1] == pad_id:
        ids = ids[:-1]
    return ids, False


def _rows_to_keep(finished: torch.Tensor) -> torch.Tensor | None:
    """The batch rows the next decode step still needs, or None to keep them all.

    Finished rows leave the batch (their KV cache, mask and position with them) once they
    are an eighth of it, so a step costs what its live rows cost and the copy of the cache
    a compaction makes is paid rarely. In ``lockstep`` a rank whose rows have all finished
    keeps one (its tokens are ignored): its forwards are collective and must go on.
    """
    dead = int(finished.sum())
    if dead == 0 or dead * 8 < finished.numel():
        return None
    keep = (~finished).nonzero().flatten()
    if keep.numel() == 0:  # lockstep: this rank is done, the others are not
        return finished.new_zeros(1, dtype=torch.long) if finished.numel() > 1 else None
    return keep


class HFRolloutEngine(LocalRequests, HFGenerator):
    """Sampling with a Hugging Face model and its KV cache (CPU or GPU).

    ``model`` is a plain ``nn.Module`` the engine may share with the trainer (the policy
    itself, so there is nothing to sync) or own (a copy, updated by sync_weights).

    ``lockstep``: every rank runs the same number of forward passes, as a ZeRO-3 partitioned
    model needs (each forward gathers its parameters collectively): a rank whose rows have all
    stopped keeps stepping until every rank's have (one all-reduce per decode step, as HF's
    ``synced_gpus``). Every rank must then call ``generate`` with as many prompts.
    """

    overlaps = False

    def __init__(
        self, model, tokenizer, cfg: RolloutConfig, batch_size: int = 64, lockstep: bool = False
    ) -> None:
        super().__init__(model, tokenizer)
        self.cfg = cfg
        self.sampling = cfg.sampling
        self.batch_size = batch_size
        self.lockstep = lockstep
        self.routing = routing_shape(model)
        """``(layers, k)`` of an MoE model, whose routing the engine records; None."""

    def sleep(self) -> None:
        """Nothing to free: the model is the policy or a copy the update does not touch."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        n = group_size(prompts, seeds)
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        per_call = max(1, self.batch_size // max(n, 1))
        if self.lockstep:
            counts = torch.tensor([len(prompts), -len(prompts)], device=device)
            torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
            if int(counts[0]) != -int(counts[1]):
                raise ValueError(
                    f"lockstep generation: the ranks have {-int(counts[1])} to "
                    f"{int(counts[0])} prompts; every rank must generate as many (ZeRO-3 "
                    "forwards are collective)"
                )
        out: list[Rollout] = []
        # LoRA on the experts: base + delta once per call, not once per token (a ZeRO-3
        # partitioned model, lockstep, gathers its weights forward by forward)
        fixed = contextlib.nullcontext() if self.lockstep else lora_parameters_fixed(self.model)
        try:
            with fixed:
                for start in range(0, len(prompts), per_call):
                    chunk = prompts[start : start + per_call]
                    rows = [s for group in seeds[start : start + per_call] for s in group]
                    out += self._generate_chunk(chunk, rows, start, n, device)
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(
        self, prompts: list[list[int]], seeds: list[int], first_index: int, n: int, device
    ):
        """Prefill each prompt once, copy its KV cache to its n samples, then decode.

        The decode loop is ours rather than ``model.generate``: one forward per token on the
        cache, temperature and nucleus (top-p) filtering, and a sample drawn by the
        exponential race (``argmax(p / E)``, ``E ~ Exp(1)``: the same distribution as
        ``multinomial(p)``, as vLLM samples), stopping when every row has hit a stop token
        (in ``lockstep``: every row of every rank); finished rows leave the batch as they
        accumulate (``_rows_to_keep``).
        Row ``i`` draws its noise from its own generator (``seeds[i]``): its samples do not
        depend on the other rows of the chunk.
        """
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        recorder = RoutingRecorder(self.model) if self.routing else None
        try:
            return self._decode(prompts, seeds, first_index, n, device, ids, mask, recorder)
        finally:
            if recorder is not None:
                recorder.close()

    def _decode(self, prompts, seeds, first_index, n, device, ids, mask, recorder):
        """``_generate_chunk``'s prefill and decode loop; ``recorder``: the routers' choices
        of every forward, kept per row (``Rollout.routed_experts``)."""
        generators = row_generators(seeds, device)
        width = ids.shape[1]
        prefill = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
        )
        prompt_routes = fed_routes = None
        if recorder is not None:  # [prompts, width, layers, k]; then per decode step and row
            prompt_routes = recorder.take().view(len(prompts), width, *self.routing)
            fed_routes = torch.full(
                (len(seeds), self.cfg.max_new_tokens, *self.routing), -1, dtype=torch.int16
            )
        cache = output_cache(prefill)
        cache.batch_repeat_interleave(n)
        keyword = cache_keyword(self.model)
        logits = prefill.logits[:, -1, :].repeat_interleave(n, 0)
        attention = mask.repeat_interleave(n, 0)
        position = mask.sum(-1).repeat_interleave(n, 0)
        total = attention.shape[0]
        stop = torch.tensor(sorted(self.stop_ids), device=device)
        tokens = torch.full((total, self.cfg.max_new_tokens), self.pad_id, dtype=torch.long)
        sampled_log_probs = torch.zeros((total, self.cfg.max_new_tokens), dtype=torch.float32)
        rows = torch.arange(total)  # the batch's rows, by their index in ``tokens``
        finished = torch.zeros(total, dtype=torch.bool, device=device)
        for t in range(self.cfg.max_new_tokens):
            token = torch.where(finished, self.pad_id, self._sample(logits, generators))
            tokens[rows, t] = token.cpu()
            sampled_log_probs[rows, t] = self._behaviour_log_probs(logits, token).cpu()
            finished |= torch.isin(token, stop)
            if t == self.cfg.max_new_tokens - 1 or self._all_done(bool(finished.all()), device):
                break
            keep = _rows_to_keep(finished)
            if keep is not None:
                cache.batch_select_indices(keep)
                token, attention, position = token[keep], attention[keep], position[keep]
                finished = finished[keep]
                rows = rows[keep.cpu()]
                generators = [generators[i] for i in keep.tolist()]
            attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], dim=1)
            logits = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=position[:, None],
                use_cache=True,
                **{keyword: cache},
            ).logits[:, -1, :]
            if recorder is not None:  # the routing of token t of the rows still running
                fed_routes[rows, t] = recorder.take()
            position = position + 1
        out = []
        for row in range(total):
            response, done = cut_at_stop(tokens[row].tolist(), self.stop_ids, self.pad_id)
            behaviour = sampled_log_probs[row, : len(response)].tolist()
            routes = None
            if recorder is not None:
                prompt = prompt_routes[row // n, width - len(prompts[row // n]) :]
                fed = fed_routes[row, : max(0, len(response) - 1)]
                routes = torch.cat([prompt, fed])[: len(prompt) + len(response) - 1].numpy()
            out.append(Rollout(first_index + row // n, response, done, behaviour, routes))
        return out

    def _all_done(self, done: bool, device) -> bool:
        """``done`` on every rank (lockstep), else this rank's ``done``."""
        if not self.lockstep:
            return done
        flag = torch.tensor([int(done)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _behaviour_log_probs(self, logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """``log softmax(logits / T)`` of each row's sampled token, ``T`` the rollout
        temperature: the distribution ``_sample`` draws from, before its nucleus filter,
        which is the policy the trainer scores (``Micro.temperature``), so an on-policy
        update's ratio is 1 (with ``top_p`` < 1 a token's probability under the filter is
        this one over the nucleus's mass; the trainer has no nucleus)."""
        return token_log_probs(logits, token, temperature=self.cfg.temperature).float()

    def _sample(self, logits: torch.Tensor, generators=None) -> torch.Tensor:
        """One token per row from ``softmax(logits / temperature)``, nucleus-filtered; row
        ``i`` from ``generators[i]`` (the global generator when None)."""
        return sample_tokens(logits, self.cfg.temperature, self.cfg.top_p, generators)

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = dict(self.model.named_parameters())
        sent = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
                sent += tensor_bytes([tensor])
        return sent

    @torch.no_grad()
    def token_log_probs(self, prompt: list[int], response: list[int]) -> list[float]:
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(prompt) + list(response)], device=device)
        logits = self.model(input_ids=ids, logits_to_keep=len(response) + 1).logits[0, :-1]
        targets = torch.tensor(response, device=device)
        return token_log_probs(logits, targets).tolist()

    def token_log_probs_per_engine(
        self, prompt: list[int], response: list[int]
    ) -> list[list[float]]:
        return [self.token_log_probs(prompt, response)]
