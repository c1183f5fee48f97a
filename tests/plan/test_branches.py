"""The GRPO config a pipeline branch runs (``plan.branch_config``): the branch's backend, the
Megatron layout and checkpoint, its own optimizer block; and the trainer's name for it."""

from plan import TRAINERS, branch_config


def test_branch_config_sets_the_backend_layout_and_checkpoint():
    config = {"optim": {"backend": "deepspeed", "learning_rate": 1e-6}, "nproc": 8}
    assert branch_config(config) == config and branch_config(config, "hf") == config
    layout = {"preset": "tiny-cpu", "nodes": 1}
    megatron = branch_config(config, "megatron", layout, "/ckpt")
    assert megatron["optim"] == {
        "backend": "megatron",
        "learning_rate": 1e-6,
        "megatron": {"layout": layout, "checkpoint": "/ckpt"},
    }
    assert config["optim"]["backend"] == "deepspeed"  # the input is not changed
    # a layout the config names wins over the pipeline's
    named = {"optim": {"backend": "megatron", "megatron": {"layout": "verl-gpt-oss-8x8-h100"}}}
    assert branch_config(named, "megatron", layout)["optim"]["megatron"] == {
        "layout": "verl-gpt-oss-8x8-h100"
    }
    assert branch_config({}, "megatron")["optim"]["megatron"] == {"layout": "tiny-cpu"}
    # the branch's own optim block replaces the config's DeepSpeed one, and recompute stands
    # for the HF model's gradient checkpointing
    optim = {"learning_rate": 5e-7, "megatron": {"recompute_granularity": "full"}}
    deepspeed = {**config, "gradient_checkpointing": True}
    branch = branch_config(deepspeed, "megatron", layout, "/ckpt", optim)
    assert branch["optim"] == {
        "learning_rate": 5e-7,
        "backend": "megatron",
        "megatron": {"recompute_granularity": "full", "layout": layout, "checkpoint": "/ckpt"},
    }
    assert branch["gradient_checkpointing"] is False and branch["nproc"] == 8
    assert branch_config(deepspeed, "hf", layout, None, optim) == deepspeed  # the hf branch
    assert optim == {"learning_rate": 5e-7, "megatron": {"recompute_granularity": "full"}}


def test_only_a_model_parallel_backend_takes_a_layout():
    """The branch's layout and checkpoint go where the trainer spec splits the model, and
    nowhere else; an unknown backend is left for the config's own check to name."""
    for name, spec in TRAINERS.items():
        config = branch_config({"optim": {"backend": name}}, "", "tiny-cpu", "/ckpt")
        assert ("megatron" in config["optim"]) is spec.model_parallel
    assert branch_config({"optim": {"backend": "jax"}}, "", "tiny-cpu") == {
        "optim": {"backend": "jax"}
    }


def test_the_grpo_config_module_still_gives_the_component_its_branch_config():
    """The compiled GRPO component imports ``branch_config`` from ``trainer.grpo.config``."""
    from trainer.grpo import config

    assert config.branch_config is branch_config
