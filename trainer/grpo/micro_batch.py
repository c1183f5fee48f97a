"""A micro-batch of rollouts as tensor rows for the policy's forward, and its log-probs.

Rows are right-aligned (every response ends in the last column) so the LM head runs on the
last ``width + 1`` positions only; rows that share a prompt can run it once
(``SharedPrefix``). The engine's expert routing, when replayed or compared
(``Micro.routing``), is laid out the same way (``with_routing``). The PyTorch and DeepSpeed
backends call ``Micro.hf_log_probs``; the Megatron backend reads the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.modeling import cache_keyword, output_cache
from trainer.grpo import algorithm as algo
from trainer.grpo.prompts import Prompt
from trainer.grpo.rollout import Rollout
from trainer.grpo.routing import RouterCounts, Routing, full_routes, routed, shared_routes


@dataclass
class Micro:
    """A micro-batch laid out for the update.

    Rows are right-aligned so that every response ends in the last column: the LM head only
    runs on the last ``width + 1`` positions. ``shared`` holds the same rows split into their
    distinct prompts and their responses, for ``micro_log_probs`` to run each prompt once per
    group (see ``SharedPrefix``).
    """

    ids: torch.Tensor
    attention: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    """[B, width]: 1 on the response tokens (the targets of the kept logits)."""
    shared: SharedPrefix | None = None
    routing: Routing | None = None
    """The rollout engine's expert choices for these rows, replayed or compared by the HF
    forward (``trainer.grpo.routing``); None: the model routes on its own."""
    temperature: float = 1.0
    """The temperature the rows' log-probs and entropies are of: the policy is
    ``softmax(logits / temperature)``, the distribution the engine sampled them from
    (``rollout.temperature``); 1: the raw logits (the weight-sync check's probe)."""

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def hf_log_probs(self, module, with_entropy: bool):
        """The ``ResponseBatch`` forward of the PyTorch and DeepSpeed backends."""
        return micro_log_probs(module, self, with_entropy)


@dataclass
class SharedPrefix:
    """The micro-batch as U distinct prompts (left-padded) and B responses (left-aligned).

    The prompts run once, with their KV cache; the cache is indexed out to the B rows
    (``row_prompt``) and the responses run on top of it. Autograd flows through the indexing,
    so each prompt's activations get the summed gradient of its group: the same log-probs and
    gradients as the full rows, for a fraction of the prompt compute.
    """

    prompt_ids: torch.Tensor
    prompt_attention: torch.Tensor
    prompt_positions: torch.Tensor
    prompt_lengths: torch.Tensor
    row_prompt: torch.Tensor
    """[B]: each row's prompt, an index into the U prompts."""
    response_ids: torch.Tensor
    """[B, width], left-aligned, padded."""
    response_lengths: torch.Tensor


def sequences(
    prompts: list[Prompt],
    rollouts: list[Rollout],
    pad_id: int,
    device,
    temperature: float = 1.0,
) -> Micro:
    """The rollouts as a right-aligned micro-batch whose log-probs are those of
    ``softmax(logits / temperature)`` (``Micro.temperature``)."""
    rows = [prompts[r.prompt_index].ids + r.response_ids for r in rollouts]
    total = max(len(r) for r in rows)
    width = max(1, max(len(r.response_ids) for r in rollouts))
    ids = torch.full((len(rows), total), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), total), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (row, rollout) in enumerate(zip(rows, rollouts, strict=True)):
        ids[i, total - len(row) :] = torch.tensor(row)
        attention[i, total - len(row) :] = 1
        if rollout.response_ids:
            mask[i, width - len(rollout.response_ids) :] = 1.0
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    micro = Micro(
        ids.to(device),
        attention.to(device),
        positions.to(device),
        mask.to(device),
        temperature=temperature,
    )
    distinct = sorted({r.prompt_index for r in rollouts})
    if len(distinct) < len(rollouts):  # some rows share a prompt
        micro.shared = shared_prefix_layout(prompts, rollouts, distinct, width, pad_id, device)
    return micro


def shared_prefix_layout(prompts, rollouts, distinct, width, pad_id, device) -> SharedPrefix:
    slot = {index: k for k, index in enumerate(distinct)}
    prompt_width = max(len(prompts[i].ids) for i in distinct)
    prompt_ids = torch.full((len(distinct), prompt_width), pad_id, dtype=torch.long)
    prompt_attention = torch.zeros((len(distinct), prompt_width), dtype=torch.long)
    for k, index in enumerate(distinct):  # left padding: every prompt ends in the last column
        row = prompts[index].ids
        prompt_ids[k, prompt_width - len(row) :] = torch.tensor(row)
        prompt_attention[k, prompt_width - len(row) :] = 1
    response_ids = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    for i, rollout in enumerate(rollouts):
        if rollout.response_ids:
            response_ids[i, : len(rollout.response_ids)] = torch.tensor(rollout.response_ids)
    return SharedPrefix(
        prompt_ids=prompt_ids.to(device),
        prompt_attention=prompt_attention.to(device),
        prompt_positions=(prompt_attention.cumsum(-1) - 1).clamp(min=0).to(device),
        prompt_lengths=prompt_attention.sum(-1).to(device),
        row_prompt=torch.tensor([slot[r.prompt_index] for r in rollouts], device=device),
        response_ids=response_ids.to(device),
        response_lengths=torch.tensor([len(r.response_ids) for r in rollouts], device=device),
    )


def micro_log_probs(module, micro: Micro, with_entropy: bool):
    """Log-probs (and entropies) of the last ``width`` tokens, from the last logits only,
    of ``softmax(logits / micro.temperature)``.

    Rows that share a prompt run it once (``shared_prefix_logits``) unless the model uses
    gradient checkpointing, which turns the KV cache off in training, or, with gradients, is
    partitioned by ZeRO-3: the prompt's backward comes after the responses' backward through
    every layer, so autograd holds each parameter's whole gradient (and DeepSpeed its gathered
    weights) until then, a whole model's worth on every rank.
    """
    t = micro.temperature
    shared = micro.shared is not None and not getattr(module, "is_gradient_checkpointing", False)
    if shared and torch.is_grad_enabled() and zero3_partitioned(module):
        shared = False
    if shared:
        with routed(module, micro.routing, shared=True):
            logits = shared_prefix_logits(module, micro.shared)
        targets = micro.shared.response_ids
        log_probs = right_align(algo.token_log_probs(logits, targets, temperature=t), micro.shared)
        entropy = None
        if with_entropy:
            entropy = right_align(algo.entropy_from_logits(logits, temperature=t), micro.shared)
        return log_probs, entropy
    with routed(module, micro.routing):
        logits = module(
            input_ids=micro.ids,
            attention_mask=micro.attention,
            position_ids=micro.positions,
            logits_to_keep=micro.width + 1,
        ).logits[:, :-1, :]
    log_probs = algo.token_log_probs(logits, micro.ids[:, -micro.width :], temperature=t)
    entropy = algo.entropy_from_logits(logits, temperature=t) if with_entropy else None
    return log_probs, entropy


def zero3_partitioned(module) -> bool:
    """Whether ``module``'s parameters are partitioned by DeepSpeed ZeRO-3 (they carry a
    ``ds_id``)."""
    return hasattr(next(module.parameters()), "ds_id")


def shared_prefix_logits(module, shared: SharedPrefix) -> torch.Tensor:
    """[B, width, V]: the logits that predict each response token (left-aligned)."""
    prefill = module(
        input_ids=shared.prompt_ids,
        attention_mask=shared.prompt_attention,
        position_ids=shared.prompt_positions,
        use_cache=True,
        logits_to_keep=1,
    )
    first = prefill.logits[shared.row_prompt, -1:, :]  # predicts each response's first token
    width = shared.response_ids.shape[1]
    if width == 1:
        return first
    cache = output_cache(prefill)
    cache.batch_select_indices(shared.row_prompt)  # differentiable: gradients sum per prompt
    steps = torch.arange(width - 1, device=shared.response_ids.device)
    response_valid = (steps[None, :] < shared.response_lengths[:, None]).long()
    rest = module(
        input_ids=shared.response_ids[:, :-1],
        attention_mask=torch.cat(
            [shared.prompt_attention[shared.row_prompt], response_valid], dim=1
        ),
        position_ids=shared.prompt_lengths[shared.row_prompt, None] + steps[None, :],
        use_cache=True,
        **{cache_keyword(module): cache},
    ).logits
    return torch.cat([first, rest], dim=1)


def right_align(values: torch.Tensor, shared: SharedPrefix) -> torch.Tensor:
    """Left-aligned [B, width] values moved so that each row's last response token is in the
    last column (the layout of ``Micro.mask``); columns before a row's response are 0."""
    width = values.shape[1]
    source = torch.arange(width, device=values.device)[None, :] - (
        width - shared.response_lengths[:, None]
    )
    valid = source >= 0
    return torch.gather(values, 1, source.clamp(min=0)) * valid


def with_routing(
    micro: Micro,
    prompts: list[Prompt],
    rollouts: list[Rollout],
    replay: bool,
    counts: RouterCounts | None,
) -> Micro:
    """``micro`` with the rollouts' recorded expert routing laid out for its forwards (full
    rows, and the shared-prefix split when it has one): replayed (``replay``) or only
    compared with the model's own (into ``counts``). Every rollout must carry its routing."""
    records = [r.routed_experts for r in rollouts]
    first = next((record for record in records if record is not None and len(record)), None)
    if first is None:
        return micro
    _, layers, k = first.shape
    lengths = [len(prompts[r.prompt_index].ids) + len(r.response_ids) for r in rollouts]
    full = full_routes(records, lengths, micro.ids.shape[1], layers, k)
    split = None
    if micro.shared is not None:
        s = micro.shared
        split = shared_routes(
            records,
            [len(prompts[r.prompt_index].ids) for r in rollouts],
            [len(r.response_ids) for r in rollouts],
            s.row_prompt.tolist(),
            s.prompt_ids.shape[1],
            max(0, s.response_ids.shape[1] - 1),
            layers,
            k,
        )
        split = tuple(t.to(micro.ids.device) for t in split)
    micro.routing = Routing(full.to(micro.ids.device), replay, counts, split)
    return micro
