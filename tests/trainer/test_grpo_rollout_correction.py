"""Rollout corrections (none, token_tis, seq_tis, seq_mask): hand values, statistics and
gradients of ``decoupled_policy_loss`` with each, as the other loss tests do."""

import math

import pytest
import torch

from trainer.grpo.algorithm import (
    LOSS_AGG_MODES,
    ROLLOUT_CORRECTIONS,
    CorrectionBounds,
    decoupled_policy_loss,
    get_rollout_correction,
    policy_loss,
    rollout_weights,
)


def _t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def _case():
    """Two rows of four tokens (as test_grpo_algorithm's decoupled case).

    row 0, A = +1, mask (1, 1, 1, 0), r = π_θ/π_prox = (1.0, 1.1, 1.5, 1.0),
           w = π_prox/μ = (1.0, 4.0, 0.5, NaN): sequence ratio 2, geometric mean 2^(1/3)
    row 1, A = -1, mask (1, 1, 1, 1), r = (1.0, 0.5, 4.0, 1.0), w = (3.0, 2.5, 1.5, 1.0):
           sequence ratio 11.25, geometric mean 11.25^(1/4)
    PPO terms (clip [0.8, 1.2], c = 3): row 0 -1, -1.1, -1.2 (clipped); row 1 1, 0.8
    (clipped), 3 (dual), 1.
    """
    old = _t([[-1.0, -2.0, -0.5, -1.0], [-0.3, -1.2, -2.2, -0.7]])
    log_probs = old + _t([[1.0, 1.1, 1.5, 1.0], [1.0, 0.5, 4.0, 1.0]]).log()
    behaviour = old - _t([[1.0, 4.0, 0.5, 1.0], [3.0, 2.5, 1.5, 1.0]]).log()
    behaviour[0, 3] = math.nan
    mask = _t([[1, 1, 1, 0], [1, 1, 1, 1]])
    return log_probs, old, behaviour, _t([1.0, -1.0]), mask


def _loss(correction, **kwargs):
    log_probs, old, behaviour, advantages, mask = _case()
    log_probs.requires_grad_(True)
    loss, stats = decoupled_policy_loss(
        log_probs,
        old,
        behaviour,
        advantages,
        mask,
        correction=correction,
        clip_ratio_c=3.0,
        **kwargs,
    )
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, stats, grad


def test_seq_tis_weights_every_token_by_its_truncated_sequence_ratio():
    loss, stats, grad = _loss("seq_tis", tis_cap=3.0)
    # w = min(2, 3) = 2 for row 0, min(11.25, 3) = 3 for row 1
    assert loss.item() == pytest.approx((2 * (-1 - 1.1 - 1.2) + 3 * (1 + 0.8 + 3 + 1)) / 7)
    # gradient w·(-A·r)/N on the live tokens; clipped (0,2), (1,1), dual (1,2), masked (0,3): 0
    expected = _t([[-2 * 1.0, -2 * 1.1, 0, 0], [3 * 1.0, 0, 0, 3 * 1.0]]) / 7
    torch.testing.assert_close(grad, expected)
    assert stats["importance_ratio_mean"].item() == pytest.approx((3 * 2 + 4 * 11.25) / 7)
    assert stats["importance_ratio_max"].item() == pytest.approx(11.25)
    assert stats["tis_clipped_fraction"].item() == pytest.approx(4 / 7)  # row 1's tokens
    assert stats["seq_masked_fraction"].item() == 0


def test_seq_mask_drops_the_sequence_whose_geometric_mean_ratio_is_outside_the_bounds():
    # geometric means 1.26 (kept) and 1.83 (outside [0.5, 1.5]: masked out)
    loss, stats, grad = _loss("seq_mask", seq_mask_low=0.5, seq_mask_high=1.5)
    assert loss.item() == pytest.approx((-1 - 1.1 - 1.2) / 7)  # still divided by 7 tokens
    torch.testing.assert_close(grad, _t([[-1.0, -1.1, 0, 0], [0, 0, 0, 0]]) / 7)
    assert stats["seq_masked_fraction"].item() == pytest.approx(4 / 7)
    assert stats["tis_clipped_fraction"].item() == 0
    geometric = (3 * 2 ** (1 / 3) + 4 * 11.25**0.25) / 7
    assert stats["importance_ratio_mean"].item() == pytest.approx(geometric)
    # a lower bound above row 0's mean masks it too; bounds that hold both keep both
    _, low, _ = _loss("seq_mask", seq_mask_low=0.9, seq_mask_high=1.2)
    assert low["seq_masked_fraction"].item() == 1
    wide, _, _ = _loss("seq_mask", seq_mask_low=0.5, seq_mask_high=2.0)
    assert wide.item() == pytest.approx((-1 - 1.1 - 1.2 + 1 + 0.8 + 3 + 1) / 7)


def test_none_is_policy_loss_whatever_the_behaviour_and_reports_the_token_ratios():
    loss, stats, grad = _loss("none")
    log_probs, old, _, advantages, mask = _case()
    log_probs.requires_grad_(True)
    plain, _ = policy_loss(log_probs, old, advantages, mask, clip_ratio_c=3.0)
    (plain_grad,) = torch.autograd.grad(plain, log_probs)
    assert torch.equal(loss, plain) and torch.equal(grad, plain_grad)
    assert stats["importance_ratio_mean"].item() == pytest.approx(13.5 / 7)
    assert stats["tis_clipped_fraction"].item() == 0 and stats["seq_masked_fraction"].item() == 0


def test_token_tis_is_the_default_and_today_s_loss():
    loss, stats, grad = _loss("token_tis", tis_cap=2.0)
    log_probs, old, behaviour, advantages, mask = _case()
    default, _ = decoupled_policy_loss(
        log_probs, old, behaviour, advantages, mask, clip_ratio_c=3.0
    )
    assert loss.item() == pytest.approx((-3.8 + 9.1) / 7) == default.item()
    assert stats["tis_clipped_fraction"].item() == pytest.approx(3 / 7)


@pytest.mark.parametrize("correction", sorted(ROLLOUT_CORRECTIONS))
def test_each_correction_is_policy_loss_when_behaviour_is_proximal(correction):
    generator = torch.Generator().manual_seed(7)
    old = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    log_ratio = torch.randn(3, 5, generator=generator, dtype=torch.float64) * 0.5
    advantages = _t([1.5, -0.7, -2.0])
    mask = _t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 1, 0]])
    log_probs = old + log_ratio
    plain, _ = policy_loss(log_probs, old, advantages, mask)
    corrected, stats = decoupled_policy_loss(
        log_probs, old, old.clone(), advantages, mask, correction=correction
    )
    assert torch.equal(plain, corrected)
    assert stats["importance_ratio_mean"].item() == 1 == stats["importance_ratio_max"].item()


@pytest.mark.parametrize("correction", sorted(ROLLOUT_CORRECTIONS))
def test_each_correction_gradcheck_and_detached_weight(correction):
    generator = torch.Generator().manual_seed(8)
    old = -torch.rand(3, 4, generator=generator, dtype=torch.float64) * 3
    log_ratio = (torch.rand(3, 4, generator=generator, dtype=torch.float64) - 0.5) * 0.2
    behaviour = old + torch.randn(3, 4, generator=generator, dtype=torch.float64) * 0.1
    log_probs = (old + log_ratio).requires_grad_(True)
    advantages = _t([1.5, -0.7, 0.3])
    mask = _t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]])
    kwargs = {"correction": correction, "seq_mask_low": 0.9, "seq_mask_high": 1.1}
    for mode in sorted(LOSS_AGG_MODES):
        assert torch.autograd.gradcheck(
            lambda lp, mode=mode: decoupled_policy_loss(
                lp, old, behaviour, advantages, mask, loss_agg_mode=mode, **kwargs
            )[0],
            (log_probs,),
        )
    (grad,) = torch.autograd.grad(
        decoupled_policy_loss(log_probs, old, behaviour, advantages, mask, **kwargs)[0],
        log_probs,
    )
    weights = rollout_weights(
        old, behaviour, mask, correction, CorrectionBounds(2.0, 0.9, 1.1)
    ).weights
    expected = -weights * advantages[:, None] * log_ratio.exp() * mask / mask.sum()
    torch.testing.assert_close(grad, expected)
    behaviour_leaf = behaviour.clone().requires_grad_(True)
    loss, _ = decoupled_policy_loss(log_probs, old, behaviour_leaf, advantages, mask, **kwargs)
    loss.backward()
    assert behaviour_leaf.grad is None  # the weight is not in the graph


def test_padding_never_moves_a_sequence_weight():
    _, old, behaviour, _, mask = _case()
    moved = behaviour.clone()
    moved[0, 3] = -50.0  # the padded token of row 0
    for correction in ROLLOUT_CORRECTIONS:
        a = rollout_weights(old, behaviour, mask, correction)
        b = rollout_weights(old, moved, mask, correction)
        assert torch.equal(a.weights, b.weights), correction


def test_registry_and_bounds_are_checked():
    assert set(ROLLOUT_CORRECTIONS) == {"none", "token_tis", "seq_tis", "seq_mask"}
    with pytest.raises(ValueError, match="rollout correction 'seq'; valid names: none, seq_mask"):
        get_rollout_correction("seq")
    with pytest.raises(ValueError, match="seq_mask_low"):
        CorrectionBounds(seq_mask_low=1.1)
    with pytest.raises(ValueError, match="tis_cap"):
        CorrectionBounds(tis_cap=1.0)
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="same"):
        rollout_weights(lp, lp[:, :1], torch.ones(1, 2), "none")
