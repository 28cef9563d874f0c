"""Pure loss functions: each takes tensors and returns ``(loss, metrics)`` with detached metrics."""

from alignlit.losses.distill import generalized_jsd, generalized_jsd_loss
from alignlit.losses.dpo import dpo_loss, implicit_rewards, ipo_loss, reward_metrics, rpo_sft_term
from alignlit.losses.kto import kto_loss, kto_reference_point
from alignlit.losses.lm import Reduction, masked_nll, shift_for_next_token
from alignlit.losses.policy_gradient import (
    AGGREGATION_UNITS,
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregation_share,
    policy_gradient_loss,
    register_aggregation,
)
from alignlit.losses.policy_losses import POLICY_LOSSES, PolicyLoss, register_policy_loss
from alignlit.losses.ppo import entropy_bonus, ppo_policy_loss, ppo_value_loss
from alignlit.losses.preference import (
    ab_order_averaged_probability,
    ab_preference_loss,
    ab_probability,
    bradley_terry_loss,
    length_decorrelation_loss,
    pearson_correlation,
    reward_model_loss,
    score_l2_loss,
)
from alignlit.losses.preference_registry import (
    PREFERENCE_LOSSES,
    BoundPreferenceLoss,
    PairLogps,
    PreferenceLoss,
    ReferenceLogps,
    preference_loss,
    register_preference_loss,
)
from alignlit.losses.rrhf import rrhf_loss

__all__ = [
    "AGGREGATION_UNITS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "BoundPreferenceLoss",
    "LossAggregation",
    "PairLogps",
    "PolicyLoss",
    "PreferenceLoss",
    "Reduction",
    "ReferenceLogps",
    "ab_order_averaged_probability",
    "ab_preference_loss",
    "ab_probability",
    "aggregation_share",
    "bradley_terry_loss",
    "dpo_loss",
    "entropy_bonus",
    "generalized_jsd",
    "generalized_jsd_loss",
    "implicit_rewards",
    "ipo_loss",
    "kto_loss",
    "kto_reference_point",
    "length_decorrelation_loss",
    "masked_nll",
    "pearson_correlation",
    "policy_gradient_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "preference_loss",
    "register_aggregation",
    "register_policy_loss",
    "register_preference_loss",
    "reward_metrics",
    "reward_model_loss",
    "rpo_sft_term",
    "rrhf_loss",
    "score_l2_loss",
    "shift_for_next_token",
]
