"""RL math on token tensors: masked statistics, GAE, group and per-token advantages, log-probs, KL
estimators and controllers, rollout/trainer mismatch and DAPO sample filters (and their settings)."""

from alignlit.ops.advantages import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    TokenAdvantageEstimator,
    group_advantages,
    register_advantage,
    register_token_advantage,
)
from alignlit.ops.dapo import DynamicSampling, Overlong, informative_groups, overlong_mask, overlong_penalty
from alignlit.ops.gae import gae
from alignlit.ops.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLKind,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
)
from alignlit.ops.logprobs import entropy_from_logits, gather_logprobs, sequence_logprobs
from alignlit.ops.mismatch import logprob_mismatch, truncated_is_weights
from alignlit.ops.reward_shaping import (
    RewardNorm,
    explained_variance,
    kl_penalized_rewards,
    length_reward_correlation,
    normalize_scores,
)
from alignlit.ops.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    correction_metrics,
    register_rollout_correction,
    resolve_rollout_correction,
)
from alignlit.ops.stats import (
    AllReduce,
    RunningMoments,
    check_ndim,
    check_same_shape,
    global_moments,
    masked_mean,
    masked_sum,
    masked_var,
    whiten,
)
from alignlit.ops.token_advantages import reinforce_pp_returns, token_advantages
from alignlit.ops.token_budget import token_budget_microbatches

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "TOKEN_ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AllReduce",
    "DynamicSampling",
    "FixedKLController",
    "KLKind",
    "Overlong",
    "RewardNorm",
    "RunningMoments",
    "TokenAdvantageEstimator",
    "check_ndim",
    "check_same_shape",
    "correction_metrics",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "gather_logprobs",
    "global_moments",
    "group_advantages",
    "informative_groups",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalized_rewards",
    "length_reward_correlation",
    "logprob_mismatch",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "normalize_scores",
    "overlong_mask",
    "overlong_penalty",
    "register_advantage",
    "register_rollout_correction",
    "register_token_advantage",
    "reinforce_pp_returns",
    "resolve_rollout_correction",
    "sequence_logprobs",
    "token_advantages",
    "token_budget_microbatches",
    "truncated_is_weights",
    "whiten",
]
