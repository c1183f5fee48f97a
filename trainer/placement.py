"""Where every process of a GRPO run sits, and which rollout engine spans which GPUs.

``plan_placement`` is a pure function from the cluster (nodes × GPUs per node), the training
processes' parallel sizes (``plan.ParallelSizes``: TP / PP / EP / ETP / CP / DP) and the
rollout engines (``RolloutEngines``: their TP, colocated or on dedicated GPUs) to a
``PlacementPlan``: each process's roles (``train``, ``rollout``), its device (node, local GPU
index) and its groups. Processes are placed as torchrun places them, one per GPU:
process ``r`` on node ``r // gpus_per_node``, GPU ``r % gpus_per_node``.

- **Colocated** (hybrid): every training process also rolls out. The vLLM engines are the
  TP groups of ``rollout_tp`` consecutive training processes: one engine per group, spanning
  those processes' GPUs (vLLM's ``external_launcher`` mode, where each process of the group
  runs one worker of the engine).
- **Dedicated** (non-hybrid): ``rollout_engines`` engines of ``rollout_tp`` GPUs each, on the
  GPUs after the training processes (processes ``T``, ``T+1``, … that only roll out).

Rules checked: the parallel sizes fit the training processes (``ParallelSizes.problems``,
Megatron-Core's two rank grids, the one copy of those rules), training TP groups and rollout
engines stay within a node (their collectives run every layer), no two engines share a GPU,
and the counts add up. ``run_placement`` is the
GRPO run's plan checked at start against torchrun's world and where this process is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from plan import ParallelSizes, ParallelSizesError, StepShape, engine_spec, rollout_engines
from plan import RolloutEngines as RolloutEngines  # re-exported: placement's input

if TYPE_CHECKING:
    from trainer.distributed import DistInfo
    from trainer.grpo.config import GRPOConfig

Role = Literal["train", "rollout"]


class PlacementError(ValueError):
    """A run that cannot be placed on the cluster; the message names the numbers."""


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
    sizes: ParallelSizes
    rollout: RolloutEngines
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
        sizes, rollout = self.sizes, self.rollout
        mode = "colocated (hybrid)" if rollout.colocate else "dedicated GPUs (non-hybrid)"
        cp = f" × CP {sizes.cp}" if sizes.cp > 1 else ""
        etp = f", ETP {sizes.etp}" if sizes.etp > 1 else ""
        lines = [
            f"placement: {self.nodes} node(s) × {self.gpus_per_node} GPU(s), {self.gpus_used} "
            f"used; {len(self.training_ranks)} training processes (TP {sizes.tp} × PP "
            f"{sizes.pp}{cp} × DP {sizes.dp}, EP {sizes.ep}{etp}); {len(self.engines)} "
            f"{rollout.engine} rollout engine(s) of TP {rollout.tp}, {mode}",
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


def plan_placement(
    nodes: int,
    gpus_per_node: int,
    sizes: ParallelSizes,
    rollout: RolloutEngines | None = None,
) -> PlacementPlan:
    """Place a run's processes and rollout engines on ``nodes × gpus_per_node`` GPUs.

    Args:
        nodes: machines.
        gpus_per_node: GPUs per machine (torchrun's ``nproc_per_node``).
        sizes: the training processes' parallel sizes, ``dp`` given: they are
            ``tp × pp × cp × dp`` processes (``ParallelSizes.for_world`` fits them).
        rollout: the rollout engines (default: one colocated engine of TP 1 per process).

    Returns:
        The plan: training processes first (ranks ``0 … T-1``, TP fastest), then in dedicated
        mode the rollout-only processes, each engine on ``rollout.tp`` consecutive GPUs of
        one node.

    Raises:
        PlacementError: sizes below 1 or ``dp`` not given, parallel sizes that break
            Megatron-Core's grids on the training processes (``ParallelSizes.problems``),
            groups that would cross a node, more processes than GPUs, or engines that do not
            tile the ranks.
    """
    rollout = rollout or RolloutEngines()
    train, dedicated = _check_placement(nodes, gpus_per_node, sizes, rollout)

    def device(rank: int) -> Device:
        return Device(rank // gpus_per_node, rank % gpus_per_node)

    if rollout.colocate:
        engine_ranks = [
            tuple(range(start, start + rollout.tp)) for start in range(0, train, rollout.tp)
        ]
    else:
        engine_ranks = [
            tuple(range(train + e * rollout.tp, train + (e + 1) * rollout.tp))
            for e in range(rollout.dedicated)
        ]
    engine_of = {rank: e for e, ranks in enumerate(engine_ranks) for rank in ranks}
    processes = []
    for rank in range(train + dedicated):
        roles: tuple[Role, ...] = ("train",) if rank < train else ()
        if rank in engine_of:
            roles = (*roles, "rollout")
        processes.append(
            ProcessPlacement(
                rank=rank,
                roles=roles,
                device=device(rank),
                train_tp_group=rank // sizes.tp if rank < train else None,
                engine=engine_of.get(rank),
            )
        )
    engines = tuple(
        EnginePlacement(e, ranks, tuple(device(r) for r in ranks))
        for e, ranks in enumerate(engine_ranks)
    )
    tp_groups = tuple(tuple(range(start, start + sizes.tp)) for start in range(0, train, sizes.tp))
    return PlacementPlan(nodes, gpus_per_node, sizes, rollout, tuple(processes), engines, tp_groups)


def _check_placement(
    nodes: int, gpus_per_node: int, sizes: ParallelSizes, rollout: RolloutEngines
) -> tuple[int, int]:
    """The training processes and dedicated rollout GPUs of a placement that fits, or a
    ``PlacementError`` naming every reason it does not (``plan_placement``'s Raises)."""
    counts = {"nodes": nodes, "gpus_per_node": gpus_per_node, "rollout tp": rollout.tp}
    problems = [f"{name}={value} must be ≥ 1" for name, value in counts.items() if value < 1]
    if sizes.dp is None:
        problems.append(
            "the parallel sizes have no dp: fit them to the training processes first "
            "(ParallelSizes.for_world)"
        )
    if problems:
        raise PlacementError("; ".join(problems))
    train = sizes.tp * sizes.pp * sizes.cp * sizes.dp
    total = nodes * gpus_per_node
    problems += sizes.problems(train, "training processes")
    if gpus_per_node % sizes.tp:
        problems.append(
            f"training TP {sizes.tp} does not divide gpus_per_node {gpus_per_node}: a TP group "
            "would cross nodes"
        )
    if gpus_per_node % rollout.tp:
        problems.append(
            f"rollout TP {rollout.tp} does not divide gpus_per_node {gpus_per_node}: an "
            "engine would cross nodes"
        )
    dedicated = 0 if rollout.colocate else rollout.dedicated * rollout.tp
    problems += _engine_problems(train, rollout)
    if train + dedicated > total:
        problems.append(
            f"{train} training + {dedicated} rollout GPUs > {nodes} nodes × {gpus_per_node} = "
            f"{total}"
        )
    if problems:
        raise PlacementError("cannot place the run: " + "; ".join(problems))
    return train, dedicated


def _engine_problems(train: int, rollout: RolloutEngines) -> list[str]:
    """Why the rollout engines do not tile ``train`` training processes (colocated) or fill
    GPUs of their own (dedicated)."""
    problems = []
    if rollout.colocate:
        if rollout.dedicated:
            problems.append(
                f"rollout_engines={rollout.dedicated} is for dedicated GPUs; colocated "
                "runs have one engine per rollout-TP group of training processes"
            )
        if train % rollout.tp:
            problems.append(
                f"{train} training processes are not a multiple of rollout TP "
                f"{rollout.tp} (colocated engines tile the training GPUs)"
            )
        return problems
    if rollout.dedicated < 1:
        problems.append("dedicated rollout GPUs (colocate=false) need rollout_engines ≥ 1")
    if train % rollout.tp:
        problems.append(
            f"{train} training processes are not a multiple of rollout TP "
            f"{rollout.tp}: the first dedicated engine would cross a node"
        )
    return problems


def grpo_sizes(cfg: GRPOConfig, training: int) -> ParallelSizes:
    """The parallel sizes of a GRPO config's ``training`` processes: its Megatron layout's
    (``plan.ParallelSizes``), else pure data parallelism, ``dp`` fitted to ``training``.

    Raises:
        PlacementError: the sizes break Megatron-Core's grids on ``training`` processes.
    """
    return _fitted(_config_sizes(cfg), training)


def _config_sizes(cfg: GRPOConfig) -> ParallelSizes:
    """A GRPO config's parallel sizes, not fitted: its Megatron layout's, else none."""
    if cfg.optim.trainer.model_parallel:
        return cfg.optim.megatron.resolved_layout().parallel_sizes
    return ParallelSizes()


def _fitted(sizes: ParallelSizes, training: int) -> ParallelSizes:
    try:
        return sizes.for_world(training, "training processes")
    except ParallelSizesError as error:
        raise PlacementError(f"cannot place the run: {error}") from None


def grpo_rollout_engines(cfg: GRPOConfig) -> RolloutEngines:
    """The rollout engines of a GRPO config: vLLM's of ``tensor_parallel_size`` GPUs, or the HF
    engine's of TP 1 (one per training process when colocated)."""
    rollout = cfg.rollout
    return rollout_engines(
        rollout.engine, rollout.tensor_parallel_size, rollout.colocate, rollout.num_engines
    )


def grpo_placement(cfg: GRPOConfig, nodes: int, gpus_per_node: int) -> PlacementPlan:
    """The plan of a GRPO config whose training processes fill ``nodes × gpus_per_node``
    (its job); dedicated rollout engines go on the nodes after them."""
    training = nodes * gpus_per_node
    rollout = grpo_rollout_engines(cfg)
    trainer, sizes = cfg.optim.trainer, _config_sizes(cfg)
    return step_placement(StepShape(trainer, nodes, gpus_per_node, training, sizes, rollout))


def step_placement(shape: StepShape) -> PlacementPlan:
    """The plan of a GRPO step's shape (``plan.RunPlan``'s ``grpo``): its training processes
    fill ``nodes × gpus_per_node``, its dedicated rollout engines the nodes after them.

    Raises:
        PlacementError: the sizes break Megatron-Core's grids on the training processes, or
            the run cannot be placed (``plan_placement``).
    """
    sizes = _fitted(shape.sizes, shape.nodes * shape.gpus_per_node)
    return plan_placement(shape.job_nodes, shape.gpus_per_node, sizes, shape.rollout)


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
        return plan_placement(
            max(1, info.world_size // local),
            local,
            grpo_sizes(cfg, training),
            grpo_rollout_engines(cfg),
        )
    # a colocated engine over several processes generates their prompts, which follow
    # data-parallel ranks; a model-parallel backend numbers those differently
    spans_processes = engine_spec(rollout.engine).tensor_parallel
    if spans_processes and info.world_size > 1 and cfg.optim.trainer.model_parallel:
        raise PlacementError(
            f"rollout.engine={rollout.engine} with backend={cfg.optim.backend} on several "
            "processes: the engines' prompt shares follow data-parallel ranks, which Megatron "
            "numbers differently; use rollout.engine=hf"
        )
    if info.world_size == 1:
        # one process: vLLM starts its own tensor-parallel workers on the visible GPUs
        return plan_placement(1, 1, ParallelSizes(dp=1))
    plan = grpo_placement(cfg, info.world_size // local, local)
    mine = plan.processes[info.rank]
    expected = (info.rank // local, info.local_rank)
    if (mine.device.node, mine.device.local_gpu) != expected:
        raise PlacementError(
            f"rank {info.rank}: the plan puts it on {mine.device}, torchrun on node "
            f"{expected[0]} gpu {expected[1]}"
        )
    return plan
