"""The trainer backends, each one ``TrainerSpec``: what the layers above need to know about it.

A "backend" is the trainer backend (``OptimConfig.backend``): ``torch`` (one plain PyTorch
process), ``deepspeed`` (the Hugging Face model under DeepSpeed ZeRO) or ``megatron``
(Megatron-Core's model, split by a Megatron layout's parallel sizes). The capacity planner,
the configs' checks, the placement and the pipeline read a spec's fields
(``trainer_spec(optim.backend).model_parallel``) instead of comparing names; a new backend is
one ``TrainerSpec`` in ``TRAINERS`` (its builder is registered in ``trainer.backends.BACKENDS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from plan.specs import lookup

HF_WEIGHTS = "huggingface"
"""The weight format of a Hugging Face directory (safetensors and config.json)."""

HF_BRANCH = "hf"
"""The pipeline's GRPO branch that trains the Hugging Face weights with the config's own
``optim.backend`` (``Preset.backend``, the pipeline's ``backend`` parameter)."""

MEGATRON_BRANCH = "megatron"
"""The pipeline's GRPO branch that converts the SFT model to a Megatron checkpoint, trains it
with the ``megatron`` trainer backend and exports it back (named after that backend:
``branch_backend``)."""

GRPO_BRANCHES = (HF_BRANCH, MEGATRON_BRANCH)
"""The GRPO branches a pipeline can compile (``Preset.grpo_branches``)."""


@dataclass(frozen=True)
class TrainerSpec:
    """The facts of one trainer backend that code outside it decides on.

    Attributes:
        name: its ``OptimConfig.backend`` name.
        zero: DeepSpeed ZeRO splits its state over the data-parallel ranks by ``zero_stage``
            (optimizer states from stage 1, gradients from 2, parameters at 3) and can move the
            optimizer and parameters to the host (``offload_optimizer``, ``offload_params``).
        model_parallel: the model is split by a Megatron layout's parallel sizes (tp, pp, ep;
            ``optim.megatron.layout``): each rank builds its own shards and reads its own shards
            of the checkpoint.
        trains_hf_module: the Hugging Face module is what trains, so its switches and
            wrappers apply (``gradient_checkpointing``, peft LoRA adapters, the hook on its
            router that replays the engine's expert choices); SFT trains only such backends.
        multi_process: runs on several processes (``nproc`` > 1).
        weight_format: the format of the policy its step writes (the model artifact's
            ``format``): ``huggingface``, or ``megatron-torch_dist`` (Megatron's distributed
            checkpoint).
        image: which of the components' images runs its training processes
            (``components.images.TRAINER_IMAGES``): ``gpu`` or ``megatron``.
    """

    name: str
    zero: bool
    model_parallel: bool
    trains_hf_module: bool
    multi_process: bool
    weight_format: str
    image: str

    @property
    def needs_conversion(self) -> bool:
        """It trains a checkpoint converted from the Hugging Face model
        (``convert_megatron``) and writes one that must be exported back (``export_hf``)."""
        return self.weight_format != HF_WEIGHTS

    def shards_parameters(self, zero_stage: int) -> bool:
        """No rank holds the whole model while it trains (ZeRO-3, or a model-parallel
        split), so a weight sync gathers the parameters first."""
        return self.model_parallel or (self.zero and zero_stage == 3)


TRAINERS: dict[str, TrainerSpec] = {
    spec.name: spec
    for spec in (
        TrainerSpec(
            name="torch",
            zero=False,
            model_parallel=False,
            trains_hf_module=True,
            multi_process=False,
            weight_format=HF_WEIGHTS,
            image="gpu",
        ),
        TrainerSpec(
            name="deepspeed",
            zero=True,
            model_parallel=False,
            trains_hf_module=True,
            multi_process=True,
            weight_format=HF_WEIGHTS,
            image="gpu",
        ),
        TrainerSpec(
            name="megatron",
            zero=False,
            model_parallel=True,
            trains_hf_module=False,
            multi_process=True,
            weight_format="megatron-torch_dist",
            image="megatron",
        ),
    )
}
"""The trainer backends by name."""


def trainer_spec(name: str, field: str = "optim.backend") -> TrainerSpec:
    """The spec of the trainer backend ``name``.

    Raises:
        UnknownSpecError: no backend of that name; the message names ``field`` and the known
            names.
    """
    return lookup(TRAINERS, name, field, "trainer backend")


def branch_backend(branch: str) -> str | None:
    """The trainer backend a pipeline GRPO branch imposes: None for ``hf`` (or ``""``), the
    branch that trains the Hugging Face weights with the config's own ``optim.backend``;
    any other branch is named after the backend it runs (``megatron``)."""
    return None if branch in ("", HF_BRANCH) else branch
