"""``ParallelSizes``: how a run splits its model over processes, and the one set of rules.

Megatron-Core lays two rank grids over the same processes
(``megatron.core.parallel_state.initialize_model_parallel``):

- the dense grid ``world = tp × cp × dp × pp`` (attention and everything else); it raises
  "world_size (W) is not divisible by tp × pp × cp" otherwise and derives ``dp`` from it;
- the expert grid ``world = etp × ep × expert-dp × pp`` (the routed experts); it raises
  "world_size is not divisible by expert_tensor_model_pipeline_parallel size" otherwise.

A run without Megatron (DeepSpeed, plain PyTorch) is the case ``tp = pp = ep = etp = cp = 1``:
pure data parallelism, ``dp = world``. Every rule here is checked against a world size that
the caller names (``training_gpus``, ``nproc``, a layout's ``nodes × gpus_per_node``), so the
message says which input to change. Rules between the sizes and a model's shapes (heads,
layers, experts) live with the model (``trainer.megatron.layout``); rules about where
processes sit on machines live with the placement (``trainer.placement``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


class ParallelSizesError(ValueError):
    """Parallel sizes that a world of processes cannot hold; ``problems`` lists each rule."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class ParallelSizes:
    """How a run splits its work over processes (the one meaning of "layout").

    Attributes:
        tp: tensor parallel size (splits attention heads and dense matrices).
        pp: pipeline parallel size (splits the layers into stages).
        ep: expert parallel size (splits the routed experts).
        etp: expert tensor parallel size (splits each expert's matrices).
        cp: context parallel size (splits the sequence in attention).
        dp: data parallel size; ``None`` until a world size fixes it (``for_world``).

    Raises:
        ParallelSizesError: a size below 1 (the message names it).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp: int | None = None

    def __post_init__(self) -> None:
        low = [
            f"{f.name}={getattr(self, f.name)} must be ≥ 1"
            for f in fields(self)
            if getattr(self, f.name) is not None and getattr(self, f.name) < 1
        ]
        if low:
            raise ParallelSizesError(low)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The sizes' names: tp, pp, ep, etp, cp, dp."""
        return tuple(f.name for f in fields(cls))

    @property
    def model_parallel(self) -> int:
        """``tp × pp × cp``: processes that hold one copy of the dense model."""
        return self.tp * self.pp * self.cp

    @property
    def expert_model_parallel(self) -> int:
        """``etp × ep × pp``: processes that hold one copy of the experts."""
        return self.etp * self.ep * self.pp

    def problems(self, world: int, world_name: str = "world size") -> list[str]:
        """Every rule the sizes break on ``world`` processes, one line each.

        Args:
            world: processes (GPUs) the sizes are laid over.
            world_name: what the caller calls the world (``training_gpus``, ``nproc`` ...),
                so a message names the input to change.

        Returns:
            The broken rules (empty: the sizes fit the world):

            - ``world ≥ 1``;
            - ``tp × pp × cp`` divides the world (the dense grid; ``dp`` is the quotient);
            - a given ``dp`` is that quotient;
            - ``etp × ep × pp`` divides the world (the expert grid).
        """
        if world < 1:
            return [f"{world_name} {world} must be ≥ 1"]
        problems = []
        dense = self.model_parallel
        if world % dense:
            problems.append(
                f"{world_name} {world} is not a multiple of tp × pp × cp = {self.tp} × "
                f"{self.pp} × {self.cp} = {dense}, so dp = {world_name} / (tp × pp × cp) is "
                "no integer"
            )
        elif self.dp is not None and self.dp != world // dense:
            problems.append(
                f"dp={self.dp} but {world_name} {world} = tp × pp × cp × dp needs "
                f"dp={world // dense} (tp × pp × cp × dp = {dense * self.dp})"
            )
        expert = self.expert_model_parallel
        if world % expert:
            problems.append(
                f"{world_name} {world} is not a multiple of etp × ep × pp = {self.etp} × "
                f"{self.ep} × {self.pp} = {expert} (Megatron-Core's expert grid: world = "
                "etp × ep × expert-dp × pp)"
            )
        return problems

    def for_world(self, world: int, world_name: str = "world size") -> ParallelSizes:
        """These sizes with ``dp`` derived from ``world``, after every rule is checked.

        Raises:
            ParallelSizesError: one or more rules of ``problems`` fail.
        """
        problems = self.problems(world, world_name)
        if problems:
            raise ParallelSizesError(problems)
        return replace(self, dp=world // self.model_parallel)

    def expert_data_parallel(self, world: int) -> int:
        """Data-parallel size of the expert grid, ``world / (etp × ep × pp)``."""
        return world // self.expert_model_parallel
