"""The divergence guard (issue #17): no non-finite or saturated state is ever saved, and a
diverged run fails naming the step and the last good checkpoint."""

import pytest
import torch
from tests_helpers_trainer import small_grpo_config

from trainer.distributed import DistInfo
from trainer.divergence import DivergenceGuard, TrainingDivergedError, weights_square_sum
from trainer.grpo.config import GRPOConfig
from trainer.grpo.recipe import run_grpo
from trainer.sft.config import SFTConfig
from trainer.sft.recipe import run_sft

GRPO_SMALL = small_grpo_config()
INFO = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _saved_tensors(work):
    for ckpt in sorted((work / "checkpoints").glob("step-*")):
        state = torch.load(ckpt / "backend.pt", map_location="cpu", weights_only=False)
        yield ckpt.name, state["trainable"]


def _grpo(tmp_path, model, data, lr, **overrides):
    cfg = GRPOConfig.model_validate(
        {**GRPO_SMALL, "optim": {"learning_rate": lr, "lr_scheduler": "constant"}, **overrides}
    )
    return run_grpo(
        cfg, model, data / "train.jsonl", data / "eval.jsonl", tmp_path / "model", tmp_path / "work"
    )


def test_grpo_divergence_is_caught_before_the_checkpoint_is_written(
    tmp_path, tiny_model_dir, prepared_data
):
    # lr 1e36: step 1's loss is finite (computed before the update) but its update makes the
    # weights ~1e36; on main the step-1 checkpoint kept them and step 2 failed saying it was
    # "intact"
    with pytest.raises(TrainingDivergedError, match=r"GRPO diverged at step 1: the updated"):
        _grpo(tmp_path, tiny_model_dir, prepared_data, 1e36)
    for name, tensors in _saved_tensors(tmp_path / "work"):
        assert all(torch.isfinite(v).all() and v.abs().max() < 1e6 for v in tensors.values()), name
    assert not (tmp_path / "model").exists()


def test_grpo_vanishing_gradients_fail_instead_of_exporting_step_0(
    tmp_path, tiny_model_dir, prepared_data
):
    # lr 1e6 saturates the model: grad_norm 0 from step 2; on main the run exited 0 and the
    # guard exported the starting policy as if all was well
    gone = r"at step 4: the gradient norm has been 0"
    with pytest.raises(TrainingDivergedError, match=gone) as e:
        _grpo(tmp_path, tiny_model_dir, prepared_data, 1e6)
    assert "last good checkpoint is" in str(e.value) and "step-3" in str(e.value)
    assert not (tmp_path / "model").exists()


def test_sft_divergence_never_merges_or_exports(tmp_path, tiny_model_dir, prepared_data):
    cfg = SFTConfig.model_validate(
        {
            "lora": {"r": 0},
            "optim": {"learning_rate": 1e6, "lr_scheduler": "constant"},
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "max_steps": 6,
            "max_seq_len": 512,
            "dtype": "float32",
        }
    )
    with pytest.raises(TrainingDivergedError, match=r"SFT diverged at step \d"):
        run_sft(
            cfg,
            tiny_model_dir,
            prepared_data / "train.jsonl",
            None,
            tmp_path / "model",
            tmp_path / "work",
        )
    assert not (tmp_path / "model").exists()


def test_guard_counts_only_consecutive_zero_gradient_steps_with_signal(tmp_path):
    module = torch.nn.Linear(2, 2)
    guard = DivergenceGuard("GRPO", tmp_path, INFO, max_zero_grad_steps=2)
    guard.check(1, 0.1, 0.0, module)
    guard.check(2, 0.1, 0.5, module)  # resets
    guard.check(3, 0.1, 0.0, module)
    guard.check(4, 0.0, 0.0, module, signal=False)  # no signal: neither counts nor resets
    with pytest.raises(TrainingDivergedError, match="step 5.*0 for 2 steps.*no checkpoint"):
        guard.check(5, 0.1, 0.0, module)
    with pytest.raises(TrainingDivergedError, match="gradient norm is nan"):
        guard.check(6, 0.1, float("nan"), module)
    with torch.no_grad():
        module.weight[0, 0] = float("inf")
    assert weights_square_sum(module) == float("inf")
    with pytest.raises(TrainingDivergedError, match="weights are not finite"):
        guard.check(7, 0.1, 0.5, module)
