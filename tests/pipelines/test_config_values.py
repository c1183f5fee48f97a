"""Config values are sane (issue #17): non-finite floats and booleans given for numbers are
rejected when the overrides are parsed, naming the field."""

import pytest
from pydantic import ValidationError

from pipelines.overrides import apply_overrides
from pipelines.presets import DEFAULT_PRESET, get_preset
from trainer.backends.config import OptimConfig
from trainer.grpo.config import GRPOConfig


@pytest.mark.parametrize(
    ("dotted", "value", "field"),
    [
        ("grpo.optim.learning_rate", "Infinity", "learning_rate"),
        ("grpo.rollout.temperature", "Infinity", "temperature"),
        ("sft.optim.weight_decay", "NaN", "weight_decay"),
        ("sft.max_steps", "true", "max_steps"),
        ("data_prep.augment_factor", "false", "augment_factor"),
        ("data_prep.eval_fraction", "NaN", "eval_fraction"),
        ("grpo.reward_weights", '{"language": Infinity}', "reward_weights"),
    ],
)
def test_non_finite_and_boolean_numbers_are_rejected_naming_the_field(dotted, value, field):
    with pytest.raises(ValueError, match=field):
        apply_overrides(get_preset(DEFAULT_PRESET), {dotted: value})


def test_booleans_and_numbers_still_parse_where_they_belong():
    preset = apply_overrides(
        get_preset(DEFAULT_PRESET),
        {"sft.max_steps": "7", "sft.gradient_checkpointing": "true", "sft.optim.zero_stage": "2"},
    )
    assert preset.sft.max_steps == 7 and preset.sft.gradient_checkpointing is True
    assert preset.sft.optim.zero_stage == 2
    with pytest.raises(ValidationError, match="zero_stage"):
        OptimConfig(zero_stage=True)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_any_non_finite_learning_rate_is_rejected(value):
    with pytest.raises(ValidationError, match="learning_rate"):
        GRPOConfig.model_validate({"optim": {"learning_rate": value}})


def test_a_group_of_one_sample_is_refused_when_the_pipeline_is_compiled(tmp_path):
    # issue #32 item 5: with n_samples=1 every advantage is 0; on main it compiled and "trained"
    # with loss and grad 0, exit 0
    from typer.testing import CliRunner

    from pipelines.cli import app

    with pytest.raises(ValidationError, match=r"rollout\.n_samples.*at least 2|n_samples"):
        GRPOConfig.model_validate({"rollout": {"n_samples": 1}})
    with pytest.raises(ValueError, match="n_samples"):
        apply_overrides(get_preset(DEFAULT_PRESET), {"grpo.rollout.n_samples": "1"})
    out = tmp_path / "p.yaml"
    result = CliRunner().invoke(
        app, ["compile", "-o", str(out), "--set", "grpo.rollout.n_samples=1"]
    )
    assert result.exit_code != 0 and not out.exists()
    assert "n_samples" in result.output and "group" in result.output
