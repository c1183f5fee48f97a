"""The rollout engines, each one ``EngineSpec``: what the layers above need to know about it.

An "engine" is the rollout engine of a GRPO run (``rollout.engine``): ``hf`` (Hugging Face
``generate`` on a module in the process) or ``vllm``. The GRPO config's checks, the
placement, the capacity check, the weight sync and the rehearsal read a spec's fields
(``engine_spec(rollout.engine).gpus_per_engine(...)``) instead of comparing names; a new engine
is one ``EngineSpec`` in ``ENGINE_SPECS`` (its builders are registered in
``trainer.grpo.engines.ENGINES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plan.specs import lookup

Transport = Literal["shared", "in_process_reload", "channel", "nccl", "lingo_gloo"]
"""How the policy's weights reach the engines (``trainer.grpo.weight_transfer``)."""


@dataclass(frozen=True)
class EngineSpec:
    """The facts of one rollout engine that code outside it decides on.

    Attributes:
        name: its ``rollout.engine`` name.
        tensor_parallel: one engine is split over ``rollout.tensor_parallel_size`` GPUs (its
            worker processes), so a colocated engine generates the prompts of all of them;
            otherwise an engine is one GPU, one process.
        reserves_gpu_memory: it claims ``gpu_memory_utilization`` of each of its GPUs for a
            copy of the weights and a paged KV cache, which the capacity planner sizes as
            rollout GPUs; otherwise it generates with a Hugging Face module that the planner
            counts with the training model.
        needs_cuda: the build the images ship runs only on CUDA devices (vLLM's; its CPU
            build is a test environment of its own, ``tools/vllm_env.sh``), so a CPU
            rehearsal stands the HF engine in for it.
        serves_lora: it generates with a peft LoRA adapter on the policy (LoRA GRPO).
        colocated_transfer: the weight sync's transport when it shares the training processes.
        colocated_reason: why, as the run's log says it.
        dedicated_transfer: the transport to engines in processes of their own (``nccl``
            falls back to ``lingo_gloo`` without CUDA or without vLLM on the sender:
            ``trainer.grpo.weight_transfer.select_transfer``).
        dedicated_reason: why, as the run's log says it.
    """

    name: str
    tensor_parallel: bool
    reserves_gpu_memory: bool
    needs_cuda: bool
    serves_lora: bool
    colocated_transfer: Transport
    colocated_reason: str
    dedicated_transfer: Transport
    dedicated_reason: str

    def gpus_per_engine(self, tensor_parallel_size: int) -> int:
        """GPUs (and processes) one engine takes, given ``rollout.tensor_parallel_size``."""
        return tensor_parallel_size if self.tensor_parallel else 1


ENGINE_SPECS: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            name="hf",
            tensor_parallel=False,
            reserves_gpu_memory=False,
            needs_cuda=False,
            serves_lora=True,
            colocated_transfer="shared",
            colocated_reason="colocated HF engine: the trained module itself",
            dedicated_transfer="channel",
            dedicated_reason="dedicated HF engines load what they receive",
        ),
        EngineSpec(
            name="vllm",
            tensor_parallel=True,
            reserves_gpu_memory=True,
            needs_cuda=True,
            serves_lora=False,
            colocated_transfer="in_process_reload",
            colocated_reason="colocated vLLM: its worker is this process",
            dedicated_transfer="nccl",
            dedicated_reason=(
                "dedicated vLLM on CUDA: trainer and every TP worker in one NCCL group"
            ),
        ),
    )
}
"""The rollout engines by name."""


def engine_spec(name: str, field: str = "rollout.engine") -> EngineSpec:
    """The spec of the rollout engine ``name``.

    Raises:
        UnknownSpecError: no engine of that name; the message names ``field`` and the known
            names.
    """
    return lookup(ENGINE_SPECS, name, field, "rollout engine")
