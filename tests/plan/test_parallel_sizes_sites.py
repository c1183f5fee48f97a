"""The layers that check parallel sizes (the capacity planner's ``Layout``, the GRPO config's
Megatron block, the Megatron layout's start-time check) apply ParallelSizes's one rule and say
it the same way, each naming its own world (``training_gpus``, the layout's world, the world
size). EP 4 on 2 GPUs breaks only the expert grid (4 divides gpt-oss-20b's 32 experts)."""

import pytest
from pydantic import ValidationError

from capacity import Layout, LayoutError, resolve_layout
from plan import ParallelSizes
from trainer.grpo.config import GRPOConfig
from trainer.megatron.layout import LayoutError as MegatronLayoutError
from trainer.megatron.layout import MegatronLayout, validate_layout

RULE = "2 is not a multiple of etp × ep × pp = 1 × 4 × 1 = 4"


def test_the_one_rule_itself():
    (problem,) = ParallelSizes(ep=4).problems(2)
    assert RULE in problem


def test_the_capacity_layout_names_training_gpus():
    two_gpus = Layout(backend="megatron", gpus_per_node=2, training_gpus=2)
    with pytest.raises(LayoutError, match=f"megatron: training_gpus {RULE}"):
        resolve_layout(two_gpus, {"expert_parallel": "4"})


def test_the_grpo_config_names_the_megatron_layout_when_built():
    layout = {"preset": "tiny-cpu", "ep": 4, "gpus_per_node": 2}
    config = {
        "nproc": 2,
        "rollout": {"n_samples": 4, "max_new_tokens": 16},
        "prompts_per_step": 4,
        "mini_batch_size": 16,
        "micro_batch_size": 8,
        "optim": {"backend": "megatron", "megatron": {"layout": layout}},
    }
    with pytest.raises(ValidationError, match=f"layout 'tiny-cpu''s world {RULE}"):
        GRPOConfig.model_validate(config)


def test_the_megatron_layout_check_names_the_world_size():
    with pytest.raises(MegatronLayoutError) as raised:
        validate_layout("gpt-oss-20b", MegatronLayout(ep=4, gpus_per_node=2))
    (problem,) = raised.value.problems
    assert f"world size {RULE}" in problem
