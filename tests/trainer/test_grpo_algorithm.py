"""GRPO algorithm functions against hand-computed values, clip branches and gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.grpo.algorithm import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    PolicyLossInputs,
    PolicyLossSettings,
    aggregate_loss,
    decoupled_policy_loss,
    entropy_from_logits,
    get_advantage_estimator,
    get_kl_estimator,
    get_loss_agg_mode,
    get_policy_loss,
    group_advantages,
    group_stats,
    kl_loss,
    kl_penalty,
    policy_loss,
    token_log_probs,
)

EPS = 1e-6
LN2 = math.log(2)


def _t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


# --------------------------------------------------------------------------- advantages


def test_grpo_advantages_fixed_group_size_match_hand_values():
    rewards = _t([1.0, 2.0, 3.0, 0.0, 0.0, 4.0])
    # group [1, 2, 3]: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> A = [-1, 0, 1] / (1 + eps)
    # group [0, 0, 4]: mean 4/3, deviations (-4/3, -4/3, 8/3), squares sum 96/9,
    #   unbiased var 96/9 / 2 = 16/3, std 4/sqrt(3) -> A = [-1, -1, 2] / sqrt(3) (up to eps)
    s3 = math.sqrt(3)
    std1 = 4 / s3
    expected = _t(
        [-1 / (1 + EPS), 0.0, 1 / (1 + EPS)]
        + [-4 / 3 / (std1 + EPS), -4 / 3 / (std1 + EPS), 8 / 3 / (std1 + EPS)]
    )
    advantages = group_advantages(rewards, 3)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(advantages[3:], _t([-1, -1, 2]) / s3, rtol=1e-5, atol=0)


def test_dr_grpo_advantages_are_mean_centred_rewards():
    rewards = _t([1.0, 2.0, 3.0, 0.0, 0.0, 4.0])
    # means 2 and 4/3: [1-2, 2-2, 3-2, 0-4/3, 0-4/3, 4-4/3]
    expected = _t([-1.0, 0.0, 1.0, -4 / 3, -4 / 3, 8 / 3])
    torch.testing.assert_close(group_advantages(rewards, 3, norm_by_std=False), expected)
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS["dr_grpo"](rewards, 3), expected)


def test_uneven_unsorted_group_ids_and_group_of_one():
    rewards = _t([1.0, 0.0, 3.0, 1.0, 2.0, 9.0])
    groups = torch.tensor([7, 3, 7, 3, 3, 5])
    # group 7 = {1, 3}: mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt(2) -> -+1/sqrt(2)
    # group 3 = {0, 1, 2}: mean 1, std 1 -> -1, 0, 1
    # group 5 = {9}: a group of one -> 0
    r2 = 1 / (math.sqrt(2) + EPS)
    expected = _t([-r2, -1 / (1 + EPS), r2, 0.0, 1 / (1 + EPS), 0.0])
    torch.testing.assert_close(group_advantages(rewards, groups), expected, rtol=0, atol=1e-12)
    dr = group_advantages(rewards, groups, norm_by_std=False)
    torch.testing.assert_close(dr, _t([-1.0, -1.0, 1.0, 0.0, 1.0, 0.0]))


def test_group_size_one_gives_zero_advantages():
    rewards = _t([0.3, -2.0, 5.0])
    assert torch.equal(group_advantages(rewards, 1), torch.zeros(3, dtype=torch.float64))
    assert torch.equal(
        group_advantages(rewards, 1, norm_by_std=False), torch.zeros(3, dtype=torch.float64)
    )


def test_fixed_size_equals_explicit_ids_and_torch_std():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=generator, dtype=torch.float64)
    by_size = group_advantages(rewards, 4)
    by_ids = group_advantages(rewards, torch.arange(12) // 4)
    torch.testing.assert_close(by_size, by_ids)
    groups = rewards.view(3, 4)
    reference = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + EPS)
    torch.testing.assert_close(by_size, reference.flatten())


def test_all_equal_groups_are_flagged_and_get_exact_zero():
    rewards = _t([0.1, 0.1, 0.1, 0.0, 1.0, 1.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    stats = group_stats(rewards, groups)
    assert stats.ids.tolist() == [0, 1, 2]
    assert stats.index.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert stats.size.tolist() == [3, 3, 1]
    # group 1 = {0, 1, 1}: mean 2/3, squares 4/9 + 1/9 + 1/9 = 6/9, unbiased var 1/3
    torch.testing.assert_close(stats.mean, _t([0.1, 2 / 3, 7.0]))
    torch.testing.assert_close(stats.std, _t([0.0, math.sqrt(1 / 3), 0.0]))
    assert stats.all_equal.tolist() == [True, False, True]
    assert stats.all_equal[stats.index].tolist() == [True] * 3 + [False] * 3 + [True]
    advantages = group_advantages(rewards, groups)
    assert torch.equal(advantages[:3], torch.zeros(3, dtype=torch.float64))
    assert advantages[6] == 0


def test_integer_rewards_are_accepted():
    advantages = group_advantages(torch.tensor([0, 1, 1, 1]), 2, norm_by_std=False)
    assert advantages.dtype == torch.float32
    assert advantages.tolist() == [-0.5, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_raise_naming_positions(bad):
    rewards = _t([0.0, bad, 1.0, bad])
    with pytest.raises(ValueError, match=r"positions \[1, 3\]"):
        group_advantages(rewards, 2)
    with pytest.raises(ValueError, match=r"positions \[1, 3\]"):
        group_stats(rewards, 2)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (4, "positive divisor"),
        (0, "positive divisor"),
        (torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]), "integer tensor"),
        (torch.tensor([0, 1]), "shape"),
    ],
)
def test_malformed_groups_raise(groups, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(torch.zeros(6), groups)


# --------------------------------------------------------------------------- aggregation

LOSS = _t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = _t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", 2.75),  # ((1 + 2) / 2 + 4 / 1) / 2 non-empty rows
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 non-empty rows
        ("seq-mean-token-sum-norm", 7 / 9),  # (1 + 2 + 4) / (B=3 rows * T=3)
    ],
)
def test_aggregate_loss_hand_values(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected, abs=1e-12)
    # rows with no token are invisible to every mode but the Dr.GRPO constant denominator
    if mode != "seq-mean-token-sum-norm":
        assert aggregate_loss(LOSS[:2], MASK[:2], mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_given_length_and_bool_mask():
    # (1 + 2 + 4) / (3 rows * 4)
    loss = aggregate_loss(LOSS, MASK.bool(), "seq-mean-token-sum-norm", norm_length=4)
    assert loss.item() == pytest.approx(7 / 12)


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_micro_batches_sum_to_full_batch_with_global_normalizer(mode):
    generator = torch.Generator().manual_seed(1)
    loss_mat = torch.randn(8, 5, generator=generator, dtype=torch.float64)
    mask = (torch.rand(8, 5, generator=generator) < 0.6).double()
    mask[2] = 0  # an empty row (e.g. padding) inside a micro-batch
    mask[5, 0] = 1
    full = aggregate_loss(loss_mat, mask, mode, norm_length=7)
    normalizer = get_loss_agg_mode(mode).count(mask)
    parts = [
        aggregate_loss(
            loss_mat[rows], mask[rows], mode, norm_length=7, global_normalizer=normalizer
        )
        for rows in (slice(0, 3), slice(3, 4), slice(4, 8))
    ]
    torch.testing.assert_close(sum(parts), full)
    # a python float normalizer works too
    floats = [
        aggregate_loss(
            loss_mat[r], mask[r], mode, norm_length=7, global_normalizer=float(normalizer)
        )
        for r in (slice(0, 5), slice(5, 8))
    ]
    torch.testing.assert_close(sum(floats), full)


def test_micro_batch_means_without_global_normalizer_do_not_sum_to_full():
    # why global_normalizer exists: per-micro-batch token means weight tokens unequally
    loss_mat = _t([[1.0, 1.0], [5.0, 0.0]])
    mask = _t([[1.0, 1.0], [1.0, 0.0]])
    full = aggregate_loss(loss_mat, mask, "token-mean")  # 7 / 3
    halves = sum(aggregate_loss(loss_mat[i : i + 1], mask[i : i + 1], "token-mean") for i in (0, 1))
    assert full.item() == pytest.approx(7 / 3)
    assert halves.item() == pytest.approx(1 + 5)  # 2/2 + 5/1, not 7/3


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_empty_mask_gives_zero_not_nan(mode):
    assert aggregate_loss(LOSS, torch.zeros_like(LOSS), mode).item() == 0.0


def test_aggregate_loss_rejects_bad_inputs():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate_loss(LOSS, MASK[:2], "token-mean")
    with pytest.raises(ValueError, match="global_normalizer"):
        aggregate_loss(LOSS, MASK, "token-mean", global_normalizer=0)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=0)


# --------------------------------------------------------------------------- policy loss


def _log_probs_for_ratios(ratios, old=None):
    ratios = _t(ratios)
    old = torch.full_like(ratios, -1.5) if old is None else old
    return old + ratios.log(), old


def test_policy_loss_hand_values_and_stats():
    # row 0, A = +1, ratios (1.0, 1.5, 0.5), clip range [0.8, 1.2]:
    #   r=1.0: max(-1, -1) = -1
    #   r=1.5: max(-1.5, -1.2) = -1.2           (clipped branch active)
    #   r=0.5: max(-0.5, -0.8) = -0.5           (unclipped)
    # row 1, A = -2, ratios (0.5, 1.1, 4.0), dual bound -A*c = 2*3 = 6:
    #   r=0.5: max(1.0, 1.6) = 1.6              (clipped branch active)
    #   r=1.1: max(2.2, 2.2) = 2.2              (neither)
    #   r=4.0: min(max(8, 2.4), 6) = 6          (dual clip active)
    log_probs, old = _log_probs_for_ratios([[1.0, 1.5, 0.5], [0.5, 1.1, 4.0]])
    advantages = _t([1.0, -2.0])
    mask = torch.ones(2, 3, dtype=torch.float64)
    loss, stats = policy_loss(log_probs, old, advantages, mask)
    assert loss.item() == pytest.approx((-1 - 1.2 - 0.5 + 1.6 + 2.2 + 6) / 6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 6)
    assert stats["dual_clip_fraction"].item() == pytest.approx(1 / 6)
    assert stats["ratio_mean"].item() == pytest.approx((1 + 1.5 + 0.5 + 0.5 + 1.1 + 4) / 6)
    assert stats["ratio_max"].item() == pytest.approx(4.0)
    # approx_kl = mean(old - new) = -mean(log r) = -ln(1 * 1.5 * .5 * .5 * 1.1 * 4) / 6
    assert stats["approx_kl"].item() == pytest.approx(-math.log(1.65) / 6)
    assert all(not value.requires_grad and value.dim() == 0 for value in stats.values())

    # masking the dual-clipped token: (-1 - 1.2 - 0.5 + 1.6 + 2.2) / 5 = 0.22
    mask[1, 2] = 0
    loss, stats = policy_loss(log_probs, old, advantages, mask)
    assert loss.item() == pytest.approx(0.22)
    assert stats["dual_clip_fraction"].item() == 0
    assert stats["ratio_max"].item() == pytest.approx(1.5)


def test_policy_loss_token_advantages_match_broadcast_sequence_advantages():
    log_probs, old = _log_probs_for_ratios([[1.0, 1.5, 0.5], [0.5, 1.1, 4.0]])
    mask = _t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    per_sequence, _ = policy_loss(log_probs, old, _t([1.0, -2.0]), mask)
    per_token, _ = policy_loss(log_probs, old, _t([[1.0] * 3, [-2.0] * 3]), mask)
    torch.testing.assert_close(per_sequence, per_token)


def test_clip_higher_is_asymmetric():
    # A = +1, r = 1.25: inside [0.8, 1.28] -> -1.25; with high 0.2 clipped -> -1.2
    log_probs, old = _log_probs_for_ratios([[1.25]])
    mask, advantages = torch.ones(1, 1), _t([1.0])
    loose, loose_stats = policy_loss(log_probs, old, advantages, mask, clip_ratio_high=0.28)
    tight, tight_stats = policy_loss(log_probs, old, advantages, mask, clip_ratio_high=0.2)
    assert loose.item() == pytest.approx(-1.25)
    assert tight.item() == pytest.approx(-1.2)
    assert (loose_stats["clip_fraction"].item(), tight_stats["clip_fraction"].item()) == (0, 1)
    # A = -1, r = 0.75: low 0.2 clips to 0.8 -> 0.8; low 0.3 leaves it -> 0.75
    log_probs, old = _log_probs_for_ratios([[0.75]])
    low_02, _ = policy_loss(log_probs, old, _t([-1.0]), mask, clip_ratio_low=0.2)
    low_03, _ = policy_loss(log_probs, old, _t([-1.0]), mask, clip_ratio_low=0.3)
    assert (low_02.item(), low_03.item()) == (pytest.approx(0.8), pytest.approx(0.75))


def test_dual_clip_bound_follows_clip_ratio_c():
    # A = -1, r = 10: PPO term max(10, 1.2) = 10, bounded by c: min(10, c)
    log_probs, old = _log_probs_for_ratios([[10.0]])
    for c in (2.0, 3.0, 5.0):
        loss, _ = policy_loss(log_probs, old, _t([-1.0]), torch.ones(1, 1), clip_ratio_c=c)
        assert loss.item() == pytest.approx(c)


def test_policy_loss_gradcheck_in_unclipped_region():
    generator = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 4, generator=generator, dtype=torch.float64) * 3
    log_ratio = (torch.rand(3, 4, generator=generator, dtype=torch.float64) - 0.5) * 0.2
    assert log_ratio.exp().min() > 0.8 and log_ratio.exp().max() < 1.2  # all unclipped
    log_probs = (old + log_ratio).requires_grad_(True)
    advantages = _t([1.5, -0.7, 0.3])
    mask = _t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]])
    for mode in sorted(LOSS_AGG_MODES):
        assert torch.autograd.gradcheck(
            lambda lp, mode=mode: policy_loss(lp, old, advantages, mask, loss_agg_mode=mode)[0],
            (log_probs,),
        )
    # analytically, token-mean: d/d logp_t (-A r_t) / N = -A r_t / N on masked tokens
    (grad,) = torch.autograd.grad(policy_loss(log_probs, old, advantages, mask)[0], log_probs)
    expected = -advantages[:, None] * log_ratio.exp() * mask / mask.sum()
    torch.testing.assert_close(grad, expected)


def test_gradient_is_zero_where_clipped_or_dual_clipped():
    # token: (A>0, r=1.5) clipped, (A>0, r=1.1) live, (A<0, r=0.5) clipped,
    #        (A<0, r=1.1) live, (A<0, r=4) dual-clipped
    ratios = [[1.5, 1.1, 1.0], [0.5, 1.1, 4.0]]
    log_probs, old = _log_probs_for_ratios(ratios)
    log_probs.requires_grad_(True)
    loss, _ = policy_loss(log_probs, old, _t([1.0, -1.0]), torch.ones(2, 3))
    (grad,) = torch.autograd.grad(loss, log_probs)
    assert grad[0, 0] == 0 and grad[1, 0] == 0 and grad[1, 2] == 0
    # live tokens: -A r / N
    assert grad[0, 1].item() == pytest.approx(-1.1 / 6)
    assert grad[1, 1].item() == pytest.approx(1.1 / 6)


def test_toy_policy_gradcheck_through_token_log_probs():
    # a toy policy: free logits [B=2, T=3, V=5] -> sampled-token log-probs -> policy loss
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 5, (2, 3), generator=generator)
    noise = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64) * 0.02
    old = token_log_probs(logits + noise, tokens)
    assert ((token_log_probs(logits, tokens) - old).exp() - 1).abs().max() < 0.2  # unclipped
    advantages, mask = _t([0.9, -1.1]), torch.ones(2, 3, dtype=torch.float64)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda z: policy_loss(token_log_probs(z, tokens, chunk_rows=2), old, advantages, mask)[0],
        (logits,),
    )


@settings(max_examples=50, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 5),
    data=st.data(),
)
def test_ratio_one_token_mean_loss_is_minus_mean_advantage(batch, length, data):
    floats = st.floats(-10, 10, allow_nan=False)
    advantages = _t(data.draw(st.lists(floats, min_size=batch, max_size=batch)))
    log_probs = _t(
        data.draw(st.lists(st.floats(-20, 0), min_size=batch * length, max_size=batch * length))
    ).view(batch, length)
    bits = data.draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length))
    mask = torch.tensor(bits).view(batch, length)
    loss, stats = policy_loss(log_probs, log_probs.clone(), advantages, mask)
    tokens = mask.sum()
    expected = -(advantages[:, None] * mask).sum() / tokens if tokens else torch.tensor(0.0)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-9)
    assert stats["clip_fraction"].item() == 0 and stats["dual_clip_fraction"].item() == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"clip_ratio_low": 1.0}, "clip_ratio_low"),
        ({"clip_ratio_high": -0.1}, "clip_ratio_high"),
        ({"loss_agg_mode": "sum"}, "valid names"),
    ],
)
def test_policy_loss_rejects_bad_config(kwargs, message):
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=message):
        policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), **kwargs)


def test_policy_loss_rejects_bad_shapes():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, torch.ones(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="same"):
        policy_loss(lp, lp[:, :2], torch.ones(2), torch.ones(2, 3))


# --------------------------------------------------------------------------- decoupled PPO


def _decoupled_case():
    """Two rows of four tokens: PPO ratios r = π_θ/π_prox, behaviour weights w = π_prox/μ.

    row 0, A = +1, mask (1, 1, 1, 0), r = (1.0, 1.1, 1.5, 1.0), w = (1.0, 4.0, 0.5, NaN)
    row 1, A = -1, mask (1, 1, 1, 1), r = (1.0, 0.5, 4.0, 1.0), w = (3.0, 2.5, 1.5, 1.0)
    The NaN behaviour log-prob sits on the masked-out token (padding).
    """
    log_probs, old = _log_probs_for_ratios([[1.0, 1.1, 1.5, 1.0], [1.0, 0.5, 4.0, 1.0]])
    weights = _t([[1.0, 4.0, 0.5, 1.0], [3.0, 2.5, 1.5, 1.0]])
    behaviour = old - weights.log()
    behaviour[0, 3] = math.nan
    mask = _t([[1, 1, 1, 0], [1, 1, 1, 1]])
    return log_probs, old, behaviour, _t([1.0, -1.0]), mask


# Hand values of _decoupled_case (clip range [0.8, 1.2], c = 3, tis_cap = 2):
#   PPO terms  row 0: -1, -1.1, max(-1.5, -1.2) = -1.2 (clipped)
#              row 1: 1, max(0.5, 0.8) = 0.8 (clipped), min(max(4, 1.2), 3) = 3 (dual), 1
#   × min(w, 2)  row 0: (1, 2, 0.5)     -> -1, -2.2, -0.6    sum -3.8 over 3 tokens
#                row 1: (2, 2, 1.5, 1)  ->  2, 1.6, 4.5, 1   sum  9.1 over 4 tokens


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (-3.8 + 9.1) / 7),
        ("seq-mean-token-mean", (-3.8 / 3 + 9.1 / 4) / 2),
        ("seq-mean-token-sum", (-3.8 + 9.1) / 2),
        ("seq-mean-token-sum-norm", (-3.8 + 9.1) / (2 * 4)),
    ],
)
def test_decoupled_policy_loss_hand_values(mode, expected):
    log_probs, old, behaviour, advantages, mask = _decoupled_case()
    loss, _ = decoupled_policy_loss(
        log_probs,
        old,
        behaviour,
        advantages,
        mask,
        tis_cap=2.0,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
    )
    assert loss.item() == pytest.approx(expected)


def test_decoupled_policy_loss_stats():
    log_probs, old, behaviour, advantages, mask = _decoupled_case()
    _, stats = decoupled_policy_loss(
        log_probs, old, behaviour, advantages, mask, tis_cap=2.0, clip_ratio_c=3.0
    )
    # untruncated weights of the 7 masked-in tokens: 1, 4, 0.5, 3, 2.5, 1.5, 1
    assert stats["importance_ratio_mean"].item() == pytest.approx(13.5 / 7)
    assert stats["importance_ratio_max"].item() == pytest.approx(4.0)
    assert stats["tis_clipped_fraction"].item() == pytest.approx(3 / 7)  # 4, 3 and 2.5
    # the PPO stats are policy_loss's, of r = π_θ / π_prox
    assert stats["clip_fraction"].item() == pytest.approx(2 / 7)
    assert stats["dual_clip_fraction"].item() == pytest.approx(1 / 7)
    assert stats["ratio_max"].item() == pytest.approx(4.0)
    assert all(not value.requires_grad and value.dim() == 0 for value in stats.values())
    # a cap above every weight truncates nothing
    _, loose = decoupled_policy_loss(log_probs, old, behaviour, advantages, mask, tis_cap=5.0)
    assert loose["tis_clipped_fraction"].item() == 0


def test_decoupled_policy_loss_empty_mask_gives_zeros():
    log_probs, old, behaviour, advantages, mask = _decoupled_case()
    loss, stats = decoupled_policy_loss(
        log_probs, old, behaviour, advantages, torch.zeros_like(mask)
    )
    assert loss.item() == 0
    for name in ("importance_ratio_mean", "importance_ratio_max", "tis_clipped_fraction"):
        assert stats[name].item() == 0


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_decoupled_policy_loss_is_policy_loss_when_behaviour_is_proximal(mode):
    generator = torch.Generator().manual_seed(4)
    old = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    log_ratio = torch.randn(3, 5, generator=generator, dtype=torch.float64) * 0.5  # some clip
    advantages = _t([1.5, -0.7, -2.0])
    mask = _t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 1, 0]])
    kwargs = {"loss_agg_mode": mode, "clip_ratio_high": 0.28, "clip_ratio_c": 2.0}
    results = []
    for loss_fn in (policy_loss, decoupled_policy_loss):
        log_probs = (old + log_ratio).requires_grad_(True)
        extra = (old.clone(),) if loss_fn is decoupled_policy_loss else ()
        loss, stats = loss_fn(log_probs, old, *extra, advantages, mask, **kwargs)
        (grad,) = torch.autograd.grad(loss, log_probs)
        results.append((loss, grad, stats))
    (plain, plain_grad, plain_stats), (decoupled, decoupled_grad, decoupled_stats) = results
    assert plain_stats["clip_fraction"] > 0  # the case exercises the clipped branches
    assert torch.equal(plain, decoupled) and torch.equal(plain_grad, decoupled_grad)
    for name, value in plain_stats.items():
        assert torch.equal(value, decoupled_stats[name]), name
    assert decoupled_stats["importance_ratio_mean"].item() == 1
    assert decoupled_stats["importance_ratio_max"].item() == 1
    assert decoupled_stats["tis_clipped_fraction"].item() == 0


def test_decoupled_gradient_is_truncated_weight_times_ppo_gradient():
    log_probs, old, behaviour, advantages, mask = _decoupled_case()
    log_probs.requires_grad_(True)
    loss, _ = decoupled_policy_loss(
        log_probs, old, behaviour, advantages, mask, tis_cap=2.0, clip_ratio_c=3.0
    )
    (grad,) = torch.autograd.grad(loss, log_probs)
    # live tokens: w·(-A·r)/N with N = 7; clipped (0,2), (1,1), dual (1,2), masked (0,3): 0
    expected = _t([[-1 * 1.0, -2 * 1.1, 0, 0], [2 * 1.0, 0, 0, 1 * 1.0]]) / 7
    torch.testing.assert_close(grad, expected)


def test_decoupled_gradcheck_in_unclipped_region():
    generator = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 4, generator=generator, dtype=torch.float64) * 3
    log_ratio = (torch.rand(3, 4, generator=generator, dtype=torch.float64) - 0.5) * 0.2
    behaviour = old + torch.randn(3, 4, generator=generator, dtype=torch.float64)
    log_probs = (old + log_ratio).requires_grad_(True)
    advantages = _t([1.5, -0.7, 0.3])
    mask = _t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]])
    for mode in sorted(LOSS_AGG_MODES):
        assert torch.autograd.gradcheck(
            lambda lp, mode=mode: decoupled_policy_loss(
                lp, old, behaviour, advantages, mask, loss_agg_mode=mode
            )[0],
            (log_probs,),
        )
    (grad,) = torch.autograd.grad(
        decoupled_policy_loss(log_probs, old, behaviour, advantages, mask)[0], log_probs
    )
    weight = (old - behaviour).exp().clamp(max=2.0)
    expected = -weight * advantages[:, None] * log_ratio.exp() * mask / mask.sum()
    torch.testing.assert_close(grad, expected)


def test_importance_weight_carries_no_gradient():
    log_probs, old, behaviour, advantages, mask = _decoupled_case()
    behaviour[0, 3] = 0.0
    old, behaviour = old.requires_grad_(True), behaviour.requires_grad_(True)
    log_probs.requires_grad_(True)
    loss, _ = decoupled_policy_loss(log_probs, old, behaviour, advantages, mask)
    loss.backward()
    assert behaviour.grad is None  # the weight is not in the graph
    # old_log_probs enters only through r = exp(log_probs - old): its gradient is exactly
    # minus the gradient w.r.t. log_probs (a weight with gradient would add w·l_ppo terms)
    torch.testing.assert_close(old.grad, -log_probs.grad)


@pytest.mark.parametrize("correction", sorted(ROLLOUT_CORRECTIONS))
def test_decoupled_micro_batches_sum_to_full_batch(correction):
    generator = torch.Generator().manual_seed(6)
    old = -torch.rand(4, 3, generator=generator, dtype=torch.float64) * 3
    log_probs = old + torch.randn(4, 3, generator=generator, dtype=torch.float64) * 0.3
    behaviour = old + torch.randn(4, 3, generator=generator, dtype=torch.float64)
    advantages = _t([1.0, -0.5, 2.0, -1.5])
    mask = _t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    for mode in sorted(LOSS_AGG_MODES):
        kwargs = {"loss_agg_mode": mode, "correction": correction, "seq_mask_low": 0.5}
        full, _ = decoupled_policy_loss(log_probs, old, behaviour, advantages, mask, **kwargs)
        normalizer = get_loss_agg_mode(mode).count(mask)
        parts = [
            decoupled_policy_loss(
                log_probs[rows],
                old[rows],
                behaviour[rows],
                advantages[rows],
                mask[rows],
                global_normalizer=normalizer,
                **kwargs,
            )[0]
            for rows in (slice(0, 2), slice(2, 4))
        ]
        torch.testing.assert_close(sum(parts), full)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["behaviour_log_probs", "old_log_probs"])
def test_decoupled_non_finite_log_probs_raise_naming_positions(bad, name):
    log_probs, old, behaviour, advantages, mask = _decoupled_case()
    (behaviour if name == "behaviour_log_probs" else old)[1, 2] = bad
    with pytest.raises(ValueError, match=rf"{name} are NaN or infinite at .*\[1, 2\]"):
        decoupled_policy_loss(log_probs, old, behaviour, advantages, mask)


def test_decoupled_policy_loss_rejects_bad_cap_and_shapes():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="tis_cap"):
        decoupled_policy_loss(lp, lp, lp, torch.ones(1), torch.ones(1, 2), tis_cap=1.0)
    with pytest.raises(ValueError, match="behaviour_log_probs"):
        decoupled_policy_loss(lp, lp, lp[:, :1], torch.ones(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        decoupled_policy_loss(lp, lp, lp, torch.ones(1), torch.ones(1, 2), clip_ratio_c=1.0)


# --------------------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    log_probs = _t([math.log(0.5), math.log(0.25)])
    ref = _t([math.log(0.25), math.log(0.5)])
    # k1 = log p - log q = [ln 2, -ln 2]
    torch.testing.assert_close(kl_penalty(log_probs, ref, "k1"), _t([LN2, -LN2]))
    # k2 = (ln 2)^2 / 2 for both
    torch.testing.assert_close(kl_penalty(log_probs, ref, "k2"), _t([LN2**2 / 2] * 2))
    # k3: d = log q - log p = [-ln 2, ln 2]; e^d - d - 1 = [0.5 + ln2 - 1, 2 - ln2 - 1]
    expected = _t([LN2 - 0.5, 1 - LN2])
    torch.testing.assert_close(kl_penalty(log_probs, ref, "k3"), expected)
    torch.testing.assert_close(kl_penalty(log_probs, ref, "low_var_kl"), expected)


def test_k3_is_clamped_to_ten():
    # d = 50 - 0 -> clamped to 20 -> e^20 - 21 ~ 4.9e8 -> clamped to 10
    assert kl_penalty(_t([0.0]), _t([50.0]), "k3").item() == 10.0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=20),
)
def test_k3_is_non_negative_and_zero_when_equal(pairs):
    log_probs = _t([p for p, _ in pairs])
    ref = _t([q for _, q in pairs])
    assert (kl_penalty(log_probs, ref, "k3") >= 0).all()
    assert torch.equal(kl_penalty(log_probs, log_probs, "k3"), torch.zeros_like(log_probs))


def test_k3_of_a_tiny_difference_is_not_negative():
    # exp(δ) - δ - 1 rounds to -1.1e-16 here (hypothesis found such a pair)
    a = -0.005060600463664855
    assert kl_penalty(_t([a]), _t([a + 1e-8]), "k3").item() >= 0


def test_kl_loss_aggregates_the_penalty():
    log_probs = _t([[math.log(0.5), math.log(0.25)], [0.0, 0.0]])
    ref = _t([[math.log(0.25), math.log(0.5)], [-1.0, 0.0]])
    mask = _t([[1.0, 1.0], [1.0, 0.0]])
    # k1 tokens: ln2, -ln2, 1 (masked out: 0) -> token-mean (ln2 - ln2 + 1) / 3 = 1/3
    assert kl_loss(log_probs, ref, mask, "k1", "token-mean").item() == pytest.approx(1 / 3)
    # k2 tokens: ln2^2/2, ln2^2/2, 1/2 -> seq-mean-token-sum: (ln2^2 + 1/2) / 2
    loss = kl_loss(log_probs, ref, mask, "k2", "seq-mean-token-sum")
    assert loss.item() == pytest.approx((LN2**2 + 0.5) / 2)


def test_kl_penalty_rejects_unknown_kind_and_shape_mismatch():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        kl_penalty(_t([0.0]), _t([0.0]), "k4")
    with pytest.raises(ValueError, match="ref_log_probs"):
        kl_penalty(_t([0.0]), _t([0.0, 1.0]), "k1")


# --------------------------------------------------------------------------- logits


def test_entropy_hand_values():
    logits = _t(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [0.0, 0.0, LN2, -math.inf],  # p = (1/4, 1/4, 1/2, 0): 1.5 ln 2
            [1000.0, 1000.0, -1000.0, -1000.0],  # two equal large logits: ln 2
        ]
    )
    expected = _t([math.log(4), 1.5 * LN2, LN2])
    torch.testing.assert_close(entropy_from_logits(logits), expected)


@pytest.mark.parametrize("vocab", [2, 7, 1000])
def test_entropy_of_uniform_logits_is_log_vocab(vocab):
    logits = torch.full((2, 3, vocab), 4.2)
    torch.testing.assert_close(
        entropy_from_logits(logits, chunk_rows=4), torch.full((2, 3), math.log(vocab))
    )


def test_entropy_gradient_is_finite_with_masked_vocab():
    logits = _t([[0.3, -1.0, -math.inf]]).requires_grad_(True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_token_log_probs_hand_values_and_reference():
    # p = softmax(0, 0, ln 2) = (1/4, 1/4, 1/2)
    logits = _t([[[0.0, 0.0, LN2], [0.0, 0.0, LN2]]])
    tokens = torch.tensor([[2, 0]])
    torch.testing.assert_close(token_log_probs(logits, tokens), _t([[-LN2, -2 * LN2]]))

    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 11, generator=generator) * 5
    tokens = torch.randint(0, 11, (3, 5), generator=generator)
    reference = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    for chunk_rows in (1, 4, 1024):
        torch.testing.assert_close(
            token_log_probs(logits, tokens, chunk_rows=chunk_rows), reference
        )
    low_precision = token_log_probs(logits.bfloat16(), tokens, chunk_rows=4)
    assert low_precision.dtype == torch.float32
    bf16_reference = torch.log_softmax(logits.bfloat16().float(), -1)
    torch.testing.assert_close(
        low_precision, bf16_reference.gather(-1, tokens[..., None]).squeeze(-1)
    )


def test_token_log_probs_rejects_mismatched_ids():
    with pytest.raises(ValueError, match="token_ids"):
        token_log_probs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        token_log_probs(torch.zeros(2, 3, 5), torch.zeros(2, 3))


# --------------------------------------------------------------------------- registries


def test_registries_return_entries_and_list_valid_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "low_var_kl"}
    assert set(LOSS_AGG_MODES) == {
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    }
    rewards = _t([0.0, 1.0])
    torch.testing.assert_close(
        get_advantage_estimator("grpo")(rewards, 2), group_advantages(rewards, 2)
    )
    assert get_kl_estimator("low_var_kl") is KL_ESTIMATORS["k3"]
    assert get_loss_agg_mode("token-mean") is LOSS_AGG_MODES["token-mean"]
    with pytest.raises(ValueError, match="advantage estimator 'ppo'; valid names: dr_grpo, grpo"):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match="KL estimator 'kl'"):
        get_kl_estimator("kl")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm, token-mean"):
        get_loss_agg_mode("mean")


def test_both_policy_losses_are_registered_under_one_signature():
    """``POLICY_LOSSES`` entries, called as the update calls them, give the functions'
    values (the hand-checked case: ``_decoupled_case``), clipping and correction from the
    settings."""
    assert {"ppo", "decoupled"} <= set(POLICY_LOSSES)  # and issue #43's ppo_clip, gspo
    log_probs, old, behaviour, advantages, mask = _decoupled_case()
    clipping = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 3.0}
    clipping |= {"loss_agg_mode": "seq-mean-token-sum-norm", "norm_length": 6}
    clipping |= {"global_normalizer": 2.5}
    settings = PolicyLossSettings(**clipping, correction="seq_tis", tis_cap=1.5)
    inputs = PolicyLossInputs(log_probs, old, behaviour, advantages, mask)
    got, got_stats = get_policy_loss("ppo")(inputs, settings)
    want, want_stats = policy_loss(log_probs, old, advantages, mask, **clipping)
    assert got.item() == want.item() and got_stats.keys() == want_stats.keys()
    got, got_stats = get_policy_loss("decoupled")(inputs, settings)
    want, want_stats = decoupled_policy_loss(
        log_probs, old, behaviour, advantages, mask, correction="seq_tis", tis_cap=1.5, **clipping
    )
    assert got.item() == want.item()
    assert {k: v.item() for k, v in got_stats.items()} == {
        k: v.item() for k, v in want_stats.items()
    }
    with pytest.raises(ValueError, match="behaviour policy's log-probs"):
        get_policy_loss("decoupled")(inputs._replace(behaviour_log_probs=None), settings)
    valid = "decoupled, gspo, ppo, ppo_clip"
    with pytest.raises(ValueError, match=f"policy loss 'grpo'; valid names: {valid}"):
        get_policy_loss("grpo")
