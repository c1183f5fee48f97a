"""The time of one GRPO weight sync: the policy's bytes, the hops they take and the
bandwidth of each (``cluster.nodes``' published figures), as the trainer moves them
(``trainer/grpo/weight_transfer.py``).

Dedicated engines: the trainer's rank 0 sends every bucket once, in one broadcast to every TP
worker of every engine (NCCL on GPUs), the next bucket gathered while one is on the wire. So
a sync takes the longer of the two streams, the gather and the wire, plus the first bucket's
gather (before anything can be sent) and a latency per hop per bucket:

- gather (ZeRO-3 / a Megatron export): rank 0 receives ``(n - 1) / n`` of the weights from
  the other ``n`` training ranks, over the network when they span nodes (all of a node's
  ranks share its network), else over NVLink/PCIe;
- wire: the broadcast is pipelined along a chain (NCCL's ring/tree broadcast), so every byte
  crosses the slowest link once: the sender's share of its node's network when an engine is
  on another node, else one GPU's NVLink/PCIe;
- hops: the chain's links, one per receiving worker; ``HOP_LATENCY_S`` each, per bucket.

A sync moves the policy's trainable weights: the whole model, or with LoRA
(``Layout.lora_rank``) the adapter's tensors alone (``trainer/grpo/weight_sync.py``:
``hf_weights(trainable_only=True)``), so its bytes, buckets and time shrink with it.

Colocated engines sample with the training process's own weights: a colocated HF engine
with the module it trains (base + adapter under LoRA), a colocated vLLM engine after an
in-process reload; nothing crosses a link (``NoSync``). The local CPU run has no published
interconnect, and SFT rolls nothing out, so neither is modeled (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass

from capacity.layouts import Layout
from capacity.model_spec import ParameterCount

HOP_LATENCY_S = 50e-6
"""One collective's latency per hop (an assumed figure: NCCL's published small-message
latencies are ~10–30 µs within and across nodes; 50 µs leaves room for the RPC of each bucket)."""

_BYTES_PER_PARAM = {"bf16": 2, "fp32": 4}


def sync_bytes(counts: ParameterCount, layout: Layout, adapter: int = 0) -> int:
    """Bytes of one sync: the LoRA adapter's ``adapter`` parameters where the layout trains
    one (``lora_rank``), else the whole policy's, in the training dtype (DeepSpeed casts the
    adapter to it; the vLLM engine takes the policy in it)."""
    params = adapter if layout.lora_rank else counts.total
    return params * _BYTES_PER_PARAM[layout.dtype]


@dataclass(frozen=True)
class NoSync:
    """A GRPO run whose engines sample with the training process's weights: nothing moves.

    Attributes:
        bytes: what a sync would move to dedicated engines (the adapter's bytes under LoRA).
        adapter: those bytes are the LoRA adapter's alone.
        reason: why nothing moves, in words.
    """

    bytes: int
    adapter: bool
    reason: str


@dataclass(frozen=True)
class SyncTime:
    """One modeled weight sync.

    Attributes:
        bytes: the policy's bytes a sync sends (one copy; every receiving worker takes it):
            the whole model's, or the LoRA adapter's alone.
        adapter: the bytes are the LoRA adapter's alone.
        receivers: TP workers that receive it.
        buckets: buckets of ``sync_bucket_mb``.
        hops: links of the broadcast chain.
        wire_gbps: the slowest link the bytes cross, Gb/s.
        wire_s: the bytes over that link.
        gather_gbps: the training ranks' gather bandwidth, Gb/s (None: one rank, no gather).
        gather_s: the gather of the whole policy onto rank 0.
        latency_s: hops × buckets × ``HOP_LATENCY_S``.
        seconds: the sync's modeled time (gather and wire overlapped).
        route: the path, in words.
    """

    bytes: int
    adapter: bool
    receivers: int
    buckets: int
    hops: int
    wire_gbps: float
    wire_s: float
    gather_gbps: float | None
    gather_s: float
    latency_s: float
    seconds: float
    route: str


def _seconds(nbytes: float, gbps: float) -> float:
    return nbytes * 8 / (gbps * 1e9)


def model_sync(
    counts: ParameterCount, layout: Layout, adapter: int = 0
) -> SyncTime | NoSync | None:
    """The modeled time of one sync of ``layout``'s policy to its dedicated engines.

    Args:
        counts: the model's parameter count.
        layout: the layout.
        adapter: the LoRA adapter's parameters (``count_lora_parameters``), which a sync
            moves instead of the whole model where ``layout.lora_rank`` is set.

    Returns:
        The sync; ``NoSync`` where the engines are colocated (nothing moves); None where
        nothing is modeled: no rollouts (SFT), the CPU run, or no stated interconnect.
    """
    if not layout.rollouts or layout.device != "cuda":
        return None
    nbytes = sync_bytes(counts, layout, adapter)
    lora = bool(layout.lora_rank)
    if not layout.rollout_gpus:
        return NoSync(nbytes, lora, "the HF engine samples with the module each rank trains")
    if layout.hybrid:
        return NoSync(nbytes, lora, "colocated vLLM reloads the policy in its own process")
    if layout.intra_node_gbps is None:
        return None
    bucket = layout.sync_bucket_mb << 20
    buckets = -(-nbytes // bucket)
    per_node = layout.gpus_per_node
    training_nodes = -(-layout.training_gpus // per_node)
    first_rollout_node = layout.training_gpus // per_node
    last_rollout_node = (layout.training_gpus + layout.rollout_gpus - 1) // per_node
    crosses_nodes = last_rollout_node > 0  # the sender, training rank 0, is on node 0
    if crosses_nodes and layout.sender_network_gbps is None:
        return None
    wire_gbps = layout.intra_node_gbps
    route = "NVLink/PCIe within node 0"
    if crosses_nodes:
        wire_gbps = min(layout.sender_network_gbps, layout.intra_node_gbps)
        route = (
            f"node 0's network ({layout.sender_network_gbps:g} Gb/s from one GPU) to "
            f"{last_rollout_node - first_rollout_node + 1} engine node(s)"
        )
    receivers = layout.rollout_gpus
    hops = receivers
    ranks = layout.training_gpus // max(1, layout.tensor_parallel * layout.pipeline_parallel)
    gather_gbps: float | None = None
    gather_s = 0.0
    if layout.training_gpus > 1 and layout.trainer.shards_parameters(layout.zero_stage):
        if training_nodes > 1:
            gather_gbps = layout.network_gbps
            share = (training_nodes - 1) / training_nodes
        else:
            gather_gbps = layout.intra_node_gbps
            share = (ranks - 1) / max(1, ranks)
        if gather_gbps is not None and share > 0:
            gather_s = _seconds(nbytes * share, gather_gbps)
    wire_s = _seconds(nbytes, wire_gbps)
    latency_s = hops * buckets * HOP_LATENCY_S
    first = max(_seconds(min(bucket, nbytes), wire_gbps), gather_s / buckets)
    seconds = max(wire_s, gather_s) + first + latency_s
    return SyncTime(
        bytes=nbytes,
        adapter=lora,
        receivers=receivers,
        buckets=buckets,
        hops=hops,
        wire_gbps=wire_gbps,
        wire_s=wire_s,
        gather_gbps=gather_gbps,
        gather_s=gather_s,
        latency_s=latency_s,
        seconds=seconds,
        route=route,
    )


def _what(sync: SyncTime | NoSync) -> str:
    size = sync.bytes / 2**30
    amount = f"{size:.1f} GiB" if size >= 1 else f"{sync.bytes / 2**20:.0f} MiB"
    return f"{amount}, the LoRA adapter alone" if sync.adapter else amount


def describe_sync(sync: SyncTime | NoSync) -> str:
    """One line for ``lingo estimate``: the modeled sync and what it is made of, or why
    nothing moves and what a sync to dedicated engines would move."""
    if isinstance(sync, NoSync):
        return (
            f"weight sync per step: none, 0 s ({sync.reason}); a sync to dedicated engines "
            f"would move {_what(sync)}"
        )
    gather = (
        f"gather {sync.gather_s:.1f} s at {sync.gather_gbps:g} Gb/s"
        if sync.gather_gbps
        else "no gather"
    )
    return (
        f"weight sync per step: {sync.seconds:.1f} s modeled ({_what(sync)}, to "
        f"{sync.receivers} vLLM workers in {sync.buckets} buckets; wire {sync.wire_s:.1f} s at "
        f"{sync.wire_gbps:g} Gb/s over {sync.route}, {gather}, overlapped; "
        f"{sync.hops} hops × {sync.buckets} buckets × {HOP_LATENCY_S * 1e6:.0f} µs = "
        f"{sync.latency_s:.2f} s); the run's budget: rollout.sync_budget_s"
    )
