"""The learning signal: on the tiny-cpu preset, GRPO beats the SFT model on held-out prompts.

Slow (minutes on 2 cores): data prep → tiny model → SFT → GRPO exactly as `lingo run --local`
configures them, on a fixed seed. The gain must not come from gaming the language detector:
the exported policy's real-word share (a measure the reward does not see) stays within 10% of
the SFT model's.
"""

import pytest

from data_prep.prepare import prepare_dataset
from pipelines.presets import TINY_CPU
from trainer.grpo.recipe import run_grpo
from trainer.sft.recipe import run_sft
from trainer.tiny_model import build_tiny_model


@pytest.mark.slow
def test_grpo_improves_held_out_reward_over_the_sft_model(tmp_path):
    data = tmp_path / "data"
    prepare_dataset(TINY_CPU.data_prep, data / "train.jsonl", data / "eval.jsonl", data / "q.jsonl")
    base = build_tiny_model(tmp_path / "base", TINY_CPU.model.tiny)
    run_sft(
        TINY_CPU.sft,
        base,
        data / "train.jsonl",
        data / "eval.jsonl",
        tmp_path / "sft",
        tmp_path / "sft_work",
    )
    result = run_grpo(
        TINY_CPU.grpo,
        tmp_path / "sft",
        data / "train.jsonl",
        data / "eval.jsonl",
        tmp_path / "policy",
        tmp_path / "grpo_work",
    )
    gain = result.exported.mean_reward - result.baseline.mean_reward
    before, after = result.baseline, result.exported
    print(
        f"held-out mean reward {before.mean_reward:.2f} -> {after.mean_reward:.2f} "
        f"(step {result.exported_step}); real-word share {before.real_word_share:.3f} -> "
        f"{after.real_word_share:.3f}"
    )
    assert gain >= 1.0
    assert result.exported.real_word_share >= 0.9 * result.baseline.real_word_share
