"""trainer.placement: processes, devices, TP groups and rollout engines of a run."""

from __future__ import annotations

from collections import Counter

import pytest
from tests_helpers_trainer import VERL_COLOCATED_OVERRIDES, VERL_MEGATRON_OVERRIDES

from pipelines.overrides import apply_overrides
from pipelines.preset_capacity import grpo_plan
from pipelines.presets import PRESETS
from plan import ParallelSizes
from trainer.placement import (
    Device,
    PlacementError,
    PlacementPlan,
    RolloutEngines,
    plan_placement,
)


def check_plan(plan: PlacementPlan) -> None:
    """The invariants every plan keeps."""
    gpus = Counter(p.device for p in plan.processes)
    assert max(gpus.values()) == 1  # one process per GPU
    assert all(
        0 <= p.device.node < plan.nodes and 0 <= p.device.local_gpu < plan.gpus_per_node
        for p in plan.processes
    )
    engine_gpus = [d for e in plan.engines for d in e.devices]
    assert len(engine_gpus) == len(set(engine_gpus))  # no two engines share a GPU
    for engine in plan.engines:
        assert len({d.node for d in engine.devices}) == 1  # an engine stays on one node
        assert engine.tensor_parallel_size == plan.rollout.tp
        assert all(plan.processes[r].engine == engine.index for r in engine.ranks)
    for group in plan.train_tp_groups:
        assert len({plan.processes[r].device.node for r in group}) == 1
        assert len(group) == plan.sizes.tp
    sizes, rollout = plan.sizes, plan.rollout
    assert len(plan.training_ranks) == sizes.tp * sizes.pp * sizes.cp * sizes.dp
    if rollout.colocate:
        assert len(plan.engines) * rollout.tp == len(plan.training_ranks)
        assert plan.rollout_only_ranks == ()
    else:
        assert len(plan.engines) == rollout.dedicated
        assert len(plan.rollout_only_ranks) == rollout.dedicated * rollout.tp
        assert not set(engine_gpus) & {plan.processes[r].device for r in plan.training_ranks}
    assert plan.gpus_used == len(plan.processes) <= plan.nodes * plan.gpus_per_node


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_a_valid_plan(name):
    plan = grpo_plan(PRESETS[name])
    check_plan(plan)
    assert len(plan.training_ranks) == PRESETS[name].grpo.nproc


def test_the_gpt_oss_20b_plan_is_the_openrlhf_split():
    """16 training processes on 4 nodes of 4 A10G, 2 engines of TP 4 on nodes 4 and 5 — not
    16 engines of 4 GPUs each on GPU 0."""
    plan = grpo_plan(PRESETS["gpt-oss-20b"])
    assert (plan.nodes, plan.gpus_per_node, plan.gpus_used) == (6, 4, 24)
    assert [(e.node, e.cuda_visible_devices, e.ranks) for e in plan.engines] == [
        (4, "0,1,2,3", (16, 17, 18, 19)),
        (5, "0,1,2,3", (20, 21, 22, 23)),
    ]
    assert all(plan.engine_of(r) is None for r in plan.training_ranks)


def test_the_verl_plan_trains_on_one_node_and_samples_on_the_next():
    plan = grpo_plan(PRESETS["gpt-oss-20b-verl"])
    assert (plan.nodes, plan.gpus_per_node, len(plan.engines)) == (2, 8, 2)
    assert plan.training_ranks == tuple(range(8))
    assert [(e.node, e.ranks) for e in plan.engines] == [(1, (8, 9, 10, 11)), (1, (12, 13, 14, 15))]
    # backend=megatron: TP 8 / EP 8 over the training node, the same engines after it
    megatron = apply_overrides(PRESETS["gpt-oss-20b-verl"], VERL_MEGATRON_OVERRIDES)
    plan = grpo_plan(megatron)
    check_plan(plan)
    assert (plan.sizes.tp, plan.sizes.ep, plan.sizes.dp) == (8, 8, 1)
    assert plan.train_tp_groups == (tuple(range(8)),)
    assert [e.ranks for e in plan.engines] == [(8, 9, 10, 11), (12, 13, 14, 15)]
    # verl's hybrid engine: one engine per 4 training GPUs of the one node
    plan = grpo_plan(apply_overrides(PRESETS["gpt-oss-20b-verl"], VERL_COLOCATED_OVERRIDES))
    assert (plan.nodes, plan.gpus_per_node, len(plan.engines)) == (1, 8, 2)
    assert plan.engine_of(5).ranks == (4, 5, 6, 7)
    assert plan.processes[5].roles == ("train", "rollout")


def test_the_plan_is_the_branch_the_run_starts():
    """``backend=megatron`` (the run form's parameter): the plan and the preflight are the
    Megatron branch's, TP 8 / EP 8, with no config faking it. Before the run plan they were
    the ``hf`` branch's whatever the branch: DeepSpeed, dp 8."""
    from pipelines.preflight import config_value_problems

    verl = PRESETS["gpt-oss-20b-verl"]
    megatron = verl.model_copy(update={"backend": "megatron"})
    plan = grpo_plan(megatron)
    check_plan(plan)
    assert (plan.sizes.tp, plan.sizes.ep, plan.sizes.dp) == (8, 8, 1)
    assert [e.ranks for e in plan.engines] == [(8, 9, 10, 11), (12, 13, 14, 15)]
    assert (grpo_plan(verl).sizes.tp, grpo_plan(verl).sizes.dp) == (1, 8)
    assert config_value_problems(megatron) == []
    # the Megatron branch's own placement problem is found, not the hf branch's
    bad = megatron.model_copy(
        update={"megatron_layout": {"preset": "verl-gpt-oss-8x8-h100", "tp": 3}}
    )
    (problem,) = config_value_problems(bad)
    assert "tp × pp × cp" in problem and "3" in problem, problem


def test_the_verl_megatron_plan_with_dedicated_engines_trains_first_then_rolls_out(monkeypatch):
    """verl's decoupled gpt-oss-20b run: Megatron TP 8 / EP 8 on one node of 8 H200, two vLLM
    engines of TP 4 on a second node. The Megatron ranks come first (one TP group, node 0),
    the engines after (node 1); the Megatron layout's world is the 8 training processes, not
    the job's 16, and torchrun's ranks get the same plan at start (``run_placement``)."""
    import torch

    from trainer.distributed import DistInfo
    from trainer.megatron.layout import validate_layout
    from trainer.placement import run_placement

    preset = apply_overrides(PRESETS["gpt-oss-20b-verl"], VERL_MEGATRON_OVERRIDES)
    cfg = preset.grpo
    assert (cfg.nproc, cfg.rollout_processes) == (8, 8)
    plan = grpo_plan(preset)
    check_plan(plan)
    assert (plan.nodes, plan.gpus_per_node, plan.gpus_used) == (2, 8, 16)
    assert plan.training_ranks == tuple(range(8)) and plan.train_tp_groups == (tuple(range(8)),)
    assert all(plan.processes[r].device.node == 0 for r in plan.training_ranks)
    assert (plan.sizes.tp, plan.sizes.pp, plan.sizes.ep, plan.sizes.dp) == (8, 1, 8, 1)
    assert not plan.rollout.colocate
    assert [(e.node, e.cuda_visible_devices, e.ranks) for e in plan.engines] == [
        (1, "0,1,2,3", (8, 9, 10, 11)),
        (1, "4,5,6,7", (12, 13, 14, 15)),
    ]
    # the layout the Megatron backend validates at start: world = the training processes
    # (its default group holds only them); a training layout, so sequence parallelism is on
    layout = cfg.optim.megatron.resolved_layout()
    checked = validate_layout(
        "gpt-oss-20b", layout, world_size=len(plan.training_ranks), training=True
    )
    assert (checked.world_size, checked.layout.dp, checked.expert_data_parallel) == (8, 1, 1)
    # under torchrun (2 nodes × 8): rank 3 trains, rank 13 serves engine 1, as planned
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for rank in (3, 13):
        job = run_placement(cfg, DistInfo(rank, 16, rank % 8, torch.device("cpu")))
        assert job == plan
    assert job.engine_of(13).index == 1 and job.engine_of(3) is None
    assert "rollout" not in job.processes[3].roles and job.processes[13].roles == ("rollout",)


@pytest.mark.parametrize(
    ("nodes", "gpus", "sizes", "rollout"),
    [
        (2, 8, ParallelSizes(tp=4, pp=2, ep=4, dp=2), RolloutEngines(tp=8)),
        (3, 8, ParallelSizes(tp=2, dp=8), RolloutEngines(tp=4, colocate=False, dedicated=2)),
        (1, 8, ParallelSizes(dp=6), RolloutEngines(tp=2, colocate=False, dedicated=1)),
        (4, 2, ParallelSizes(dp=8), RolloutEngines(tp=2)),
        # context parallelism: TP 2 × CP 2 × DP 2 = 8 training processes
        (1, 8, ParallelSizes(tp=2, cp=2, ep=2, dp=2), RolloutEngines(tp=4)),
    ],
)
def test_plans_keep_their_invariants(nodes, gpus, sizes, rollout):
    check_plan(plan_placement(nodes, gpus, sizes, rollout))


def test_devices_follow_torchrun():
    plan = plan_placement(2, 4, ParallelSizes(tp=2, dp=4), RolloutEngines(tp=4))
    assert plan.processes[6].device == Device(1, 2)
    assert plan.train_tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert [e.ranks for e in plan.engines] == [(0, 1, 2, 3), (4, 5, 6, 7)]


@pytest.mark.parametrize(
    ("nodes", "gpus", "sizes", "rollout", "message"),
    [
        (2, 4, ParallelSizes(tp=8, dp=1), None, "TP group would cross nodes"),
        (2, 4, ParallelSizes(dp=8), RolloutEngines(tp=8), "engine would cross nodes"),
        (
            1, 4, ParallelSizes(dp=4), RolloutEngines(colocate=False, dedicated=1),
            "> 1 nodes × 4",
        ),
        (1, 8, ParallelSizes(dp=3), RolloutEngines(tp=2), "not a multiple of rollout TP"),
        (1, 8, ParallelSizes(dp=4), RolloutEngines(colocate=False), "rollout_engines ≥ 1"),
        (
            1, 8, ParallelSizes(tp=2, dp=3, ep=4), None,
            "training processes 6 is not a multiple of etp × ep × pp = 1 × 4 × 1",
        ),
        (1, 8, ParallelSizes(), None, "have no dp: fit them"),
        (1, 8, ParallelSizes(dp=1), RolloutEngines(tp=0), "rollout tp=0 must be ≥ 1"),
    ],
)  # fmt: skip
def test_what_cannot_be_placed_says_why(nodes, gpus, sizes, rollout, message):
    with pytest.raises(PlacementError, match=message):
        plan_placement(nodes, gpus, sizes, rollout)


def _old_expert_rule_accepts(sizes: ParallelSizes) -> bool:
    """The rule placement kept before it used ``ParallelSizes``: EP divides TP × DP (it knew
    neither CP nor ETP, and counted TP × PP × DP training processes)."""
    return (sizes.tp * sizes.dp) % sizes.ep == 0


@pytest.mark.parametrize(
    ("sizes", "megatron_accepts"),
    [
        # CP 2 × DP 1 = 2 processes hold EP 2 (Megatron's expert grid: 2 % (1 × 2 × 1) = 0);
        # the old rule saw TP × DP = 1 and refused
        (ParallelSizes(cp=2, ep=2, dp=1), True),
        # ETP 2 × EP 2 = 4 does not divide 2 processes: Megatron refuses; the old rule
        # (TP × DP = 2, EP 2) accepted
        (ParallelSizes(ep=2, etp=2, dp=2), False),
    ],
)
def test_placement_takes_megatron_cores_expert_grid_where_the_old_rule_disagreed(
    sizes, megatron_accepts
):
    """Reproduction: ``(tp × dp) % ep`` disagreed with Megatron-Core's
    ``world % (etp × ep × pp)`` when CP or ETP > 1; placement now applies ParallelSizes'
    rule (Megatron-Core's ``initialize_model_parallel``)."""
    world = sizes.tp * sizes.pp * sizes.cp * sizes.dp
    assert _old_expert_rule_accepts(sizes) != megatron_accepts
    assert (world % (sizes.etp * sizes.ep * sizes.pp) == 0) == megatron_accepts
    if megatron_accepts:
        plan = plan_placement(1, 8, sizes)
        check_plan(plan)
        assert len(plan.training_ranks) == world  # CP counts: not tp × pp × dp = 1
    else:
        with pytest.raises(PlacementError, match="etp × ep × pp = 2 × 2 × 1 = 4"):
            plan_placement(1, 8, sizes)


def test_render_names_every_engine():
    text = grpo_plan(PRESETS["gpt-oss-20b"]).render()
    assert "16 training processes" in text and "2 vllm rollout engine(s) of TP 4" in text
    assert "engine 1: ranks 20-23 on node 5 gpus 0,1,2,3" in text


def _grpo(**rollout):
    from trainer.grpo.config import GRPOConfig

    return GRPOConfig.model_validate(
        {
            "rollout": {"engine": "vllm", "tensor_parallel_size": 4, **rollout},
            "prompts_per_step": 16,
            "mini_batch_size": 128,
            "micro_batch_size": 1,
            "nproc": 16,
            "optim": {"backend": "deepspeed"},
        }
    )


def test_the_recipe_builds_an_engine_only_where_the_plan_says(monkeypatch):
    """Under torchrun (2 nodes × 8), rank 13 is a worker of engine 3 (ranks 12-15, node 1
    GPUs 4-7); a dedicated layout puts its engines after the 16 training processes, and a job
    without room for them stops at start."""
    import torch

    from trainer.distributed import DistInfo
    from trainer.placement import run_placement

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    plan = run_placement(_grpo(), DistInfo(13, 16, 5, torch.device("cpu")))
    engine = plan.engine_of(13)
    assert (engine.index, engine.ranks, engine.node, engine.cuda_visible_devices) == (
        3, (12, 13, 14, 15), 1, "4,5,6,7"
    )  # fmt: skip
    with pytest.raises(PlacementError, match="torchrun on node 1 gpu 6"):
        run_placement(_grpo(), DistInfo(13, 16, 6, torch.device("cpu")))
    dedicated = _grpo(colocate=False, num_engines=2)
    with pytest.raises(PlacementError, match="leave 8 training processes, not nproc=16"):
        run_placement(dedicated, DistInfo(0, 16, 0, torch.device("cpu")))
    plan = run_placement(dedicated, DistInfo(0, 24, 0, torch.device("cpu")))  # 3 nodes × 8
    assert plan.training_ranks == tuple(range(16))
    assert [e.ranks for e in plan.engines] == [(16, 17, 18, 19), (20, 21, 22, 23)]
