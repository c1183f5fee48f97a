"""The GRPO config a pipeline branch runs: the one derivation of the branch's config.

A preset's pipeline holds one GRPO config for its branches (``Preset.grpo_branches``); a run
picks a branch (the ``backend`` parameter: ``hf`` trains the Hugging Face weights with the
config's own ``optim.backend``, another branch names the trainer backend it runs). The GRPO
step, the capacity check, the preflight and the rehearsal derive the branch's config here
alike, from the config as the pipeline passes it (a dict): plain dict code, so every layer
can call it and the step validates the result (``trainer.grpo.config.GRPOConfig``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plan.backends import TRAINERS, branch_backend

DEFAULT_MEGATRON_LAYOUT = "tiny-cpu"
"""The Megatron layout (``trainer.megatron.layout.MEGATRON_LAYOUTS``) of a model-parallel
branch whose config and pipeline name none."""


def branch_config(
    config: Mapping[str, Any],
    backend: str = "",
    megatron_layout: Mapping[str, Any] | str | None = None,
    megatron_checkpoint: str | None = None,
    megatron_optim: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The GRPO config (a dict, as the pipeline passes it) that a pipeline branch runs.

    ``backend``: the pipeline's ``backend`` parameter; a branch named after a trainer backend
    (``megatron``) sets ``optim.backend``, ``""`` or ``hf`` (the branch that trains the HF
    weights) keep the config's own (``branch_backend``). On a model-parallel backend
    (``TrainerSpec.model_parallel``):

    - ``megatron_optim`` (the pipeline's parameter), when given, replaces the config's
      ``optim``, and ``gradient_checkpointing`` is off: the pipeline takes one ``grpo_config``
      for both branches, and what differs is the optimizer's settings (DeepSpeed's ZeRO stage
      and offload flags, the Hugging Face model's ``gradient_checkpointing``), whose
      Megatron-Core equivalents live in ``optim.megatron`` (``optimizer_offload_fraction``,
      ``recompute_granularity``). Without it the config's ``optim`` is kept (and the config's
      checks say what does not fit Megatron).
    - the actor's layout is ``megatron_layout`` unless the optim block names one
      (``DEFAULT_MEGATRON_LAYOUT`` when neither does), and ``megatron_checkpoint``
      (``convert_megatron``'s output, when known) is where it starts.

    Rollout, algorithm and batch settings are the run's, unchanged; the input is not changed.
    """
    config = {**config, "optim": dict(config.get("optim") or {})}
    if (branch := branch_backend(backend)) is not None:
        config["optim"]["backend"] = branch
    name = config["optim"].get("backend")
    if name not in TRAINERS or not TRAINERS[name].model_parallel:
        return config
    if megatron_optim:
        config["optim"] = {**megatron_optim, "backend": name}
        config["gradient_checkpointing"] = False
    megatron = dict(config["optim"].get("megatron") or {})
    megatron.setdefault("layout", megatron_layout or DEFAULT_MEGATRON_LAYOUT)
    if megatron_checkpoint is not None:
        megatron["checkpoint"] = megatron_checkpoint
    config["optim"]["megatron"] = megatron
    return config
