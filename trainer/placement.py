"""Where every process of a GRPO run sits, and which rollout engine spans which GPUs.

``plan_placement`` is a pure function from the cluster (nodes × GPUs per node) and the
parallel layout (training TP / PP / EP / DP, rollout TP, colocated or dedicated rollout GPUs)
to a ``PlacementPlan``: each process's roles (``train``, ``rollout``), its device (node,
local GPU index) and its groups. Processes are placed as torchrun places them, one per GPU:
process ``r`` on node ``r // gpus_per_node``, GPU ``r % gpus_per_node``.

- **Colocated** (hybrid): every training process also rolls out. The vLLM engines are the
  TP groups of ``rollout_tp`` consecutive training processes: one engine per group, spanning
  those processes' GPUs (vLLM's ``external_launcher`` mode, where each process of the group
  runs one worker of the engine).
- **Dedicated** (non-hybrid): ``rollout_engines`` engines of ``rollout_tp`` GPUs each, on the
  GPUs after the training processes (processes ``T``, ``T+1``, … that only roll out).

Rules checked: training TP groups and rollout engines stay within a node (their collectives
run every layer), no two engines share a GPU, and the counts add up. ``run_placement`` is the
GRPO run's plan checked at start against torchrun's world and where this process is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cluster.nodes import rollout_nodes

if TYPE_CHECKING:
    from trainer.distributed import DistInfo
    from trainer.grpo.config import GRPOConfig

Role = Literal["train", "rollout"]


class PlacementError(ValueError):
    """A layout that cannot be placed on the cluster; the message names the numbers."""


@dataclass(frozen=True)
class ParallelLayout:
    """How a run splits its work.

    Attributes:
        tp: training tensor parallel size.
        pp: training pipeline parallel size.
        ep: training expert parallel size (within the ``tp × dp`` grid of a stage).
        dp: training data parallel size.
        rollout_tp: GPUs per rollout engine (vLLM ``tensor_parallel_size``; 1 for the HF engine).
        colocate: engines on the training GPUs (hybrid) rather than on GPUs of their own.
        rollout_engines: dedicated engines (``colocate=False`` only; colocated runs have one
            per TP group of training processes).
        engine: ``vllm``, or ``hf`` (each training process samples with its own model).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    rollout_tp: int = 1
    colocate: bool = True
    rollout_engines: int = 0
    engine: Literal["vllm", "hf"] = "vllm"

    @property
    def training_processes(self) -> int:
        """``tp × pp × dp``."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Device:
    """One accelerator: its node and its index on that node (``CUDA_VISIBLE_DEVICES``)."""

    node: int
    local_gpu: int

    def __str__(self) -> str:
        return f"node {self.node} gpu {self.local_gpu}"


@dataclass(frozen=True)
class ProcessPlacement:
    """One process (a torchrun rank): what it does and where.

    Attributes:
        rank: global index of the process.
        roles: ``("train",)``, ``("rollout",)`` or ``("train", "rollout")`` (colocated).
        device: its GPU.
        train_tp_group: index of its training TP group, or None (rollout only).
        engine: index of the rollout engine it is a worker of, or None (training only).
    """

    rank: int
    roles: tuple[Role, ...]
    device: Device
    train_tp_group: int | None
    engine: int | None


@dataclass(frozen=True)
class EnginePlacement:
    """One rollout engine: the processes that run it and their GPUs (one node)."""

    index: int
    ranks: tuple[int, ...]
    devices: tuple[Device, ...]

    @property
    def node(self) -> int:
        return self.devices[0].node

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.devices)

    @property
    def cuda_visible_devices(self) -> str:
        """The engine's GPUs on its node, as ``CUDA_VISIBLE_DEVICES`` lists them."""
        return ",".join(str(d.local_gpu) for d in self.devices)


@dataclass(frozen=True)
class PlacementPlan:
    """Every process and engine of a run (``plan_placement``)."""

    nodes: int
    gpus_per_node: int
    layout: ParallelLayout
    processes: tuple[ProcessPlacement, ...]
    engines: tuple[EnginePlacement, ...]
    train_tp_groups: tuple[tuple[int, ...], ...]

    @property
    def training_ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.processes if "train" in p.roles)

    @property
    def rollout_only_ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.processes if p.roles == ("rollout",))

    @property
    def gpus_used(self) -> int:
        return len({p.device for p in self.processes})

    def engine_of(self, rank: int) -> EnginePlacement | None:
        """The engine ``rank`` is a worker of (None: it builds no engine)."""
        index = self.processes[rank].engine
        return None if index is None else self.engines[index]

    def render(self) -> str:
        """A few lines for ``lingo estimate``: the split, then one line per engine."""
        lay = self.layout
        mode = "colocated (hybrid)" if lay.colocate else "dedicated GPUs (non-hybrid)"
        lines = [
            f"placement: {self.nodes} node(s) × {self.gpus_per_node} GPU(s), {self.gpus_used} "
            f"used; {len(self.training_ranks)} training processes (TP {lay.tp} × PP {lay.pp} "
            f"× DP {lay.dp}, EP {lay.ep}); {len(self.engines)} {lay.engine} rollout "
            f"engine(s) of TP {lay.rollout_tp}, {mode}",
        ]
        for tp_group, ranks in enumerate(self.train_tp_groups):
            if len(self.train_tp_groups) > 8 and 4 <= tp_group < len(self.train_tp_groups) - 2:
                if tp_group == 4:
                    lines.append(f"  … {len(self.train_tp_groups) - 6} more training TP groups")
                continue
            device = self.processes[ranks[0]].device
            lines.append(
                f"  train TP group {tp_group}: ranks {_span(ranks)} on node {device.node} "
                f"gpus {_span(tuple(self.processes[r].device.local_gpu for r in ranks))}"
            )
        for engine in self.engines:
            lines.append(
                f"  engine {engine.index}: ranks {_span(engine.ranks)} on node {engine.node} "
                f"gpus {engine.cuda_visible_devices}"
            )
        return "\n".join(lines)


def _span(values: tuple[int, ...]) -> str:
    if len(values) > 1 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(v) for v in values)


def plan_placement(nodes: int, gpus_per_node: int, layout: ParallelLayout) -> PlacementPlan:
    """Place a run's processes and rollout engines on ``nodes × gpus_per_node`` GPUs.

    Args:
        nodes: machines.
        gpus_per_node: GPUs per machine (torchrun's ``nproc_per_node``).
        layout: the parallel layout.

    Returns:
        The plan: training processes first (ranks ``0 … T-1``, TP fastest), then in dedicated
        mode the rollout-only processes, each engine on ``rollout_tp`` consecutive GPUs of
        one node.

    Raises:
        PlacementError: sizes below 1, groups that would cross a node, more processes than
            GPUs, EP that does not divide ``tp × dp``, or engines that do not tile the ranks.
    """
    sizes = {
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "dp": layout.dp,
        "rollout_tp": layout.rollout_tp,
    }
    problems = [f"{name}={value} must be ≥ 1" for name, value in sizes.items() if value < 1]
    if problems:
        raise PlacementError("; ".join(problems))
    train = layout.training_processes
    total = nodes * gpus_per_node
    if gpus_per_node % layout.tp:
        problems.append(
            f"training TP {layout.tp} does not divide gpus_per_node {gpus_per_node}: a TP group "
            "would cross nodes"
        )
    if (layout.tp * layout.dp) % layout.ep:
        problems.append(f"EP {layout.ep} does not divide TP × DP = {layout.tp * layout.dp}")
    if gpus_per_node % layout.rollout_tp:
        problems.append(
            f"rollout TP {layout.rollout_tp} does not divide gpus_per_node {gpus_per_node}: an "
            "engine would cross nodes"
        )
    if layout.colocate:
        rollout = 0
        if layout.rollout_engines:
            problems.append(
                f"rollout_engines={layout.rollout_engines} is for dedicated GPUs; colocated "
                "runs have one engine per rollout-TP group of training processes"
            )
        if train % layout.rollout_tp:
            problems.append(
                f"{train} training processes are not a multiple of rollout TP "
                f"{layout.rollout_tp} (colocated engines tile the training GPUs)"
            )
    else:
        rollout = layout.rollout_engines * layout.rollout_tp
        if layout.rollout_engines < 1:
            problems.append("dedicated rollout GPUs (colocate=false) need rollout_engines ≥ 1")
        if train % layout.rollout_tp:
            problems.append(
                f"{train} training processes are not a multiple of rollout TP "
                f"{layout.rollout_tp}: the first dedicated engine would cross a node"
            )
    if train + rollout > total:
        problems.append(
            f"{train} training + {rollout} rollout GPUs > {nodes} nodes × {gpus_per_node} = {total}"
        )
    if problems:
        raise PlacementError("cannot place the run: " + "; ".join(problems))

    def device(rank: int) -> Device:
        return Device(rank // gpus_per_node, rank % gpus_per_node)

    if layout.colocate:
        engine_ranks = [
            tuple(range(start, start + layout.rollout_tp))
            for start in range(0, train, layout.rollout_tp)
        ]
    else:
        engine_ranks = [
            tuple(range(train + e * layout.rollout_tp, train + (e + 1) * layout.rollout_tp))
            for e in range(layout.rollout_engines)
        ]
    engine_of = {rank: e for e, ranks in enumerate(engine_ranks) for rank in ranks}
    processes = []
    for rank in range(train + rollout):
        roles: tuple[Role, ...] = ("train",) if rank < train else ()
        if rank in engine_of:
            roles = (*roles, "rollout")
        processes.append(
            ProcessPlacement(
                rank=rank,
                roles=roles,
                device=device(rank),
                train_tp_group=rank // layout.tp if rank < train else None,
                engine=engine_of.get(rank),
            )
        )
    engines = tuple(
        EnginePlacement(e, ranks, tuple(device(r) for r in ranks))
        for e, ranks in enumerate(engine_ranks)
    )
    tp_groups = tuple(
        tuple(range(start, start + layout.tp)) for start in range(0, train, layout.tp)
    )
    return PlacementPlan(nodes, gpus_per_node, layout, tuple(processes), engines, tp_groups)


def grpo_layout(cfg: GRPOConfig, world_size: int | None = None) -> ParallelLayout:
    """The parallel layout of a GRPO config on ``world_size`` training processes
    (``cfg.nproc`` by default): Megatron's TP / PP / EP from its layout, else pure data
    parallelism; an HF rollout engine has TP 1 (one per training process when colocated)."""
    world = world_size or cfg.nproc
    rollout = cfg.rollout
    tp = pp = ep = cp = 1
    if cfg.optim.backend == "megatron":
        megatron = cfg.optim.megatron.resolved_layout()
        tp, pp, ep, cp = megatron.tp, megatron.pp, megatron.ep, megatron.cp
    if world % (tp * pp * cp):
        raise PlacementError(f"{world} processes are not a multiple of TP × PP × CP")
    vllm = rollout.engine == "vllm"
    colocate = rollout.colocate
    return ParallelLayout(
        tp=tp,
        pp=pp,
        ep=ep,
        dp=world // (tp * pp * cp),
        rollout_tp=rollout.tensor_parallel_size if vllm else 1,
        colocate=colocate,
        rollout_engines=0 if colocate else rollout.num_engines,
        engine=rollout.engine,
    )


def grpo_placement(cfg: GRPOConfig, nodes: int, gpus_per_node: int) -> PlacementPlan:
    """The plan of a GRPO config whose training processes fill ``nodes × gpus_per_node``
    (its job); dedicated rollout engines go on the nodes after them."""
    layout = grpo_layout(cfg, nodes * gpus_per_node)
    rollout_gpus = layout.rollout_engines * layout.rollout_tp
    extra = rollout_nodes(rollout_gpus, gpus_per_node)
    return plan_placement(nodes + extra, gpus_per_node, layout)


def run_placement(cfg: GRPOConfig, info: DistInfo) -> PlacementPlan:
    """This run's placement plan, from torchrun's world (``LOCAL_WORLD_SIZE`` processes a
    node), checked against where this process actually is.

    Colocated: every process trains (and runs or shares an engine). Dedicated
    (``rollout.colocate=false``): the last ``num_engines × tensor_parallel_size`` processes
    of the job are rollout-only, the rest train.

    Raises:
        PlacementError: a job whose processes are not ``nproc`` training processes plus the
            engines', Megatron with multi-process vLLM, or a plan that puts this process on
            another device than torchrun did.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    rollout = cfg.rollout
    vllm = rollout.engine == "vllm"
    if not rollout.colocate:
        engine_processes = cfg.rollout_processes
        training = info.world_size - engine_processes
        problems = []
        if training != cfg.nproc:
            problems.append(
                f"{info.world_size} processes for {engine_processes} rollout-only processes "
                f"leave {training} training processes, not nproc={cfg.nproc}: start "
                f"nproc + {engine_processes} processes (torchrun --nproc-per-node)"
            )
        if problems:
            raise PlacementError("; ".join(problems))
        return plan_placement(max(1, info.world_size // local), local, grpo_layout(cfg, training))
    if vllm and info.world_size > 1 and cfg.optim.backend == "megatron":
        raise PlacementError(
            "rollout.engine=vllm with backend=megatron on several processes: the engines' "
            "prompt shares follow data-parallel ranks, which Megatron numbers differently; "
            "use rollout.engine=hf"
        )
    if info.world_size == 1:
        # one process: vLLM starts its own tensor-parallel workers on the visible GPUs
        return plan_placement(1, 1, ParallelLayout())
    plan = grpo_placement(cfg, info.world_size // local, local)
    mine = plan.processes[info.rank]
    expected = (info.rank // local, info.local_rank)
    if (mine.device.node, mine.device.local_gpu) != expected:
        raise PlacementError(
            f"rank {info.rank}: the plan puts it on {mine.device}, torchrun on node "
            f"{expected[0]} gpu {expected[1]}"
        )
    return plan
