"""GRPO math as pure tensor functions, selected by name from small registries.

Shapes: ``B`` sequences (rollouts), ``T`` response tokens, ``V`` vocabulary entries.
Token tensors are ``[B, T]`` with a 0/1 ``response_mask`` marking the tokens that count.
Every function here is side-effect free; the training loop wires them together.

Registries (validate config names once with the ``get_*`` functions):

- ``ADVANTAGE_ESTIMATORS``: ``grpo`` (group-normalized by std), ``dr_grpo`` (mean-centred).
- ``KL_ESTIMATORS``: ``k1``, ``k2``, ``k3`` (alias ``low_var_kl``).
- ``LOSS_AGG_MODES``: ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
  ``seq-mean-token-sum-norm``.
- ``ROLLOUT_CORRECTIONS``: ``none``, ``token_tis``, ``seq_tis``, ``seq_mask`` (how the gap
  between the engine that sampled and the trainer is corrected).
- ``POLICY_LOSSES``: ``ppo_clip`` (``ppo`` on-policy, ``decoupled`` when the engine recorded
  its log-probs), ``gspo`` (``gspo_policy_loss``: the sequence-level ratio), ``ppo``
  (``policy_loss``), ``decoupled`` (``decoupled_policy_loss``), each called as
  ``loss(PolicyLossInputs, PolicyLossSettings)``; ``algorithm.policy_loss`` names one.

``overlong_penalty`` is DAPO's soft overlong punishment, added to the rewards.

One module per family, each with its registry and ``get_*``: ``advantages``, ``aggregation``,
``correction``, ``kl``, ``losses``; ``log_probs`` (log-probs and entropy of logits) below
them all. Everything is re-exported here: ``from trainer.grpo import algorithm as algo``.
"""

from __future__ import annotations

from trainer.grpo.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    GroupStats,
    dr_grpo_advantages,
    get_advantage_estimator,
    group_advantages,
    group_stats,
    grpo_advantages,
    overlong_penalty,
)
from trainer.grpo.algorithm.aggregation import (
    LOSS_AGG_MODES,
    LossAggregation,
    aggregate_loss,
    check_finite_tokens,
    get_loss_agg_mode,
    masked_mean,
)
from trainer.grpo.algorithm.correction import (
    ROLLOUT_CORRECTIONS,
    CorrectionBounds,
    RolloutWeights,
    correction_none,
    correction_seq_mask,
    correction_seq_tis,
    correction_stats,
    correction_token_tis,
    get_rollout_correction,
    rollout_weights,
)
from trainer.grpo.algorithm.kl import (
    K3_CLAMP,
    KL_ESTIMATORS,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    kl_penalty,
)
from trainer.grpo.algorithm.log_probs import LOG_RATIO_CLAMP, entropy_from_logits, token_log_probs
from trainer.grpo.algorithm.losses import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossInputs,
    PolicyLossSettings,
    decoupled_loss,
    decoupled_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    policy_loss,
    ppo_clip_loss,
    ppo_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CorrectionBounds",
    "GroupStats",
    "K3_CLAMP",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "LossAggregation",
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossInputs",
    "PolicyLossSettings",
    "ROLLOUT_CORRECTIONS",
    "RolloutWeights",
    "aggregate_loss",
    "check_finite_tokens",
    "correction_none",
    "correction_seq_mask",
    "correction_seq_tis",
    "correction_stats",
    "correction_token_tis",
    "decoupled_loss",
    "decoupled_policy_loss",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_loss_agg_mode",
    "get_policy_loss",
    "get_rollout_correction",
    "group_advantages",
    "group_stats",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip_loss",
    "ppo_loss",
    "rollout_weights",
    "token_log_probs",
]
