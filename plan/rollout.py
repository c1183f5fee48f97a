"""The rollout engines of a GRPO run as placement reads them: how many, of how many GPUs, where."""

from __future__ import annotations

from dataclasses import dataclass

from plan.engines import engine_spec


@dataclass(frozen=True)
class RolloutEngines:
    """The rollout engines of a run, as placement reads them.

    Attributes:
        tp: GPUs per engine (vLLM ``tensor_parallel_size``; 1 for the HF engine).
        colocate: engines on the training GPUs (hybrid) rather than on GPUs of their own.
        dedicated: engines on GPUs of their own (``colocate=False`` only; colocated runs have
            one per ``tp`` consecutive training processes).
        engine: its ``rollout.engine`` name (``plan.ENGINE_SPECS``): ``vllm``, or ``hf``
            (each training process samples with its own model).
    """

    tp: int = 1
    colocate: bool = True
    dedicated: int = 0
    engine: str = "vllm"

    @property
    def processes(self) -> int:
        """Processes (GPUs) of the dedicated engines; 0 when colocated."""
        return 0 if self.colocate else self.dedicated * self.tp


def rollout_engines(
    engine: str, tensor_parallel_size: int, colocate: bool, num_engines: int
) -> RolloutEngines:
    """The engines a rollout config asks for (``rollout.engine``, ``tensor_parallel_size``,
    ``colocate``, ``num_engines``): vLLM's of ``tensor_parallel_size`` GPUs, or the HF
    engine's of one (``EngineSpec.gpus_per_engine``).

    Raises:
        UnknownSpecError: ``engine`` is not a registered rollout engine.
    """
    return RolloutEngines(
        tp=engine_spec(engine).gpus_per_engine(tensor_parallel_size),
        colocate=colocate,
        dedicated=0 if colocate else num_engines,
        engine=engine,
    )
