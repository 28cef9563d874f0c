"""Critic-free advantage estimators over groups of samples (algorithms.md §10).

A group is the ``n`` responses sampled for one prompt: ``rewards[i, j]`` is the sequence reward of
prompt ``i``'s sample ``j``, shape (B, n), and every estimator returns one advantage per sample,
shape (B, n), which the policy-gradient loss broadcasts over the sample's tokens. Estimators are
small pure functions in :data:`ADVANTAGE_ESTIMATORS`, keyed by the name a config uses; research code
adds one with :func:`register_advantage`. REINFORCE++ with its token-level KL penalty needs per-token
inputs and is :func:`reinforce_pp_returns`.

Several data-parallel ranks: a group never spans ranks (a rank samples all ``n`` responses of its
prompts), so the per-group estimators need nothing from the other ranks; statistics over the whole
batch (REINFORCE++'s whitening, REINFORCE++-baseline's standard deviation) take an optional
``all_reduce`` (:data:`alignlit.ops.stats.AllReduce`, a sum over the ranks) and are then those of the
global batch, as one process computes them on it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from alignlit.ops.gae import gae
from alignlit.ops.rewards import kl_penalized_rewards
from alignlit.ops.stats import AllReduce, check_ndim, check_same_shape, global_moments, whiten

AdvantageEstimator = Callable[..., torch.Tensor]
"""``fn(rewards (B, n), *, eps: float) -> advantages (B, n)``; ``rewards`` is finite and floating. An
estimator that takes statistics over the whole batch (not only over each group) also takes
``all_reduce: AllReduce | None = None`` and, when it is given, takes them over every rank's batch;
:func:`group_advantages` passes it to the estimators whose signature has it."""

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
"""Group advantage estimators by name (the value of ``estimator`` in :func:`group_advantages`)."""

_PER_TOKEN_ESTIMATORS = {"reinforce_pp": "alignlit.ops.reinforce_pp_returns"}


def register_advantage(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding ``fn(rewards (B, n), *, eps) -> (B, n)`` to :data:`ADVANTAGE_ESTIMATORS` as ``name``
    (with an ``all_reduce`` keyword when it uses statistics of the whole batch, see :data:`AdvantageEstimator`).

    Raises ``ValueError`` when ``name`` is already registered (a second estimator never silently
    replaces the first).
    """

    def decorate(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS or name in _PER_TOKEN_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorate


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, *, eps: float) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + ε)``.

    The standard deviation is the population one (divide by ``n``) over the group; a group whose
    rewards are all equal gets advantages 0.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # (B, 1)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)  # (B, 1)
    return (rewards - mean) / (std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, *, eps: float) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): ``A_ij = r_ij - mean_j r_ij`` (no division by the group std)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor, *, eps: float) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): ``A_ij = r_ij - (1/(n-1))·Σ_{k≠j} r_ik``.

    The baseline of each sample is the mean reward of the other samples of its prompt (the
    leave-one-out baseline of Kool et al. 2019), so it does not depend on the sample itself.
    Equal to ``n/(n-1)·(r_ij - mean_j r_ij)``; needs ``n ≥ 2``.
    """
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(
            f"rloo needs at least 2 samples per prompt (rewards of shape (B, n >= 2)), got n={n}"
        )
    leave_one_out = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)  # (B, n)
    return rewards - leave_one_out


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, *, eps: float, all_reduce: AllReduce | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): ``c_ij = r_ij - mean_j r_ij``, ``A_ij = c_ij / (std(c) + ε)``.

    The group mean removes the prompt's difficulty; the standard deviation is the population one
    over all ``B·n`` centred values of the batch, so every group is scaled by the same number. With
    ``all_reduce`` (a sum over the data-parallel ranks) it is over the centred values of every rank
    (:func:`~alignlit.ops.stats.global_moments`, float64).
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # (B, n)
    if all_reduce is None:
        return centred / (centred.std(unbiased=False) + eps)
    count, _, m2 = global_moments(centred, torch.ones_like(centred, dtype=torch.bool), all_reduce)
    std = (m2 / count).sqrt().to(centred.dtype)
    return centred / (std + eps)


def _as_float(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        return tensor
    if tensor.is_complex():
        raise ValueError(f"{name} must be real, got dtype {tensor.dtype}")
    return tensor.to(torch.get_default_dtype())


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    bad = ~torch.isfinite(tensor)
    if bad.any():
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{name} must be finite; found {int(bad.sum())} non-finite value(s), the first at index "
            f"{tuple(first)}: {tensor[tuple(first)].item()}"
        )


def _takes_all_reduce(fn: AdvantageEstimator) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature
        return False
    return "all_reduce" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def group_advantages(
    rewards: torch.Tensor,
    *,
    estimator: str | AdvantageEstimator,
    eps: float = 1e-6,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """Per-sample advantages from the rewards of ``n`` samples per prompt (algorithms.md §10).

    Args:
        rewards: (B, n) sequence rewards, prompt ``i``'s samples in row ``i``; integer or boolean
            rewards (e.g. 0/1 correctness) are converted to the default float dtype.
        estimator: a name in :data:`ADVANTAGE_ESTIMATORS` (``"grpo"``, ``"dr_grpo"``, ``"rloo"``,
            ``"reinforce_pp_baseline"``, or one added with :func:`register_advantage`), or such a
            function itself.
        eps: ``ε ≥ 0`` added to standard deviations before dividing.
        all_reduce: with several data-parallel ranks, a sum over them
            (:data:`~alignlit.ops.stats.AllReduce`), passed on to an estimator that takes statistics
            of the whole batch (``"reinforce_pp_baseline"``; see :data:`AdvantageEstimator`) so that they
            are those of the global batch; the per-group estimators do not need it. None: one process.

    Returns:
        (B, n) advantages, same dtype as the (float) rewards.
    """
    check_ndim("rewards", rewards, 2, "(B, n)")
    if rewards.shape[0] == 0 or rewards.shape[1] == 0:
        raise ValueError(
            f"rewards must hold at least one prompt and one sample, got shape {tuple(rewards.shape)}"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards = _as_float("rewards", rewards)
    _check_finite("rewards", rewards)
    if callable(estimator):
        fn = estimator
    elif estimator in ADVANTAGE_ESTIMATORS:
        fn = ADVANTAGE_ESTIMATORS[estimator]
    elif estimator in _PER_TOKEN_ESTIMATORS:
        raise ValueError(
            f"estimator {estimator!r} needs per-token KL and a token mask, not only (B, n) rewards; "
            f"use {_PER_TOKEN_ESTIMATORS[estimator]}"
        )
    else:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; expected one of {sorted(ADVANTAGE_ESTIMATORS)} "
            "(or register one with alignlit.ops.register_advantage)"
        )
    if all_reduce is not None and _takes_all_reduce(fn):
        advantages = fn(rewards, eps=eps, all_reduce=all_reduce)
    else:
        advantages = fn(rewards, eps=eps)
    if advantages.shape != rewards.shape:
        raise ValueError(
            f"advantage estimator {estimator!r} returned shape {tuple(advantages.shape)}, expected the "
            f"shape of rewards {tuple(rewards.shape)}"
        )
    return advantages


def reinforce_pp_returns(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float = 1.0,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """REINFORCE++ token advantages (Hu et al. 2025; algorithms.md §10): KL-shaped returns, whitened.

    Token rewards ``r_t = -β·kl_t`` on every response token, plus the sequence reward ``R`` on the
    last valid token; returns ``G_t = Σ_{s≥t} γ^{s-t}·r_s`` over the sample's valid tokens (no critic,
    no bootstrapping); advantages are ``G`` whitened over all valid tokens of the batch,
    ``(G - mean) / sqrt(var + 1e-8)`` with the unbiased variance (:func:`alignlit.ops.whiten`). The
    token rewards are PPO's (:func:`alignlit.ops.kl_penalized_rewards`) and the returns are GAE with
    ``V ≡ 0`` and ``λ = 1``, so :func:`alignlit.ops.gae` computes them. A row without valid tokens
    (no response token to carry its score) gets advantages 0 everywhere.

    Args:
        scores: (N,) sequence rewards ``R`` (e.g. the reward model's score, normalised or not).
        kl: (N, T) per-token KL estimate between the policy and the reference on the sampled tokens
            (e.g. ``alignlit.ops.kl_estimate(old_logprobs, ref_logprobs, "k1")``); ignored at padding.
        mask: (N, T) 1 on response tokens; right-padded. At least 2 valid tokens in the batch.
        kl_coef: ``β ≥ 0``.
        gamma: discount ``γ ∈ [0, 1]``; REINFORCE++ uses 1.
        all_reduce: with several data-parallel ranks, a sum over them
            (:data:`~alignlit.ops.stats.AllReduce`): the returns are whitened over the valid tokens of
            every rank (the global batch), and the 2 valid tokens are counted over all ranks (a rank
            may hold none). None: one process.

    Returns:
        (N, T) advantages, 0 at padding. Call it on detached tensors.
    """
    check_ndim("kl", kl, 2, "(N, T)")
    check_same_shape(kl=kl, mask=mask)
    check_ndim("scores", scores, 1, "(N,)")
    if scores.shape[0] != kl.shape[0]:
        raise ValueError(f"scores has {scores.shape[0]} rows but kl has {kl.shape[0]}; they must be equal")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    valid = mask.bool()  # (N, T)
    if all_reduce is None and int(valid.sum()) < 2:
        raise ValueError(
            f"mask has {int(valid.sum())} valid token(s); whitening the returns needs at least 2"
        )
    kl = _as_float("kl", kl)
    scores = _as_float("scores", scores).to(kl.dtype)
    _check_finite("scores", scores)
    kl = torch.where(valid, kl, torch.zeros_like(kl))  # (N, T), padding may hold anything
    _check_finite("kl (at valid tokens)", kl)
    rewards = kl_penalized_rewards(scores, kl, valid, kl_coef=kl_coef)  # (N, T)
    returns, _ = gae(rewards, torch.zeros_like(rewards), valid, gamma=gamma, lam=1.0)  # (N, T)
    return whiten(returns, valid, all_reduce=all_reduce)
