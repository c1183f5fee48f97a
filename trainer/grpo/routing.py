"""Routing replay for MoE GPT-OSS: the experts the rollout engine chose, recorded and replayed.

A GPT-OSS layer routes each token to the top-k of its router's logits
(``transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter.forward``: ``topk`` of
``linear(h, W, b)``, then a softmax over the k chosen logits as their gate weights). The
rollout engine and the trainer compute those logits with different kernels, so near-ties flip:
the trainer then scores a token through other experts than the engine sampled it with, the
largest source of the engine/trainer mismatch on MoE models.

- **Recording.** The HF engine keeps, per token and layer, the indices its routers chose
  (``RoutingRecorder``: a forward hook on each router); vLLM returns them with
  ``enable_return_routed_experts`` (``CompletionOutput.routed_experts``,
  ``[prompt + response − 1, layers, k]``: every token the engine ran, the last sampled one
  never runs). ``Rollout.routed_experts`` holds the same ``[positions, layers, k]``.
- **Replay** (``algorithm.router_replay: rollout``). The training forward's routers take the
  recorded indices instead of their own top-k; the gate weights are the softmax of the
  router's *own* logits at those indices, so the router still learns (as Megatron-Core's
  router replay and verl's R3 do: the replayed top-k indices select, the current logits
  weigh). Positions without a record (padding, the last response token) keep their own
  top-k.
- **Measuring.** Whichever the mode, the hook compares the router's own top-k with the
  record, per (token, layer): ``router_mismatch_rate`` is the share that differ (as sets),
  measured in the forward before the update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

NOT_RECORDED = -1
"""The index of a (position, layer) with no record: the router keeps its own top-k there."""


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a GPT-OSS model (its ``GptOssTopKRouter`` modules, in layer
    order; inside a DeepSpeed or PEFT wrapper too); [] for a dense model."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    return [m for m in model.modules() if isinstance(m, GptOssTopKRouter)]


class RoutingRecorder:
    """Keeps the indices each router chose in the last forward (``take``): the HF rollout
    engine's record of its own routing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        self._last: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [
            router.register_forward_hook(partial(self._keep, layer))
            for layer, router in enumerate(self.routers)
        ]

    def _keep(self, layer: int, module, args, output) -> None:
        self._last[layer] = output[2].detach()

    def take(self) -> torch.Tensor:
        """``[tokens, layers, k]`` (int16, on the CPU) of the last forward, in its tokens'
        row-major order (``[batch, sequence]`` flattened, as the router sees them)."""
        if any(indices is None for indices in self._last):
            raise RuntimeError("a router did not run in the last forward")
        out = torch.stack([i.to("cpu", torch.int16) for i in self._last], dim=1)
        self._last = [None] * len(self.routers)
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class RouterCounts:
    """(token, layer) choices compared with the record, and how many differed."""

    compared: float = 0.0
    differ: float = 0.0


@dataclass
class Routing:
    """What a micro-batch's forward does with the engine's routing.

    Attributes:
        full: ``[B, S, layers, k]`` recorded indices aligned with the micro-batch's full rows
            (``NOT_RECORDED`` where there is none).
        replay: route by the record (``algorithm.router_replay: rollout``), or only compare.
        counts: where the comparison is added (None: not measured in this forward).
        shared: the same record for the shared-prefix forward (``micro_batch.SharedPrefix``): the
            distinct prompts ``[U, prompt width, layers, k]``, then the responses run on their
            cache ``[B, width − 1, layers, k]``.
    """

    full: torch.Tensor
    replay: bool
    counts: RouterCounts | None = None
    shared: tuple[torch.Tensor, torch.Tensor] | None = None


def _as_routes(record: np.ndarray, layers: int, k: int, row: int, tokens: int) -> torch.Tensor:
    """Row ``row``'s record as a tensor: one entry per token the engine ran, ``tokens − 1``
    (all but the last sampled one)."""
    shape = tuple(record.shape)
    if shape != (max(0, tokens - 1), layers, k):
        raise ValueError(
            f"row {row}: recorded routing of shape {shape} for "
            f"a row of {tokens} tokens; expected [{max(0, tokens - 1)}, {layers}, {k}] (every "
            "token the engine ran but the last sampled one, layers, experts per token): the "
            "engine ran another model or returned part of the routing"
        )
    return torch.from_numpy(record.astype(np.int64))


def full_routes(
    records: Sequence[np.ndarray], lengths: Sequence[int], width: int, layers: int, k: int
) -> torch.Tensor:
    """``[B, width, layers, k]`` int64 routes, each row's record right-aligned as its tokens
    (``micro_batch.sequences``): row ``b``'s ``lengths[b]`` tokens end in the last column and its
    record covers all of them but the last; ``NOT_RECORDED`` elsewhere.

    Raises:
        ValueError: a record that is not ``[lengths[b] − 1, layers, k]``.
    """
    out = torch.full((len(records), width, layers, k), NOT_RECORDED, dtype=torch.long)
    for row, (record, length) in enumerate(zip(records, lengths, strict=True)):
        routes = _as_routes(record, layers, k, row, length)
        start = width - length
        out[row, start : start + len(routes)] = routes
    return out


def shared_routes(
    records: Sequence[np.ndarray],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    row_prompt: Sequence[int],
    prompt_width: int,
    response_width: int,
    layers: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The record split as the shared-prefix forward runs the rows: each distinct prompt
    once, left-padded (the first of its rows' records), then the responses left-aligned,
    their first ``response_width`` tokens (``SharedPrefix``)."""
    prompts = torch.full(
        (max(row_prompt) + 1, prompt_width, layers, k), NOT_RECORDED, dtype=torch.long
    )
    responses = torch.full(
        (len(records), response_width, layers, k), NOT_RECORDED, dtype=torch.long
    )
    seen: set[int] = set()
    for row, (record, slot) in enumerate(zip(records, row_prompt, strict=True)):
        length = prompt_lengths[row]
        routes = _as_routes(record, layers, k, row, length + response_lengths[row])
        if slot not in seen:
            seen.add(slot)
            prompts[slot, prompt_width - length :][: len(routes)] = routes[:length]
        fed = routes[length : length + response_width]
        responses[row, : len(fed)] = fed
    return prompts, responses


def _route(
    layer: int, routes: list[torch.Tensor], calls: list[int], plan: Routing, module, args, output
):
    """The forward hook on router ``layer``: compare, and when replaying, route by the
    record with gate weights from the router's own logits (``routes``: one tensor per forward
    of the micro-batch, in order; a recomputed forward starts them over)."""
    logits, _, own = output
    given = routes[calls[layer] % len(routes)]
    calls[layer] += 1
    given = given[:, :, layer, :].reshape(-1, own.shape[-1]).to(own.device)
    if given.shape[0] != own.shape[0]:
        raise ValueError(
            f"router {layer}: {own.shape[0]} tokens in the forward, {given.shape[0]} recorded "
            "positions in the micro-batch's routing"
        )
    known = (given != NOT_RECORDED).all(-1)
    if plan.counts is not None:
        with torch.no_grad():
            differ = (own.sort(-1).values != given.sort(-1).values).any(-1) & known
            plan.counts.compared += float(known.sum())
            plan.counts.differ += float(differ.sum())
    if not plan.replay:
        return None
    chosen = torch.where(known[:, None], given, own)
    top = logits.gather(-1, chosen)
    return logits, torch.softmax(top, dim=-1, dtype=top.dtype), chosen


@contextlib.contextmanager
def routed(module: torch.nn.Module, plan: Routing | None, shared: bool = False) -> Iterator[None]:
    """Forwards of ``module`` inside route (or only compare) by ``plan``: its full rows, or
    (``shared``) its shared-prefix forwards; nothing when ``plan`` is None or the model has
    no MoE routers."""
    if plan is None:
        yield
        return
    routes = list(plan.shared) if shared else [plan.full]
    routers = moe_routers(module)
    calls = [0] * len(routers)
    handles = [
        router.register_forward_hook(partial(_route, layer, routes, calls, plan))
        for layer, router in enumerate(routers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def routing_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """``(layers, experts per token)`` of a GPT-OSS model; None without routers."""
    routers = moe_routers(model)
    return (len(routers), routers[0].top_k) if routers else None
