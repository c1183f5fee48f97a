"""Megatron layout checks: every rule alone, several at once, the reference layouts."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capacity import LayoutError as PlannerLayoutError
from capacity import ModelSpecError, Verdict
from trainer.megatron.layout import (
    MEGATRON_LAYOUTS,
    LayoutError,
    MegatronLayout,
    conversion_layout,
    planner_layout,
    resolve_megatron_layout,
    validate_layout,
    verl_gpt_oss_layout,
)

# The architecture fields of openai/gpt-oss-20b and -120b that the rules read.
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "sliding_window": 128,
    "attention_bias": True,
    "tie_word_embeddings": False,
}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}


def _problems(layout: dict, config=GPT_OSS_20B, **kwargs) -> list[str]:
    with pytest.raises(LayoutError) as caught:
        validate_layout(config, MegatronLayout(**layout), **kwargs)
    return caught.value.problems


@pytest.mark.parametrize(
    ("layout", "fragments"),
    [
        # TP must divide the KV heads (8): 16 divides the 64 attention heads but not 8
        (
            {"tp": 16, "gpus_per_node": 16, "sequence_parallel": True},
            ["tp=16", "num_key_value_heads=8", "1, 2, 4, 8"],
        ),
        # PP must divide the layers (24)
        ({"pp": 5, "gpus_per_node": 5}, ["pp=5", "num_hidden_layers=24"]),
        # a virtual pipeline needs PP ≥ 2 ...
        ({"vpp": 2}, ["vpp=2", "pp ≥ 2"]),
        # ... vpp=1 too: Megatron-Core's initialize_model_parallel raises "pipeline-model-
        # parallel size should be greater than 1 with interleaved schedule" for any vpp
        ({"vpp": 1}, ["vpp=1", "pp ≥ 2"]),
        # ... and must divide the layers per stage (24 / 4 = 6)
        ({"pp": 4, "vpp": 4, "gpus_per_node": 4}, ["vpp=4", "6 layers per pipeline stage"]),
        # EP must divide the experts (32)
        ({"ep": 3, "gpus_per_node": 3}, ["ep=3", "num_local_experts=32"]),
        # ETP is 1 for GPT-OSS
        ({"etp": 2, "gpus_per_node": 2}, ["etp=2", "GPT-OSS needs etp=1"]),
        # world = TP × PP × CP × DP: 6 GPUs cannot hold TP 4
        ({"tp": 4, "gpus_per_node": 6}, ["world size 6", "tp × pp × cp = 4 × 1 × 1 = 4"]),
        # a given DP must be the one the world size implies (8 / 2 = 4, not 2)
        ({"tp": 2, "dp": 2, "gpus_per_node": 8, "sequence_parallel": True}, ["dp=2", "needs dp=4"]),
        # the expert grid: ETP × EP × PP = 8 × 2 = 16 does not divide 8 GPUs
        (
            {"ep": 8, "pp": 2, "gpus_per_node": 8},
            ["world size 8", "etp × ep × pp = 1 × 8 × 2 = 16"],
        ),
        # sequence parallelism needs TP > 1
        ({"sequence_parallel": True}, ["sequence_parallel=true needs tp > 1"]),
        # EP with TP needs sequence parallelism
        ({"tp": 2, "ep": 2, "gpus_per_node": 2}, ["ep=2 with tp=2", "sequence_parallel=true"]),
        # the rollout engines' TP must divide the heads ...
        ({"rollout_tp": 3, "gpus_per_node": 3}, ["rollout_tp=3", "num_attention_heads=64"]),
        # ... and the world size
        ({"rollout_tp": 4, "gpus_per_node": 2}, ["rollout_tp=4", "world size 2"]),
    ],
)
def test_each_rule_alone_names_its_field_and_numbers(layout, fragments):
    problems = _problems(layout)
    assert len(problems) == 1, problems
    for fragment in fragments:
        assert fragment in problems[0]


def test_tp_not_dividing_the_attention_heads_breaks_the_kv_head_rule_too():
    # KV heads divide the attention heads (GQA), so a TP that misses one misses both (and
    # 3 does not divide the vocabulary, 201088, either)
    heads, kv_heads, vocab = _problems({"tp": 3, "gpus_per_node": 3})
    assert "tp=3 does not divide vocab_size=201088" in vocab
    assert "tp=3 does not divide num_attention_heads=64" in heads
    assert "1, 2, 4, 8, 16, 32, 64" in heads
    assert "tp=3 does not divide num_key_value_heads=8" in kv_heads


def test_expert_grid_counts_etp_for_models_that_allow_it():
    mixtral = {**GPT_OSS_20B, "model_type": "mixtral", "num_local_experts": 8}
    layout = {"tp": 2, "ep": 4, "sequence_parallel": True, "gpus_per_node": 4}
    # ETP 2 × EP 4 × PP 1 = 8 does not divide 4 GPUs; ETP 1 does
    (problem,) = _problems({**layout, "etp": 2}, config=mixtral)
    assert "etp × ep × pp = 2 × 4 × 1 = 8" in problem
    checked = validate_layout(mixtral, MegatronLayout(**layout, etp=1))
    assert checked.expert_data_parallel == 1 and checked.layout.dp == 2


def test_training_a_moe_model_with_tp_needs_sequence_parallel():
    """Megatron-Core 0.19.2 trains a MoE layer split over TP only with sequence parallelism
    (moe_layer.py:629 raises in training mode); converting or exporting does not train."""
    layout = MegatronLayout(tp=2, gpus_per_node=2)  # EP 1: the EP rule does not fire
    assert validate_layout(GPT_OSS_20B, layout).layout.tp == 2  # convert / export: valid
    (problem,) = _problems(layout.model_dump(), training=True)
    assert "tp=2 on a MoE model needs sequence_parallel=true to train" in problem
    assert "moe_layer.py:629" in problem
    # with sequence parallelism, or on one TP rank, or on a dense model, it trains
    assert validate_layout(GPT_OSS_20B, layout.model_copy(update={"sequence_parallel": True}),
                           training=True).layout.sequence_parallel  # fmt: skip
    assert validate_layout(GPT_OSS_20B, MegatronLayout(), training=True).layout.tp == 1
    dense = {k: v for k, v in GPT_OSS_20B.items() if k != "num_local_experts"}
    dense["model_type"] = "llama"
    assert validate_layout(dense, layout, training=True).layout.tp == 2
    # EP > 1 with TP > 1: one problem, the grid rule's, not two saying the same
    (problem,) = _problems({"tp": 2, "ep": 2, "gpus_per_node": 2}, training=True)
    assert "ep=2 with tp=2" in problem
    # the verl layouts set sequence parallelism: they train
    assert validate_layout(GPT_OSS_20B, "verl-gpt-oss-8x8-h100", training=True).world_size == 64


def test_expert_parallel_on_a_dense_model_is_rejected():
    dense = {k: v for k, v in GPT_OSS_20B.items() if k != "num_local_experts"}
    dense["model_type"] = "llama"
    (problem,) = _problems({"ep": 2, "gpus_per_node": 2}, config=dense)
    assert "ep=2" in problem and "no experts" in problem


def test_a_layout_that_does_not_fit_gpu_memory_is_rejected_with_the_planner_table():
    # EP 8 on one node without offload: the planner puts one rank at ~72 GiB
    layout = MegatronLayout(ep=8, gpus_per_node=8)
    (problem,) = _problems(layout.model_dump(), gpu_memory_gib=40)
    assert "GPU memory" in problem and "gpu_memory_gib=40" in problem
    assert "resource / term" in problem  # the capacity planner's table is in the message
    # the same layout passes on GPUs large enough, and the estimate comes back
    checked = validate_layout(GPT_OSS_20B, layout, gpu_memory_gib=140.4)
    assert checked.estimate is not None
    assert checked.estimate.resource("training_gpu").total.expected < 140.4 * 2**30


def test_several_problems_are_reported_at_once():
    layout = {
        "tp": 3,  # heads, KV heads, vocabulary; EP with TP without SP
        "pp": 5,  # layers
        "ep": 6,  # experts
        "etp": 2,  # GPT-OSS
        "rollout_tp": 5,  # heads, world
        "gpus_per_node": 7,  # world not a multiple of tp × pp × cp, nor of etp × ep × pp
    }
    problems = _problems(layout, gpu_memory_gib=80)
    assert len(problems) == 11, problems
    joined = "\n".join(problems)
    for fragment in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers"):
        assert fragment in joined
    with pytest.raises(LayoutError) as caught:
        validate_layout(GPT_OSS_20B, MegatronLayout(**layout), gpu_memory_gib=80)
    assert "11 problem(s)" in str(caught.value)
    assert "GPU memory is checked once the rules above pass" in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, PlannerLayoutError)


def test_verl_reference_layout_fits_gpt_oss_20b():
    checked = validate_layout(GPT_OSS_20B, "verl-gpt-oss-8x8-h100")
    layout = checked.layout
    assert (layout.tp, layout.ep, layout.etp, layout.pp, layout.rollout_tp) == (8, 8, 1, 8, 4)
    assert checked.world_size == 64
    assert layout.dp == 1  # 64 / (TP 8 × PP 8 × CP 1)
    assert checked.expert_data_parallel == 1  # 64 / (ETP 1 × EP 8 × PP 8)
    assert checked.estimate is not None
    assert checked.estimate.resource("training_gpu").verdict is Verdict.FITS
    assert MEGATRON_LAYOUTS["verl-gpt-oss-8x8-h100"].gpu_memory_gib == pytest.approx(79.65)


def test_verl_reference_needs_pp_dividing_36_layers_for_gpt_oss_120b():
    (problem,) = _problems(MEGATRON_LAYOUTS["verl-gpt-oss-8x8-h100"].model_dump(), GPT_OSS_120B)
    assert "pp=8" in problem and "num_hidden_layers=36" in problem
    checked = validate_layout(GPT_OSS_120B, verl_gpt_oss_layout(nodes=4))
    assert checked.world_size == 32 and checked.layout.pp == 4 and checked.layout.dp == 1
    assert checked.estimate is not None
    assert checked.estimate.resource("training_gpu").verdict is not Verdict.DOES_NOT_FIT


def test_tiny_cpu_layout_is_valid_for_the_tiny_model_read_from_its_directory(tmp_path):
    # only config.json is read: no weights are in the directory at all
    (tmp_path / "config.json").write_text(
        json.dumps({**GPT_OSS_20B, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "num_local_experts": 4})
    )  # fmt: skip
    checked = validate_layout(tmp_path, "tiny-cpu")
    assert checked.world_size == 1 and checked.layout.dp == 1
    assert checked.layout.params_dtype == "fp32"
    assert checked.estimate is None  # no GPU memory given: nothing to check it against


def test_world_size_and_gpu_memory_arguments_override_the_layout():
    layout = MegatronLayout(tp=8, ep=8, sequence_parallel=True, gpus_per_node=8)
    assert validate_layout(GPT_OSS_20B, layout, world_size=16).layout.dp == 2
    dense_grid, expert_grid = _problems(layout.model_dump(), world_size=12)
    assert "world size 12 is not a multiple of tp × pp × cp" in dense_grid
    assert "world size 12 is not a multiple of etp × ep × pp" in expert_grid
    assert validate_layout(GPT_OSS_20B, layout, gpu_memory_gib=79.65).estimate is not None


def test_resolve_layout_from_preset_mapping_and_errors():
    layout = resolve_megatron_layout({"preset": "verl-gpt-oss-8x8-h100", "nodes": 4, "pp": 4})
    assert (layout.nodes, layout.pp, layout.tp) == (4, 4, 8)
    assert resolve_megatron_layout("tiny-cpu") == MEGATRON_LAYOUTS["tiny-cpu"]
    with pytest.raises(LayoutError, match="unknown Megatron layout 'nope'"):
        resolve_megatron_layout("nope")
    with pytest.raises(LayoutError, match="tensor_parallel"):
        resolve_megatron_layout({"tensor_parallel": 2})  # Megatron's name, not the field
    with pytest.raises(LayoutError, match="tp"):
        resolve_megatron_layout({"tp": 0})
    with pytest.raises(LayoutError, match="come from the Megatron layout"):
        resolve_megatron_layout({"planner": {"tensor_parallel": 2}})
    with pytest.raises(LayoutError, match="unknown planner Layout field"):
        resolve_megatron_layout({"planner": {"no_such_field": 1}})


def test_megatron_kwargs_use_megatron_core_names():
    kwargs = MEGATRON_LAYOUTS["verl-gpt-oss-8x8-h100"].megatron_kwargs()
    assert kwargs == {
        "tensor_model_parallel_size": 8,
        "pipeline_model_parallel_size": 8,
        "virtual_pipeline_model_parallel_size": None,
        "expert_model_parallel_size": 8,
        "expert_tensor_parallel_size": 1,
        "context_parallel_size": 1,
        "sequence_parallel": True,
    }


def test_unreadable_config_is_a_model_spec_error(tmp_path):
    with pytest.raises(ModelSpecError, match="no config.json"):
        validate_layout(tmp_path, "tiny-cpu")
    with pytest.raises(ModelSpecError, match="num_hidden_layers"):
        validate_layout({"num_attention_heads": 4}, "tiny-cpu")


def _violations(tp, pp, ep, cp, sp, world) -> int:
    """An independent count of the rules a layout breaks on gpt-oss-20b (rollout_tp 1)."""
    return sum(
        [
            201088 % tp != 0,
            64 % tp != 0,
            8 % tp != 0,
            24 % pp != 0,
            32 % ep != 0,
            world % (tp * pp * cp) != 0,
            world % (ep * pp) != 0,
            sp and tp == 1,
            ep > 1 and tp > 1 and not sp,
        ]
    )


@settings(max_examples=300, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 3, 4, 8, 16]),
    pp=st.sampled_from([1, 2, 3, 5, 8]),
    ep=st.sampled_from([1, 2, 3, 4, 8, 64]),
    cp=st.sampled_from([1, 2]),
    sp=st.booleans(),
    world=st.integers(1, 128),
)
def test_valid_exactly_when_no_rule_is_broken(tp, pp, ep, cp, sp, world):
    layout = MegatronLayout(tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=sp)
    expected = _violations(tp, pp, ep, cp, sp, world)
    try:
        checked = validate_layout(GPT_OSS_20B, layout, world_size=world)
    except LayoutError as error:
        assert len(error.problems) == expected, error.problems
    else:
        assert expected == 0
        assert checked.layout.dp * tp * pp * cp == world


def test_planner_fields_are_typed_as_the_planners_layout():
    verl = MEGATRON_LAYOUTS["verl-gpt-oss-8x8-h100"]
    assert verl.planner.micro_train_batch_size == 1
    assert verl.planner.attn_implementation == "flash"
    assert verl.planner.model_fields_set >= {"adam_offload", "ref_offload"}
    # a value the planner refuses is refused where the layout is read, naming the field
    with pytest.raises(LayoutError, match="planner.micro_train_batch_size"):
        resolve_megatron_layout({"planner": {"micro_train_batch_size": 0}})
    with pytest.raises(LayoutError, match="planner.attn_implementation"):
        resolve_megatron_layout({"planner": {"attn_implementation": "sdpa"}})
    # only the fields given reach the planner; the others keep its defaults
    layout = resolve_megatron_layout({"planner": {"prompt_max_len": 512}})
    assert layout.planner.model_fields_set == {"prompt_max_len"}
    planned = planner_layout(layout, world=1, gpu_memory_gib=80.0)
    assert (planned.prompt_max_len, planned.generate_max_len) == (512, 1024)


@pytest.mark.parametrize("preset", sorted(MEGATRON_LAYOUTS))
def test_every_layout_converts_at_the_one_process_the_convert_step_is(preset):
    """Issue #39: the convert step is one process; each preset's conversion layout is
    nothing split, in the preset's dtype, and valid for gpt-oss-20b at world size 1 (where
    the preset itself, TP 8 / EP 8, is not)."""
    layout = MEGATRON_LAYOUTS[preset]
    converted = conversion_layout({"preset": preset})
    assert (converted.tp, converted.pp, converted.ep, converted.etp, converted.cp) == (1,) * 5
    assert converted.vpp is None and not converted.sequence_parallel
    assert (converted.params_dtype, converted.name) == (layout.params_dtype, layout.name)
    checked = validate_layout(GPT_OSS_20B, converted, world_size=1)
    assert (checked.world_size, checked.layout.dp, checked.expert_data_parallel) == (1, 1, 1)
    if layout.tp * layout.pp > 1:
        with pytest.raises(LayoutError, match="world size 1 is not a multiple"):
            validate_layout(GPT_OSS_20B, layout, world_size=1)
