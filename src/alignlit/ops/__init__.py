"""RL math on token tensors: masked statistics, GAE, log-probs, KL estimators and controllers."""

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
from alignlit.ops.stats import (
    RunningMoments,
    check_ndim,
    check_same_shape,
    masked_mean,
    masked_sum,
    masked_var,
    whiten,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLKind",
    "RunningMoments",
    "check_ndim",
    "check_same_shape",
    "entropy_from_logits",
    "gae",
    "gather_logprobs",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "sequence_logprobs",
    "whiten",
]
