"""The layouts the capacity check estimates, derived from what the run will do.

A preset's ``Hardware`` (``cluster.hardware``) gives the machines
(``capacity.layouts.hardware_layout``: GPU and host memory, storage, what the OS keeps,
whether the GPU has a fused attention kernel with sinks); a layout preset
(``layouts.LAYOUT_PRESETS``) can stand in for it (``lingo estimate --layout``). Everything the
SFT and GRPO configs and the run's plan (``plan.RunPlan``) and placement decide — how many
processes train on how many nodes, the backend and its parallel sizes, ZeRO stage and
offload, the attention kernel that backend runs (``core.attention``, which the model loaders
follow too), micro-batch, sequence lengths, rollout engines, group size, KL, checkpoints kept
— is taken from them, so the check estimates the run that will start, and changing a config
changes the estimate. Explicit layout overrides still come last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from capacity.layouts import Layout, LayoutError, hardware_layout, parallel_fields, resolve_layout
from core.attention import training_attention
from plan import ParallelSizes, RunPlan, engine_spec

if TYPE_CHECKING:
    from trainer.backends.config import OptimConfig
    from trainer.grpo.config import GRPOConfig
    from trainer.placement import PlacementPlan
    from trainer.sft.config import SFTConfig


def _dtype(config_dtype: str, hardware: Layout) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(config_dtype, hardware.dtype)


def _training_fields(optim: OptimConfig, hardware: Layout) -> dict[str, object]:
    """Backend, ZeRO stage and offload of a step's optimizer settings, and the attention
    kernel that backend runs on ``hardware`` (``core.attention.training_attention``: the HF
    model runs eager attention even where the GPU has a fused kernel with sinks)."""
    fused_sinks = hardware.attn_implementation == "flash"
    trainer = optim.trainer
    attention = {"attn_implementation": training_attention(trainer.trains_hf_module, fused_sinks)}
    if trainer.model_parallel:
        return {
            **attention,
            "backend": optim.backend,
            "adam_offload": optim.megatron.optimizer_offload_fraction > 0,
            "param_offload": False,
        }
    return {
        **attention,
        "backend": "deepspeed",
        # the torch backend is one plain process: DeepSpeed stage 0 is the planner's model of it
        "zero_stage": optim.zero_stage if trainer.zero else 0,
        "adam_offload": trainer.zero and optim.offload_optimizer,
        "param_offload": trainer.zero and optim.offload_params,
        # how the step's loader loads (trainer.backends.loading): the planner models the same
        "partitioned_load": optim.partitioned_load,
    }


def _validated(hardware: Layout, name: str, fields: dict, overrides: dict[str, str] | None):
    try:
        derived = Layout.model_validate({**hardware.model_dump(), **fields, "name": name})
    except ValueError as error:
        raise LayoutError(
            f"{name}: the run does not fit layout {hardware.name!r}: {error}"
        ) from None
    return resolve_layout(derived, overrides)


def grpo_layout(
    hardware: str | Layout,
    grpo: GRPOConfig,
    plan: PlacementPlan,
    overrides: dict[str, str] | None = None,
) -> Layout:
    """The GRPO run as a planner layout: ``hardware``'s machines, ``grpo`` and ``plan``'s run.

    Args:
        hardware: a layout preset name or ``Layout`` (memory, storage, device, kernels).
        grpo: the GRPO step's config.
        plan: its placement plan (``trainer.placement.grpo_placement``).
        overrides: ``key=value`` layout fields applied last (``lingo estimate --set``).

    Raises:
        LayoutError: the run cannot be described on that hardware (e.g. rollout GPUs on a
            CPU layout) or an override is invalid.
    """
    base = resolve_layout(hardware)
    sizes, engines = plan.sizes, plan.rollout
    # the planner sizes an engine's GPUs where it reserves their memory (vLLM); the HF engine
    # generates with a module it counts with training
    own_gpus = engine_spec(grpo.rollout.engine).reserves_gpu_memory
    hf_module = grpo.optim.trainer.trains_hf_module
    fields: dict[str, object] = {
        "nodes": plan.nodes,
        "gpus_per_node": plan.gpus_per_node,
        "training_gpus": len(plan.training_ranks),
        "rollout_gpus": len(plan.engines) * engines.tp if own_gpus else 0,
        "hybrid": own_gpus and engines.colocate,
        # the recipe sleeps vLLM during the update; it does not park training state while
        # vLLM is awake
        "deepspeed_enable_sleep": False,
        **_training_fields(grpo.optim, base),
        **parallel_fields(sizes),
        "dtype": _dtype(grpo.dtype, base),
        "micro_train_batch_size": grpo.micro_batch_size,
        "prompt_max_len": grpo.rollout.max_prompt_tokens,
        "generate_max_len": grpo.rollout.max_new_tokens,
        "gradient_checkpointing": (
            grpo.gradient_checkpointing
            if hf_module
            else grpo.optim.megatron.recompute_granularity is not None
        ),
        # full GRPO trains every weight of the merged SFT model; LoRA GRPO an adapter on it
        "lora_rank": grpo.lora.r,
        "lora_experts": grpo.lora.experts,
        "kl": grpo.algorithm.kl_loss_coef > 0,
        "rollout_batch_size": grpo.prompts_per_step,
        "n_samples_per_prompt": grpo.rollout.n_samples,
        "vllm_tensor_parallel_size": engines.tp if own_gpus else 1,
        "vllm_gpu_memory_utilization": grpo.rollout.gpu_memory_utilization,
        "rollout_dtype": "bf16",  # the engine is built with dtype=bfloat16
        "max_ckpt_num": grpo.max_ckpt_num,
        "sync_bucket_mb": grpo.rollout.sync_bucket_mb,
        # LoRA GRPO's export merges on rank 0: the model whole, and its reload for the check
        "final_model_on_rank0": grpo.lora.r > 0,
    }
    return _validated(base, f"{base.name} (GRPO as configured)", fields, overrides)


def sft_layout(
    hardware: str | Layout,
    sft: SFTConfig,
    nodes: int,
    gpus_per_node: int,
    overrides: dict[str, str] | None = None,
) -> Layout:
    """The SFT run as a planner layout: ``sft.nproc`` processes on ``nodes × gpus_per_node``,
    no rollouts; a training row is one sequence of ``max_seq_len`` tokens (counted as the
    prompt, with one generated token, since the planner's sequence is prompt + completion)."""
    base = resolve_layout(hardware)
    fields: dict[str, object] = {
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "training_gpus": sft.nproc,
        "rollout_gpus": 0,
        "rollouts": False,
        "hybrid": False,
        "deepspeed_enable_sleep": False,
        **_training_fields(sft.optim, base),
        **parallel_fields(ParallelSizes()),  # SFT is data parallel
        "dtype": _dtype(sft.dtype, base),
        "micro_train_batch_size": sft.micro_batch_size,
        "prompt_max_len": sft.max_seq_len,
        "generate_max_len": 1,
        "gradient_checkpointing": sft.gradient_checkpointing,
        "lora_rank": sft.lora.r,
        "lora_experts": sft.lora.experts,
        "kl": False,
        "max_ckpt_num": sft.keep_checkpoints,
        # the merge: rank 0 holds the trained model whole, and its reload for the check
        "final_model_on_rank0": True,
    }
    return _validated(base, f"{base.name} (SFT as configured)", fields, overrides)


def run_estimates(model, hardware: str | Layout, run: RunPlan):
    """The SFT and GRPO estimates of a run, with the GRPO placement plan.

    Args:
        model: see ``load_model_spec`` (preset, directory, ``config.json``, mapping).
        hardware: the machines: a layout preset name or a ``Layout`` (``hardware_layout``).
        run: the run's plan: each step's config (the GRPO branch's) and shape (nodes,
            processes per node; dedicated rollout engines placed on the nodes after the
            training processes), and the layout fields applied last, to both.

    Returns:
        ``(placement plan, {"sft": Estimate, "grpo": Estimate})``.
    """
    from capacity.estimate import estimate_layout
    from capacity.model_spec import load_model_spec
    from trainer.grpo.config import GRPOConfig
    from trainer.placement import step_placement
    from trainer.sft.config import SFTConfig

    spec = load_model_spec(model)
    sft = SFTConfig.model_validate(run.sft_config)
    grpo = GRPOConfig.model_validate(run.grpo_config)
    plan = step_placement(run.grpo)
    overrides = dict(run.layout_overrides)
    layouts = {
        "sft": sft_layout(hardware, sft, run.sft.nodes, run.sft.gpus_per_node, overrides),
        "grpo": grpo_layout(hardware, grpo, plan, overrides),
    }
    return plan, {step: estimate_layout(spec, layout) for step, layout in layouts.items()}


def check_run(
    model,
    hardware: dict,
    sft_config: dict,
    grpo_config: dict,
    sft_execution: dict,
    grpo_execution: dict,
    overrides: dict[str, str] | None = None,
    backend: str = "",
    megatron_layout: dict | None = None,
    megatron_optim: dict | None = None,
):
    """The pipeline's capacity check: ``(Markdown report, first estimate that does not fit
    or None)`` for the configs as the pipeline passes them (dicts: ``hardware`` a
    ``Hardware``, the others step configs and executions), validated here.

    ``backend``, ``megatron_layout`` and ``megatron_optim`` are the pipeline's parameters: on
    its Megatron branch (``backend="megatron"``) GRPO is estimated as that branch runs it
    (Megatron-Core with the layout and the branch's optimizer block, ``plan.RunPlan``), not
    with the config's own backend; each step on its execution's nodes.

    Raises:
        LayoutError, PlacementError, ModelSpecError: the run cannot be described at all.
    """
    from capacity.quantities import Verdict
    from capacity.report import format_table
    from plan import RunPlan

    values = {
        "hardware": hardware,
        "sft": sft_config,
        "grpo": grpo_config,
        "sft_execution": sft_execution,
        "grpo_execution": grpo_execution,
        "backend": backend,
        "megatron_layout": megatron_layout or {},
        "megatron_optim": megatron_optim or {},
    }
    run = RunPlan.resolve(values, {"layout_overrides": overrides or {}})
    plan, estimates = run_estimates(model, hardware_layout(run.machines), run)
    failing = next((e for e in estimates.values() if e.verdict is Verdict.DOES_NOT_FIT), None)
    verdicts = ", ".join(f"{step.upper()} {e.verdict.value}" for step, e in estimates.items())
    parts = [f"# Capacity check: {verdicts}", "", "## GRPO placement", "", "```", plan.render()]
    for step, result in estimates.items():
        parts += ["```", "", f"## {step.upper()}", "", "```", format_table(result)]
    return "\n".join([*parts, "```", ""]), failing
