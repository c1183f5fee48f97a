"""Issue #43's loss variants against hand computations: GSPO's sequence-level ratio, the
``ppo_clip`` dispatch, DAPO's overlong penalty, Dr. GRPO's advantages and aggregation, and the
``algorithm`` config that names them."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from trainer.grpo import algorithm as algo
from trainer.grpo.config import GRPOConfig


def _inputs(log_probs, old, advantages, mask, behaviour=None):
    return algo.PolicyLossInputs(
        torch.tensor(log_probs, dtype=torch.float64, requires_grad=True),
        torch.tensor(old, dtype=torch.float64),
        None if behaviour is None else torch.tensor(behaviour, dtype=torch.float64),
        torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.float64),
    )


def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio() -> None:
    # row 0: log-ratios 0.1, 0.3 -> s_0 = exp(0.2) = 1.2214 > 1 + 0.2: clipped (A > 0)
    # row 1: log-ratios -0.1, 0.1, (masked) -> s_1 = exp(0) = 1: unclipped
    x = _inputs(
        log_probs=[[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]],
        old=[[-1.1, -2.3, -3.0], [-0.9, -1.1, -1.0]],
        advantages=[1.0, -2.0],
        mask=[[1, 1, 0], [1, 1, 0]],
    )
    settings = algo.PolicyLossSettings(
        clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="seq-mean-token-mean"
    )
    loss, stats = algo.get_policy_loss("gspo")(x, settings)
    # row 0: l = max(-1 * 1.2214, -1 * 1.2) = -1.2 per token; row 1: l = 2 * 1 = 2 per token
    # seq-mean-token-mean: (mean(-1.2, -1.2) + mean(2, 2)) / 2 = 0.4
    assert float(loss) == pytest.approx(0.4)
    loss.backward()
    grad = x.log_probs.grad
    # row 0 clipped: no gradient; row 1: dl/dlogp_t = -A * s / (2 tokens * 2 sequences)
    assert grad[0].tolist() == [0.0, 0.0, 0.0]
    assert grad[1, :2].tolist() == pytest.approx([2.0 / 4, 2.0 / 4])
    assert grad[1, 2] == 0.0
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)  # row 0's two tokens of four
    assert float(stats["ratio_max"]) == pytest.approx(math.exp(0.2))


def test_gspo_with_the_engine_log_probs_applies_the_rollout_correction() -> None:
    x = _inputs(
        log_probs=[[-1.0, -1.0]],
        old=[[-1.0, -1.0]],
        advantages=[1.0],
        mask=[[1, 1]],
        behaviour=[[-1.0 - math.log(4.0), -1.0]],  # token 0: pi_prox / mu = 4, capped at 2
    )
    settings = algo.PolicyLossSettings(correction="token_tis", tis_cap=2.0)
    loss, stats = algo.get_policy_loss("gspo")(x, settings)
    # s = 1; l_t = -1; weights (2, 1); token-mean: (-2 - 1) / 2
    assert float(loss) == pytest.approx(-1.5)
    assert float(stats["tis_clipped_fraction"]) == pytest.approx(0.5)


def test_ppo_clip_is_ppo_on_policy_and_decoupled_with_the_engine_log_probs() -> None:
    settings = algo.PolicyLossSettings(correction="token_tis")
    on = _inputs([[-1.0, -2.0]], [[-1.2, -2.0]], [1.0], [[1, 1]])
    assert float(algo.get_policy_loss("ppo_clip")(on, settings)[0]) == pytest.approx(
        float(algo.ppo_loss(on, settings)[0])
    )
    stale = _inputs([[-1.0, -2.0]], [[-1.2, -2.0]], [1.0], [[1, 1]], [[-1.5, -2.0]])
    loss, stats = algo.get_policy_loss("ppo_clip")(stale, settings)
    assert float(loss) == pytest.approx(float(algo.decoupled_loss(stale, settings)[0]))
    assert "importance_ratio_mean" in stats


def test_overlong_penalty_by_hand() -> None:
    lengths = torch.tensor([10, 12, 14, 16, 17])
    # L_max 16, L_cache 4: 0 up to 12, then (12 - |y|) / 4, -1 beyond 16
    penalty = algo.overlong_penalty(lengths, max_length=16, buffer=4, factor=2.0)
    assert penalty.tolist() == [0.0, 0.0, -1.0, -2.0, -2.0]
    assert algo.overlong_penalty(lengths, 16, 0).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="overlong buffer"):
        algo.overlong_penalty(lengths, 16, 16)


def test_dr_grpo_advantages_and_aggregation_by_hand() -> None:
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])
    assert algo.get_advantage_estimator("dr_grpo")(rewards, 2).tolist() == [-1.0, 1.0, 0.0, 0.0]
    std = math.sqrt(2.0)  # unbiased std of (1, 3)
    grpo = algo.get_advantage_estimator("grpo")(rewards, 2)
    assert grpo[:2].tolist() == pytest.approx([-1 / (std + 1e-6), 1 / (std + 1e-6)])
    losses = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # Dr. GRPO: sum / (B * T) = 6 / (2 * 3); token-mean: 6 / 3
    assert float(algo.aggregate_loss(losses, mask, "seq-mean-token-sum-norm")) == 1.0
    assert float(algo.aggregate_loss(losses, mask, "token-mean")) == 2.0
    assert float(algo.aggregate_loss(losses, mask, "seq-mean-token-sum")) == 3.0


def test_the_algorithm_section_names_each_variant() -> None:
    cfg = GRPOConfig.model_validate(
        {
            "algorithm": {
                "policy_loss": "gspo",
                "advantage_estimator": "dr_grpo",
                "loss_agg_mode": "seq-mean-token-sum-norm",
                "overlong_buffer": 64,
            }
        }
    )
    assert cfg.algorithm.policy_loss == "gspo"
    assert GRPOConfig().algorithm.policy_loss == "ppo_clip"  # today's loss stays the default
    with pytest.raises(ValidationError, match="unknown policy loss 'gpso'; valid names"):
        GRPOConfig.model_validate({"algorithm": {"policy_loss": "gpso"}})
    with pytest.raises(ValidationError, match="unknown advantage estimator 'drgrpo'; valid"):
        GRPOConfig.model_validate({"algorithm": {"advantage_estimator": "drgrpo"}})
    with pytest.raises(ValidationError, match="unknown loss aggregation mode 'sum'; valid"):
        GRPOConfig.model_validate({"algorithm": {"loss_agg_mode": "sum"}})
    with pytest.raises(ValidationError, match="overlong_buffer=256 must be below"):
        GRPOConfig.model_validate({"algorithm": {"overlong_buffer": 256}})
