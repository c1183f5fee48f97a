"""The capacity check estimates the run as configured: SFT/GRPO configs and the GRPO
placement plan decide processes, lengths, batch and engines; the preset's hardware the machines."""

from __future__ import annotations

import pytest
from tests_helpers_trainer import VERL_COLOCATED_OVERRIDES

from capacity import LayoutDoesNotFit, LayoutError, Verdict, estimate
from pipelines.overrides import apply_overrides
from pipelines.preset_capacity import capacity_layout, grpo_plan, run_estimates
from pipelines.presets import PRESETS, config_dict, step_configs, step_execution
from trainer.capacity_check import check_run, grpo_layout, sft_layout


def _estimates(preset, model="gpt-oss-20b", overrides=None):
    return run_estimates(preset, model, overrides=overrides)


def _rank_bytes(estimate) -> float:
    return next(r for r in estimate.resources if r.key == "training_gpu").total.expected


def test_gpt_oss_20b_checks_the_grpo_it_runs():
    """256 new tokens (not the layout preset's 1,024), 32 prompts × 8, 16 training GPUs, two
    dedicated engines of TP 4 on nodes 4-5."""
    preset = PRESETS["gpt-oss-20b"]
    layout = grpo_layout(capacity_layout(preset), preset.grpo, grpo_plan(preset))
    assert (layout.generate_max_len, layout.prompt_max_len) == (256, 1024)
    assert (layout.rollout_batch_size, layout.n_samples_per_prompt) == (32, 8)
    assert (layout.nodes, layout.training_gpus, layout.rollout_gpus, layout.hybrid) == (
        6, 16, 8, False
    )  # fmt: skip
    assert (layout.zero_stage, layout.adam_offload, layout.kl) == (3, True, True)
    assert layout.vllm_gpu_memory_utilization == 0.85 and layout.gpu_memory_gib == 22.49


def test_lora_grpo_is_estimated_as_an_adapter_and_its_merge_on_rank_0():
    """``grpo.lora``: the planner counts the adapter's gradients and optimizer state, not the
    whole model's, and rank 0's host the merge (the model whole and its reload)."""
    from trainer.sft.config import LoraSettings

    preset = PRESETS["gpt-oss-20b"]
    lora = preset.grpo.model_copy(update={"lora": LoraSettings(r=8, alpha=16, experts=True)})
    full = grpo_layout(capacity_layout(preset), preset.grpo, grpo_plan(preset))
    adapted = grpo_layout(capacity_layout(preset), lora, grpo_plan(preset))
    assert (full.lora_rank, full.final_model_on_rank0) == (0, False)
    assert (adapted.lora_rank, adapted.lora_experts, adapted.final_model_on_rank0) == (
        8, True, True
    )  # fmt: skip
    assert _rank_bytes(estimate("gpt-oss-20b", adapted)) < _rank_bytes(
        estimate("gpt-oss-20b", full)
    )


def test_verl_checks_one_training_node_and_one_engine_node_not_the_two_node_ep16_layout():
    preset = PRESETS["gpt-oss-20b-verl"]
    layout = grpo_layout(capacity_layout(preset), preset.grpo, grpo_plan(preset))
    assert (layout.nodes, layout.gpus_per_node, layout.training_gpus) == (2, 8, 8)
    assert (layout.backend, layout.expert_parallel, layout.hybrid) == ("deepspeed", 1, False)
    assert (layout.rollout_gpus, layout.vllm_tensor_parallel_size) == (8, 4)
    assert layout.n_samples_per_prompt == 16
    # colocated (verl's hybrid engine): the engines share the one node's training GPUs
    hybrid = apply_overrides(preset, VERL_COLOCATED_OVERRIDES)
    layout = grpo_layout(capacity_layout(hybrid), hybrid.grpo, grpo_plan(hybrid))
    assert (layout.nodes, layout.training_gpus, layout.hybrid) == (1, 8, True)
    assert (layout.rollout_gpus, layout.vllm_tensor_parallel_size) == (8, 4)


def test_verl_megatron_with_dedicated_engines_is_checked_as_it_runs():
    """Megatron TP 8 / EP 8 on one node of 8 H200 and two vLLM engines of TP 4 on a second:
    the capacity check (as the pipeline runs it, from the step configs and executions)
    estimates 8 Megatron training ranks and 8 rollout GPUs on a 2-node job, and it fits."""
    from tests_helpers_trainer import VERL_MEGATRON_OVERRIDES

    preset = apply_overrides(PRESETS["gpt-oss-20b-verl"], VERL_MEGATRON_OVERRIDES)
    plan = grpo_plan(preset)
    layout = grpo_layout(capacity_layout(preset), preset.grpo, plan)
    assert (layout.backend, layout.tensor_parallel, layout.expert_parallel) == ("megatron", 8, 8)
    assert (layout.nodes, layout.gpus_per_node, layout.training_gpus) == (2, 8, 8)
    assert (layout.rollout_gpus, layout.vllm_tensor_parallel_size, layout.hybrid) == (8, 4, False)
    args = _check_args(preset)
    assert args[-1]["job"]["nodes"] == 2  # the training node, then the engines' node
    text, failing = check_run("gpt-oss-20b", *args)
    assert failing is None, text
    assert "8 training processes (TP 8 × PP 1 × DP 1, EP 8)" in text
    assert "engine 1: ranks 12-15 on node 1 gpus 4,5,6,7" in text
    assert "Megatron TP=8 PP=1 EP=8" in text and "2 vLLM engines TP=4" in text


def _check_args(preset) -> tuple:
    return (
        config_dict(preset.hardware),
        config_dict(preset.sft),
        config_dict(preset.grpo),
        config_dict(step_execution(preset, "sft")),
        config_dict(step_execution(preset, "grpo")),
    )


def test_the_megatron_branch_is_checked_as_that_branch_runs():
    """The pipeline's ``backend`` parameter picks the GRPO branch; its capacity check
    estimated the config's own backend (DeepSpeed ZeRO-3 for gpt-oss-20b-verl) whichever
    branch ran. With ``backend="megatron"`` and the branch's layout it estimates Megatron-Core
    (TP 8 / EP 8), and a config the Megatron branch cannot run stops here, before SFT."""
    from tests_helpers_trainer import VERL_MEGATRON_OVERRIDES

    from pipelines.presets import megatron_layout

    verl = PRESETS["gpt-oss-20b-verl"]
    hardware, sft, grpo, sft_execution, grpo_execution = _check_args(verl)
    text, failing = check_run("gpt-oss-20b", hardware, sft, grpo, sft_execution, grpo_execution)
    assert failing is None and "DeepSpeed ZeRO-3" in text  # the hf branch: the config's own
    # the config as the Megatron branch runs it: DeepSpeed's optimizer offload has no meaning
    # there; refused where the pipeline starts, not in the GRPO step after SFT
    with pytest.raises(ValueError, match="optim.offload_optimizer"):
        check_run(
            "gpt-oss-20b", hardware, sft, grpo, sft_execution, grpo_execution, None,
            "megatron", megatron_layout(verl),
        )  # fmt: skip
    # with the preset's own optim block for that branch (the pipeline's megatron_optim) it fits
    text, failing = check_run(
        "gpt-oss-20b", hardware, sft, grpo, sft_execution, grpo_execution, None,
        "megatron", megatron_layout(verl), verl.megatron_optim,
    )  # fmt: skip
    assert failing is None and "Megatron TP=8 PP=1 EP=8" in text
    # a Megatron-ready config (no DeepSpeed fields) whose optim.backend is still DeepSpeed's
    ready = apply_overrides(verl, VERL_MEGATRON_OVERRIDES)
    grpo = config_dict(ready.grpo)
    grpo["optim"] = {"backend": "deepspeed", "learning_rate": 5e-7}
    grpo_execution = config_dict(step_execution(ready, "grpo"))
    args = ("gpt-oss-20b", hardware, sft, grpo, sft_execution, grpo_execution, None)
    text, failing = check_run(*args, "hf")
    assert failing is None and "Megatron" not in text
    text, failing = check_run(*args, "megatron", megatron_layout(ready))
    assert failing is None
    assert "Megatron TP=8 PP=1 EP=8" in text and "2 vLLM engines TP=4" in text


def test_changing_max_new_tokens_or_the_layout_changes_the_estimate():
    preset = PRESETS["gpt-oss-20b"]
    _, base = _estimates(preset)
    longer = apply_overrides(preset, {"grpo.rollout.max_new_tokens": "2048"})
    _, long_estimate = _estimates(longer)
    assert long_estimate["grpo"].layout.generate_max_len == 2048
    assert _rank_bytes(long_estimate["grpo"]) > _rank_bytes(base["grpo"])
    # another layout: 8 training processes (2 nodes) instead of 16 hold twice the shard
    fewer = apply_overrides(
        preset,
        {"grpo.nproc": "8", "hardware.grpo_nodes": "2", "grpo.prompts_per_step": "16"},
    )
    plan, fewer_estimate = _estimates(fewer)
    assert plan.nodes == 4 and fewer_estimate["grpo"].layout.training_gpus == 8
    assert _rank_bytes(fewer_estimate["grpo"]) > _rank_bytes(base["grpo"])
    # hybrid: the same GRPO colocated, engines on the training GPUs
    hybrid = apply_overrides(
        preset,
        {
            "grpo.rollout.colocate": "true",
            "grpo.rollout.num_engines": "0",
            "grpo.rollout.async_steps": "0",  # colocated: nothing to overlap with
        },
    )
    plan, hybrid_estimate = _estimates(hybrid)
    assert (plan.nodes, len(plan.engines)) == (4, 4)
    assert (
        hybrid_estimate["grpo"].layout.hybrid and hybrid_estimate["grpo"].layout.rollout_gpus == 16
    )


def test_sft_is_checked_as_configured():
    preset = PRESETS["gpt-oss-20b"]
    cluster = preset.hardware.cluster("sft", preset.sft.nproc)
    layout = sft_layout(capacity_layout(preset), preset.sft, *cluster)
    assert (layout.nodes, layout.training_gpus, layout.rollout_gpus) == (2, 8, 0)
    assert (layout.lora_rank, layout.lora_experts, layout.sequence_length) == (8, True, 2049)
    assert layout.micro_train_batch_size == preset.sft.micro_batch_size


def test_every_preset_fits_its_check():
    for name, preset in PRESETS.items():
        model = "tiny-gpt-oss" if name == "tiny-cpu" else "gpt-oss-20b"
        _, estimates = _estimates(preset, model)
        assert all(e.verdict is not Verdict.DOES_NOT_FIT for e in estimates.values()), name


def test_check_run_reports_the_plan_and_both_steps_and_names_what_does_not_fit():
    preset = PRESETS["tiny-cpu"]
    hardware, *args = _check_args(preset)
    text, failing = check_run("tiny-gpt-oss", hardware, *args)
    assert failing is None
    assert "## GRPO placement" in text and "## SFT" in text and "## GRPO\n" in text
    text, failing = check_run("tiny-gpt-oss", hardware, *args, {"host_memory_gib": "2.5"})
    assert failing is not None
    with pytest.raises(LayoutDoesNotFit, match="does not fit"):
        raise LayoutDoesNotFit(failing, text)
    with pytest.raises(LayoutError, match="rollout_gpus"):
        vllm = apply_overrides(preset, {"grpo.rollout.engine": "vllm"})
        grpo_layout("tiny-cpu", vllm.grpo, grpo_plan(vllm))


def test_a_volume_too_small_for_the_checkpoints_fails_the_check_with_the_table():
    """The storage half of the local run's fail-fast path (the end-to-end run of it,
    tests/pipelines/test_local_run.py::test_capacity_check_fails_fast_with_the_table, is
    ``slow``): 100 KiB for the checkpoints does not fit, and the error carries the tables."""
    hardware, *args = _check_args(PRESETS["tiny-cpu"])
    text, failing = check_run("tiny-gpt-oss", {**hardware, "storage_gib": 0.0001}, *args)
    assert failing is not None
    error = str(LayoutDoesNotFit(failing, text))
    assert "storage / checkpoint volume does not fit" in error.splitlines()[0]
    assert "# Capacity check: SFT does not fit" in error and "## GRPO placement" in error


def test_the_planner_counts_the_attention_kernel_the_trainer_runs():
    """Issue #39: on the H200 node (a GPU with a fused kernel with sinks) the planner counted
    fused attention for the HF trainer, which runs eager attention (``core.attention``): the
    DeepSpeed steps are now estimated with eager's ``S×S`` probabilities, and Megatron's
    (Transformer Engine's fused attention with sinks) keeps the fused kernel's terms."""
    from tests_helpers_trainer import VERL_MEGATRON_OVERRIDES

    from core.attention import HF_ATTN_IMPLEMENTATION

    verl = PRESETS["gpt-oss-20b-verl"]
    assert capacity_layout(verl).attn_implementation == "flash"  # what the H200 offers
    grpo = grpo_layout(capacity_layout(verl), verl.grpo, grpo_plan(verl))
    sft = sft_layout(capacity_layout(verl), verl.sft, 1, 8)
    assert grpo.attn_implementation == sft.attn_implementation == HF_ATTN_IMPLEMENTATION
    assert HF_ATTN_IMPLEMENTATION == "eager"
    megatron = apply_overrides(verl, VERL_MEGATRON_OVERRIDES)
    layout = grpo_layout(capacity_layout(megatron), megatron.grpo, grpo_plan(megatron))
    assert layout.attn_implementation == "flash"
    # the A10G has no fused kernel with sinks: eager whatever the backend
    g5 = PRESETS["gpt-oss-20b"]
    assert grpo_layout(capacity_layout(g5), g5.grpo, grpo_plan(g5)).attn_implementation == "eager"
    # the estimate says which kernel it counted, and eager's probabilities cost more
    text, failing = check_run("gpt-oss-20b", *_check_args(verl))
    assert failing is None and "bf16, eager attention, micro-batch 1 × 1280 tokens" in text
    fused = grpo_layout(
        capacity_layout(verl), verl.grpo, grpo_plan(verl), {"attn_implementation": "flash"}
    )
    counted = {
        kernel: _rank_bytes(estimate("gpt-oss-20b", layout))
        for kernel, layout in (("eager", grpo), ("flash", fused))
    }
    assert counted["eager"] > counted["flash"]


def test_the_lora_preset_fits_one_node_and_full_grpo_there_would_hold_the_bases_optimizer():
    """gpt-oss-20b-lora: SFT and GRPO on one 8-GPU node (colocated engines, no second node).
    A rank holds the frozen base whole (ZeRO-2) and the adapter's gradients and optimizer
    states, and its KL reference is that base with the adapter off; the same preset with
    ``grpo.lora.r=0`` adds the base's gradients, its 16 B/param optimizer states (1/8 a rank)
    and a reference copy, and is no longer a plain fit (on 80 GB GPUs: does not fit)."""
    from capacity.model_spec import count_lora_parameters, count_parameters, load_model_spec
    from capacity.quantities import GIB

    preset = PRESETS["gpt-oss-20b-lora"]
    assert preset.hardware.job_nodes("grpo", preset.grpo.rollout_processes) == 1
    assert preset.hardware.job_nodes("sft") == 1
    plan, estimates = _estimates(preset)
    assert not plan.rollout_only_ranks and len(plan.training_ranks) == 8
    lora = estimates["grpo"]
    assert lora.verdict is Verdict.FITS and estimates["sft"].verdict is Verdict.FITS
    spec = load_model_spec("gpt-oss-20b")
    total = count_parameters(spec).total
    adapter = count_lora_parameters(spec, 16, experts=True)
    assert lora.trainable_parameters == adapter
    gpu = lora.resource("training_gpu")
    terms = {t.key: t.bytes.expected for t in gpu.terms}
    assert terms["weights"] == 2 * total  # the frozen base, whole on every GPU
    assert terms["adapter"] == 2 * adapter
    assert terms["optimizer"] == 16 * adapter / 8  # the adapter's Adam states, ZeRO-2
    assert terms["gradients"] == 2 * adapter / 8
    assert "reference" not in terms  # KL on: the base with the adapter off, no copy
    assert "the KL reference is the base with the adapter off" in gpu.detail

    full = _estimates(apply_overrides(preset, {"grpo.lora.r": "0"}))[1]["grpo"]
    full_terms = {t.key: t.bytes.expected for t in full.resource("training_gpu").terms}
    assert full_terms["optimizer"] == 16 * total / 8 and full_terms["gradients"] == 2 * total / 8
    grown = _rank_bytes(full) - _rank_bytes(lora)
    assert grown > (16 + 2) * (total - adapter) / 8  # plus fragmentation on them
    assert full.verdict is not Verdict.FITS
    assert f"{_rank_bytes(full) / GIB:.1f} GiB expected a rank (tight)" in gpu.detail

    # on one p5.48xlarge (8x H100 80 GB, 79.65 GiB reported) LoRA still fits, full GRPO does not
    h100 = apply_overrides(preset, {"hardware.node_type": "p5.48xlarge"})
    lora_h100 = _estimates(h100)[1]
    assert lora_h100["grpo"].verdict is Verdict.FITS and lora_h100["sft"].verdict is Verdict.FITS
    assert lora_h100["grpo"].resource("training_gpu").capacity == pytest.approx(79.65 * GIB)
    full_h100 = _estimates(apply_overrides(h100, {"grpo.lora.r": "0"}))[1]
    assert full_h100["grpo"].verdict is Verdict.DOES_NOT_FIT


def test_the_capacity_check_task_reads_numbers_as_kfp_passes_them():
    """KFP hands a dict parameter's numbers back as floats (``nproc`` 1.0): the demo's
    capacity-check task failed on them ('float' object cannot be interpreted as an integer)."""
    import json

    configs = step_configs(PRESETS["tiny-cpu"])

    def floats(value):
        return json.loads(json.dumps(value), parse_int=float)

    args = [floats(configs[k]) for k in ("hardware", "sft", "grpo")]
    executions = [floats(configs[k]) for k in ("sft_execution", "grpo_execution")]
    layout = floats(configs["megatron_layout"])
    text, failing = check_run("tiny-gpt-oss", *args, *executions, {}, "hf", layout)
    assert failing is None and "GRPO placement" in text
