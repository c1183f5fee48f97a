"""``RunPlan.resolve``: the shape of a run from a preset's values, equal to what each layer
derives today on its own (the GRPO step's branch config, placement, the machines' jobs), for
every preset, every branch it compiles and both forms the values come in."""

import pytest
from tests_helpers_trainer import VERL_MEGATRON_OVERRIDES

from cluster.jobs import AUTO
from components.config_fields import config_dict
from pipelines.overrides import apply_overrides
from pipelines.presets import PRESETS, grpo_branch_config, megatron_layout, step_configs
from plan import RunPlan, RunPlanError, UnknownSpecError, trainer_spec
from trainer.grpo.config import GRPOConfig
from trainer.placement import grpo_placement, grpo_rollout_engines

CASES = [
    (name, branch, form)
    for name, preset in PRESETS.items()
    for branch in preset.grpo_branches
    for form in ("dump", "step_configs")
]


def _values(preset, form):
    return preset.model_dump(mode="json") if form == "dump" else step_configs(preset)


@pytest.mark.parametrize(("name", "branch", "form"), CASES)
def test_the_plan_is_what_each_layer_derives(name, branch, form):
    preset = PRESETS[name]
    plan = RunPlan.resolve(_values(preset, form), {"backend": branch})
    grpo = grpo_branch_config(preset, branch)  # the GRPO step's config, as it builds it
    assert plan.branch == branch
    assert GRPOConfig.model_validate(plan.grpo_config) == grpo
    assert plan.trainer == trainer_spec(grpo.optim.backend) == grpo.optim.trainer
    assert plan.engine.name == grpo.rollout.engine
    placement = grpo_placement(grpo, *preset.hardware.cluster("grpo", grpo.nproc))
    assert plan.grpo.sizes.for_world(grpo.nproc) == placement.sizes
    assert plan.grpo.rollout == grpo_rollout_engines(grpo)
    assert plan.grpo.rollout_processes == grpo.rollout_processes
    assert plan.grpo.job_nodes == placement.nodes
    assert (plan.grpo.nodes, plan.grpo.gpus_per_node) == preset.hardware.cluster("grpo", grpo.nproc)
    assert (plan.sft.nodes, plan.sft.gpus_per_node) == preset.hardware.cluster(
        "sft", preset.sft.nproc
    )
    assert plan.sft.trainer == preset.sft.optim.trainer
    assert plan.sft.rollout is None and plan.sft.training_processes == preset.sft.nproc
    assert dict(plan.megatron_layout) == megatron_layout(preset)
    assert plan.job_api == preset.cluster.job_api
    if not preset.hardware.local:  # the job the step starts: training, then engine nodes
        assert plan.grpo.job_nodes == preset.hardware.job_nodes("grpo", grpo.rollout_processes)


def test_a_megatron_branch_is_split_as_its_layout_says():
    """gpt-oss-20b-verl's Megatron branch: verl's TP 8 / EP 8 on its one training node, the
    two dedicated vLLM engines (TP 4) on the next."""
    values = PRESETS["gpt-oss-20b-verl"].model_dump(mode="json")
    plan = RunPlan.resolve(values, {"backend": "megatron"})
    assert plan.trainer.model_parallel and plan.trainer.needs_conversion
    assert (plan.grpo.sizes.tp, plan.grpo.sizes.ep, plan.grpo.sizes.pp) == (8, 8, 1)
    assert plan.grpo.sizes.for_world(plan.grpo.training_processes).dp == 1
    assert (plan.grpo.rollout.tp, plan.grpo.rollout.dedicated) == (4, 2)
    assert (plan.grpo.nodes, plan.grpo.job_nodes) == (1, 2)
    hf = RunPlan.resolve(values)
    assert hf.branch == "hf" and not hf.trainer.model_parallel
    assert hf.grpo.sizes.for_world(hf.grpo.training_processes).dp == 8


def test_a_config_that_runs_megatron_on_the_hf_branch_is_split_by_its_own_layout():
    """The ``hf`` branch keeps the config's own backend, Megatron included."""
    preset = apply_overrides(PRESETS["gpt-oss-20b-verl"], VERL_MEGATRON_OVERRIDES)
    plan = RunPlan.resolve(preset.model_dump(mode="json"))
    assert plan.branch == "hf" and plan.trainer.model_parallel
    assert (plan.grpo.sizes.tp, plan.grpo.sizes.ep) == (8, 8)


def test_a_runs_picks_come_last():
    preset = PRESETS["gpt-oss-20b-verl"]
    values = config_dict(preset)
    plan = RunPlan.resolve(
        values,
        {
            "backend": "megatron",
            "megatron_checkpoint": "/ckpt",
            "layout_overrides": {"vllm_max_num_seqs": "64"},
            "job_api": "pytorchjob",
        },
    )
    assert plan.grpo_config["optim"]["megatron"]["checkpoint"] == "/ckpt"
    assert plan.layout_overrides == {**preset.layout_overrides, "vllm_max_num_seqs": "64"}
    assert plan.job_api == "pytorchjob" and plan.job.kind == "PyTorchJob"
    assert RunPlan.resolve(values).job is None  # auto: the API server's discovery decides
    assert RunPlan.resolve(config_dict(PRESETS["tiny-cpu"]), {"job_api": "trainjob"}).job is None


def test_the_job_api_of_the_configure_steps_outputs_is_the_grpo_jobs():
    preset = apply_overrides(PRESETS["gpt-oss-20b"], {"cluster.job_api": "trainjob"})
    assert RunPlan.resolve(step_configs(preset)).job_api == "trainjob"
    assert RunPlan.resolve(step_configs(PRESETS["gpt-oss-20b"])).job_api == AUTO


def test_unknown_names_and_missing_fields_are_named():
    values = config_dict(PRESETS["tiny-cpu"])
    with pytest.raises(UnknownSpecError, match=r"^grpo.rollout.engine='sglang' is not a"):
        RunPlan.resolve({**values, "grpo": {**values["grpo"], "rollout": {"engine": "sglang"}}})
    with pytest.raises(UnknownSpecError, match=r"^grpo.optim.backend='jax' is not a"):
        RunPlan.resolve({**values, "grpo": {**values["grpo"], "optim": {"backend": "jax"}}})
    with pytest.raises(RunPlanError, match=r"no grpo.nproc: pass the configs as they dump"):
        RunPlan.resolve({**values, "grpo": {"optim": {"backend": "torch"}}})
    with pytest.raises(RunPlanError, match=r"no sft"):
        RunPlan.resolve({"grpo": values["grpo"]})


def test_a_step_runs_on_its_executions_nodes():
    """The configure step's outputs carry each step's execution, which a run form may change:
    the plan places the step on its job's nodes, after the dedicated engines' nodes."""
    values = step_configs(PRESETS["gpt-oss-20b"])
    job = {**values["grpo_execution"]["job"], "nodes": 8}
    plan = RunPlan.resolve({**values, "grpo_execution": {**values["grpo_execution"], "job": job}})
    assert (plan.grpo.nodes, plan.grpo.gpus_per_node, plan.grpo.job_nodes) == (6, 4, 8)
    assert RunPlan.resolve(values).grpo.nodes == 4  # the machines' GRPO nodes
    job["nodes"] = 2  # the two engines' nodes and no training node
    with pytest.raises(ValueError, match="leave no node for training"):
        RunPlan.resolve({**values, "grpo_execution": {**values["grpo_execution"], "job": job}})


def _as_kfp_passes(value):
    """A dict parameter as a KFP step reads it back: JSON numbers, ints as floats."""
    if isinstance(value, dict):
        return {k: _as_kfp_passes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_kfp_passes(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


@pytest.mark.parametrize("name", ["tiny-cpu", "gpt-oss-20b-verl"])
def test_numbers_as_kfp_passes_them_give_the_same_plan(name):
    """The capacity-check task got ``nproc`` 1.0 from KFP (the demo's first run of the plan
    failed there: 'float' object cannot be interpreted as an integer)."""
    values = step_configs(PRESETS[name])
    for branch in PRESETS[name].grpo_branches:
        exact = RunPlan.resolve(values, {"backend": branch})
        floats = RunPlan.resolve(_as_kfp_passes(values), {"backend": branch})
        assert (floats.sft, floats.grpo) == (exact.sft, exact.grpo)
        assert isinstance(floats.grpo.training_processes, int)
    with pytest.raises(ValueError, match=r"grpo.nproc=1.5 must be a whole number"):
        RunPlan.resolve({**values, "grpo": {**values["grpo"], "nproc": 1.5}})
