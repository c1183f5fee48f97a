"""A preset states its machines once (``Preset.hardware``); the platform, each step's
PyTorchJob, the GRPO placement plan, the capacity check's layouts and the Megatron layout are
derived from it and agree."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from tests_helpers_trainer import VERL_MEGATRON_OVERRIDES

from capacity.layouts import Layout
from cluster.hardware import Hardware
from cluster.nodes import NODE_TYPES
from pipelines.overrides import apply_overrides
from pipelines.platform import get_platform
from pipelines.preset_capacity import capacity_layout, grpo_plan
from pipelines.presets import PRESETS, Preset, megatron_layout, step_execution
from trainer.capacity_check import grpo_layout, sft_layout
from trainer.megatron.layout import resolve_megatron_layout


@pytest.mark.parametrize("field", ["layout", "platform", "sft_execution", "grpo_execution"])
def test_the_old_separate_hardware_fields_are_gone(field):
    with pytest.raises(ValidationError, match=field):
        Preset.model_validate({"name": "x", "description": "", field: {}})


@pytest.mark.parametrize(
    ("update", "named"),
    [
        ({"layout_overrides": {"gpu_memory_gib": "80"}}, "gpu_memory_gib"),
        ({"layout_overrides": {"nodes": "2"}}, "nodes"),
        ({"megatron_layout": {"preset": "tiny-cpu", "nodes": 2}}, "nodes"),
        ({"megatron_layout": {"preset": "tiny-cpu", "gpu_memory_gib": 139.8}}, "gpu_memory_gib"),
    ],
)
def test_a_preset_cannot_restate_its_hardware(update, named):
    data = {**PRESETS["gpt-oss-20b"].model_dump(), **update}
    with pytest.raises(ValidationError, match=f"{named}: the machines are stated once"):
        Preset.model_validate(data)


def test_a_cluster_steps_processes_are_derived_from_its_hardware():
    cluster = Hardware(node_type="g5.12xlarge", sft_nodes=3, grpo_nodes=2)
    preset = Preset(name="x", description="", hardware=cluster)
    assert (preset.sft.nproc, preset.grpo.nproc) == (3 * 4, 2 * 4)
    with pytest.raises(ValidationError, match="grpo with nproc=12 .from hardware.: .*mini_batch"):
        Preset(name="x", description="", hardware=cluster.model_copy(update={"grpo_nodes": 3}))
    # the cluster presets state no nproc: a change of nodes changes the processes
    assert "nproc" not in PRESETS["gpt-oss-20b"].grpo.model_fields_set
    fewer = apply_overrides(PRESETS["gpt-oss-20b"], {"hardware.grpo_nodes": "2"})
    assert (fewer.sft.nproc, fewer.grpo.nproc) == (8, 2 * 4)
    assert fewer.hardware.job_nodes("grpo", fewer.grpo.rollout_processes) == 2 + 2
    # a local run states its processes (nothing to derive them from) and keeps them
    local = apply_overrides(
        PRESETS["tiny-cpu"], {"sft.nproc": "2", "sft.optim.backend": "deepspeed"}
    )
    assert apply_overrides(local, {"grpo.max_steps": "3"}).sft.nproc == 2


def test_processes_stated_against_the_hardware_are_refused():
    with pytest.raises(ValidationError, match="grpo.nproc=16 but hardware gives grpo 2"):
        apply_overrides(PRESETS["gpt-oss-20b"], {"hardware.grpo_nodes": "2", "grpo.nproc": "16"})
    with pytest.raises(ValidationError, match="leave sft.nproc out"):
        Preset(
            name="x",
            description="",
            sft=PRESETS["gpt-oss-20b"].sft.model_copy(update={"nproc": 4}),
            hardware=Hardware(node_type="g5.12xlarge", sft_nodes=2),
        )
    with pytest.raises(ValidationError, match="unknown node_type"):
        Hardware(node_type="g6.xlarge")
    with pytest.raises(ValidationError, match="one machine"):
        Hardware(sft_nodes=2)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_derives_one_cluster(name):
    preset = Preset.model_validate(PRESETS[name].model_dump())  # its validators, run again
    hardware = preset.hardware
    node = NODE_TYPES[hardware.node_type]
    plan = grpo_plan(preset)
    rollout = {"sft": 0, "grpo": preset.grpo.rollout_processes}
    for step, config in (("sft", preset.sft), ("grpo", preset.grpo)):
        nodes, per_node = hardware.cluster(step, config.nproc)
        execution = step_execution(preset, step)
        assert execution.cluster(config.nproc, rollout[step]) == (nodes, per_node), step
        if execution.mode == "job":  # the job the step launches
            job = execution.cluster_job(default_image="i", default_namespace="n")
            assert job.gpus_per_node == node.gpus, step
            # the job runs the training processes and the dedicated engines' (as step_job checks)
            assert job.world_size == config.nproc + rollout[step], step
            if step == "grpo":
                assert job.nodes == plan.nodes
            assert job.node_selector["node.kubernetes.io/instance-type"] == node.name
    # the placement plan: training on the GRPO job's first nodes, engines after them
    grpo_nodes, per_node = hardware.cluster("grpo", preset.grpo.nproc)
    assert plan.gpus_per_node == per_node
    assert {p.device.node for p in plan.processes if "train" in p.roles} <= set(range(grpo_nodes))
    # the capacity check's layouts: the plan's GRPO, the SFT job, the node type's memory
    machines = capacity_layout(preset)
    grpo = grpo_layout(machines, preset.grpo, plan)
    assert (grpo.nodes, grpo.gpus_per_node, grpo.training_gpus) == (
        plan.nodes, plan.gpus_per_node, len(plan.training_ranks)
    )  # fmt: skip
    sft = sft_layout(machines, preset.sft, *hardware.cluster("sft", preset.sft.nproc))
    assert sft.nodes * sft.gpus_per_node >= sft.training_gpus == preset.sft.nproc
    for layout in (grpo, sft):
        assert layout.device == node.device
        assert layout.host_memory_gib == node.host_memory_gib
        assert layout.storage_gib == hardware.storage_gib
        if node.gpu_memory_gib:
            assert layout.gpu_memory_gib == node.gpu_memory_gib
    # the Megatron layout runs on the GRPO job's machines
    megatron = resolve_megatron_layout(megatron_layout(preset))
    assert (megatron.nodes, megatron.gpus_per_node) == (grpo_nodes, per_node)
    assert megatron.gpu_memory_gib == node.gpu_memory_gib
    # the platform schedules its GPU steps on the same node type
    platform = get_platform(hardware.platform)
    if node.gpu_product:
        assert platform.gpu.accelerator_count == node.gpus
        assert platform.gpu.node_selector["nvidia.com/gpu.product"] == node.gpu_product
        assert platform.training_jobs
    else:
        assert not platform.gpu_steps


def test_hardware_overrides_reach_every_derived_setting():
    preset = apply_overrides(
        PRESETS["gpt-oss-20b"], {"hardware.grpo_nodes": "2", "grpo.nproc": "8"}
    )
    # 2 training nodes, then the 2 nodes of the 2 dedicated engines (TP 4)
    assert step_execution(preset, "grpo").job["nodes"] == grpo_plan(preset).nodes == 4
    assert megatron_layout(preset)["nodes"] == 2


def test_the_gpt_oss_20b_grpo_job_holds_its_engines():
    """16 training processes on 4 g5.12xlarge nodes and 2 vLLM engines of TP 4 on 2 more:
    the PyTorchJob is 6 nodes (24 processes), as ``step_job`` counts them."""
    preset = PRESETS["gpt-oss-20b"]
    assert (preset.grpo.nproc, preset.grpo.rollout_processes) == (16, 8)
    execution = step_execution(preset, "grpo")
    assert execution.cluster_job("i", "n").world_size == 24
    assert execution.cluster(16, 8) == (4, 4)
    with pytest.raises(ValueError, match="no node for training"):
        execution.cluster(16, 40)


# each planner layout preset: the node type and how many of its nodes it describes
LAYOUT_MACHINES = {
    "g5.12xlarge-x6-openrlhf": ("g5.12xlarge", 6),
    "g5.12xlarge-x6-openrlhf-12train": ("g5.12xlarge", 6),
    "g5.12xlarge-x6-openrlhf-hybrid": ("g5.12xlarge", 6),
    "p5en.48xlarge-x2-megatron": ("p5en.48xlarge", 2),
    "tiny-cpu": ("local", 1),
}


@pytest.mark.parametrize("layout", sorted(LAYOUT_MACHINES))
def test_the_planners_layouts_take_their_machines_from_the_node_types(layout):
    from capacity.layouts import LAYOUT_PRESETS, node_fields

    node_type, nodes = LAYOUT_MACHINES[layout]
    node, preset = NODE_TYPES[node_type], LAYOUT_PRESETS[layout]
    assert (preset.nodes, preset.gpus_per_node) == (nodes, node.gpus)
    assert (preset.host_memory_gib, preset.host_reserved_gib) == (
        node.host_memory_gib,
        node.host_reserved_gib,
    )
    assert preset.gpu_memory_gib == (node.gpu_memory_gib or Layout().gpu_memory_gib)
    assert preset.attn_implementation == ("flash" if node.flash_attention else "eager")
    # node_fields (which the capacity check uses for a preset's hardware) gives these fields
    assert node_fields(node_type, nodes).items() <= preset.model_dump().items()


def test_a_derived_nproc_is_given_before_the_step_configs_check_their_sizes():
    # the GRPO config checks its Megatron layout's world (8) against nproc: it must see the
    # node's 8 processes, not the default 1
    megatron = apply_overrides(PRESETS["gpt-oss-20b-verl"], VERL_MEGATRON_OVERRIDES)
    assert megatron.grpo.nproc == 8 and "nproc" not in megatron.grpo.model_fields_set
    # and it stays derived: a later change of nodes changes it again
    assert apply_overrides(megatron, {"hardware.sft_nodes": "2"}).sft.nproc == 16


def test_every_planner_layout_preset_is_checked_against_its_node_type():
    from capacity.layouts import LAYOUT_PRESETS

    assert set(LAYOUT_MACHINES) == set(LAYOUT_PRESETS)
