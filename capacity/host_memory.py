"""Host (CPU) memory of one node: offloaded optimizer, pinned buffers, sleep backups, HF save.

Training ranks fill the first nodes; in a non-hybrid layout the rollout GPUs come next, in a
hybrid one they sit on the training GPUs. Per node:

- optimizer offload: 16 B per trainable parameter of each local rank's shard (fp32 master,
  Adam m and v, fp32 gradient: what DeepSpeed's CPU-Adam and Megatron's CPU optimizer keep);
- pinned buffers: per offloading rank, CPU-Adam's double buffer for copying updated
  parameters back to the GPU (2 × 128 Mi fp32 = 1 GiB; 0 in versions that dropped it);
- ZeRO-3 ``param_offload``: each local rank's weights partition;
- hybrid with vLLM sleep level 1: each local rollout GPU's weight shard (level 2 drops it);
- rank 0's node: the HF save gathers the full bf16 state dict (LoRA: the adapter) on the host;
  or, where the step ends with the whole model on rank 0 (``final_model_on_rank0``: SFT's
  merge), that model and its reload for the merge check;
- every rank that loads the whole model (``Layout.whole_model_load``): a copy on the host
  while ``from_pretrained`` reads it, before it moves to the GPU; the load comes before the
  training state exists, so only what it adds beyond the (low) training phase counts;
- hybrid with ``deepspeed_enable_sleep``: each local rank's GPU-resident training state,
  parked while vLLM is awake, i.e. while the two items above are absent: only what it adds
  beyond them counts toward the peak;
- every GPU process (training rank, vLLM worker): its own RSS (CUDA runtime, torch, NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass

from capacity.layouts import Layout
from capacity.model_spec import ModelSpec, ParameterCount
from capacity.quantities import GIB, Bounds, Term
from capacity.rollout_memory import rollout_weight_bytes
from capacity.training_memory import loaded_parameters, rank_share, trainable_parameters

OFFLOAD_BYTES_PER_PARAM = 16
PINNED_BUFFER_GIB = Bounds(0.0, 1.0, 2.0)
GPU_PROCESS_RSS_GIB = Bounds(2.0, 3.0, 5.0)
CPU_PROCESS_RSS_GIB = Bounds(0.4, 0.6, 1.0)
HF_SAVE_BYTES_PER_PARAM = 2


@dataclass(frozen=True)
class NodeRole:
    """What one node runs.

    Attributes:
        index: node number (0 holds global rank 0).
        training_ranks: training GPUs on it.
        rollout_gpus: vLLM GPUs on it (shared with training in a hybrid layout).
    """

    index: int
    training_ranks: int
    rollout_gpus: int

    @property
    def holds_rank0(self) -> bool:
        """Whether global training rank 0 (which gathers the HF save) runs here."""
        return self.index == 0 and self.training_ranks > 0


def _overlap(start: int, stop: int, node: int, per_node: int) -> int:
    return max(0, min(stop, (node + 1) * per_node) - max(start, node * per_node))


def node_roles(layout: Layout) -> list[NodeRole]:
    """Place training and rollout GPUs on the nodes.

    Args:
        layout: the layout.

    Returns:
        One role per node.
    """
    per_node, n, r = layout.gpus_per_node, layout.training_gpus, layout.rollout_gpus
    rollout_start = 0 if layout.hybrid else n
    return [
        NodeRole(
            index=i,
            training_ranks=_overlap(0, n, i, per_node),
            rollout_gpus=_overlap(rollout_start, rollout_start + r, i, per_node),
        )
        for i in range(layout.nodes)
    ]


def optimizer_offload_bytes(spec: ModelSpec, counts: ParameterCount, layout: Layout) -> float:
    """Host bytes of one training rank's offloaded optimizer shard (0 without offload)."""
    if not layout.adam_offload:
        return 0.0
    return OFFLOAD_BYTES_PER_PARAM * rank_share(spec, counts, layout).optimizer


def host_node_terms(
    spec: ModelSpec,
    counts: ParameterCount,
    layout: Layout,
    role: NodeRole,
    gpu_resident_per_rank: Bounds,
) -> list[Term]:
    """Every term of one node's host memory at the training step's peak (incl. the HF save).

    Args:
        spec: the model's shape.
        counts: its parameter count.
        layout: the layout.
        role: what the node runs.
        gpu_resident_per_rank: a training rank's GPU-resident state (moved here while vLLM
            is awake when ``deepspeed_enable_sleep``).

    Returns:
        The terms (zero-sized ones left out).
    """
    terms = _offload_terms(spec, counts, layout, role)
    training_phase = _training_phase_terms(spec, counts, layout, role)
    terms += training_phase
    phase_bytes = sum(term.bytes.high for term in training_phase)
    parked = role.training_ranks * gpu_resident_per_rank
    if layout.hybrid and layout.deepspeed_enable_sleep and parked.high > phase_bytes:
        # Parked only while vLLM is awake, when there is no sleep backup and no HF save:
        # the node's peak holds the larger of the two phases, so only the excess counts.
        terms.append(
            Term(
                "training_sleep",
                "training state parked while vLLM is awake (beyond the above)",
                Bounds(
                    max(0.0, parked.low - phase_bytes),
                    max(0.0, parked.expected - phase_bytes),
                    max(0.0, parked.high - phase_bytes),
                ),
                "non-hybrid (training states then stay on their GPUs)",
            )
        )
    terms += _load_and_process_terms(spec, counts, layout, role, terms)
    return terms


def _offload_terms(
    spec: ModelSpec, counts: ParameterCount, layout: Layout, role: NodeRole
) -> list[Term]:
    """The node's training ranks' offloaded optimizer shards and pinned buffers (adam
    offload) and offloaded parameters (ZeRO-3 parameter offload)."""
    t = role.training_ranks
    terms: list[Term] = []
    if layout.adam_offload and t:
        terms.append(
            Term(
                "optimizer_offload",
                f"optimizer offload ({OFFLOAD_BYTES_PER_PARAM} B/param × {t} ranks' shards)",
                Bounds.exact(t * optimizer_offload_bytes(spec, counts, layout)),
                "add training nodes (each node then holds a smaller optimizer shard)",
            )
        )
        terms.append(Term("pinned_buffers", "pinned CPU-Adam buffers", t * PINNED_BUFFER_GIB * GIB))
    if layout.param_offload and t:
        share = rank_share(spec, counts, layout)
        terms.append(
            Term(
                "param_offload",
                "ZeRO-3 parameter offload",
                Bounds.exact(t * layout.weight_bytes * share.weights),
                "param_offload=false, or add training nodes",
            )
        )
    return terms


def _training_phase_terms(
    spec: ModelSpec, counts: ParameterCount, layout: Layout, role: NodeRole
) -> list[Term]:
    """Host bytes that exist only while training (vLLM asleep): vLLM's level-1 sleep backup
    of its weight shards, and rank 0's final model (with its reload) or gathered HF save."""
    terms: list[Term] = []
    if layout.hybrid and layout.vllm_sleep_level == 1 and role.rollout_gpus:
        tp = layout.vllm_tensor_parallel_size
        backup = role.rollout_gpus * rollout_weight_bytes(counts, layout.rollout_dtype) / tp
        terms.append(
            Term(
                "vllm_sleep_backup",
                f"vLLM sleep backup (level 1, {role.rollout_gpus} GPUs' weight shards)",
                Bounds.exact(backup),
                "non-hybrid (rollout GPUs of their own), or vllm_sleep_level=2",
            )
        )
    if role.holds_rank0 and layout.final_model_on_rank0:
        terms.append(
            Term(
                "final_model",
                "final model whole on rank 0, and its reload (merge check)",
                Bounds.exact(2 * layout.weight_bytes * counts.total),
                "add host memory to node 0",
            )
        )
    elif role.holds_rank0:
        saved = trainable_parameters(spec, counts, layout) if layout.lora_rank else counts.total
        terms.append(
            Term(
                "hf_save_gather",
                "HF save: full bf16 state dict gathered on rank 0",
                Bounds.exact(HF_SAVE_BYTES_PER_PARAM * saved),
                "add host memory to node 0",
            )
        )
    return terms


def _load_and_process_terms(
    spec: ModelSpec, counts: ParameterCount, layout: Layout, role: NodeRole, above: list[Term]
) -> list[Term]:
    """A whole-model load's host copies beyond the terms ``above``, and the processes' own
    RSS (each training rank and each vLLM worker is its own process, hybrid or not)."""
    t = role.training_ranks
    terms: list[Term] = []
    if layout.whole_model_load and t:
        # each local rank's from_pretrained reads the whole model on the host first
        load = t * layout.weight_bytes * loaded_parameters(spec, counts, layout)
        training_low = sum(term.bytes.low for term in above)
        if load > training_low:
            terms.append(
                Term(
                    "whole_model_load",
                    f"model load: {t} ranks' whole copies (beyond the above)",
                    Bounds.exact(load - training_low),
                    "load partitioned (DeepSpeed ZeRO-3 builds the model under zero.Init)",
                )
            )
    processes = t + role.rollout_gpus
    if processes:
        rss = GPU_PROCESS_RSS_GIB if layout.device == "cuda" else CPU_PROCESS_RSS_GIB
        terms.append(
            Term("processes", f"{processes} GPU processes' own RSS", processes * rss * GIB)
        )
    return terms
