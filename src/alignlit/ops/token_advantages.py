"""Per-token advantage estimators (algorithms.md §12): per-token rewards (N, T), and a critic's values where
the estimator uses one, to per-token advantages and returns (N, T): PPO's GAE, discounted returns,
REINFORCE++. The registry and its namespace are :mod:`alignlit.ops.advantages`'s
(:data:`~alignlit.ops.advantages.TOKEN_ADVANTAGE_ESTIMATORS`, :func:`~alignlit.ops.advantages.register_token_advantage`);
:func:`token_advantages` calls them, and :func:`reinforce_pp_returns` builds REINFORCE++'s token rewards
from sequence scores and token KL. Masks may have gaps (the environment's tokens of a multi-turn episode):
the estimators then run on the model's tokens packed together.
"""

from __future__ import annotations

import torch

from alignlit.ops.advantages import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_ADVANTAGE_ESTIMATORS,
    TokenAdvantageEstimator,
    _as_float,
    _check_finite,
    _on_valid,
    _unknown,
    register_token_advantage,
)
from alignlit.ops.gae import gae
from alignlit.ops.reward_shaping import kl_penalized_rewards
from alignlit.ops.stats import AllReduce, check_ndim, check_same_shape, whiten


def _without_critic(name: str, values: torch.Tensor | None, lam: float) -> None:
    if values is not None:
        raise ValueError(f"advantage estimator {name!r} uses no critic, but values were given (use 'gae')")
    if lam != 1.0:
        raise ValueError(
            f"advantage estimator {name!r} has no λ (without a critic V ≡ 0 and λ = 1), got lam={lam}"
        )


@register_token_advantage("gae")
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's generalised advantage estimates (Schulman et al. 2016; algorithms.md §4), :func:`~alignlit.ops.gae`:
    ``δ_t = r_t + γ·V(s_{t+1}) - V(s_t)``, ``A_t = Σ_l (γλ)^l·δ_{t+l}``, returns ``A_t + V(s_t)``.

    Needs the critic's values; the advantages are not whitened here (PPO does that on its batch, §4).
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values, got values=None")
    return gae(token_rewards, values, mask, gamma=gamma, lam=lam)


@register_token_advantage("returns")
def discounted_returns(
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted returns as advantages, no baseline (REINFORCE): ``A_t = G_t = Σ_{s≥t} γ^{s-t}·r_s``
    over the response's valid tokens; GAE with ``V ≡ 0`` and ``λ = 1``. No critic, ``lam`` must be 1."""
    _without_critic("returns", values, lam)
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma=gamma, lam=1.0)  # (N, T)
    return returns, returns.clone()


@register_token_advantage("reinforce_pp")
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025; algorithms.md §10): the discounted returns ``G_t`` (``"returns"``),
    whitened over the valid tokens of the batch, ``A = (G - mean) / sqrt(var + 1e-8)`` with the unbiased
    variance (:func:`~alignlit.ops.whiten`); with ``all_reduce`` over those of every rank. Returns ``G``.

    No critic, ``lam`` must be 1; at least 2 valid tokens (in one process; over all ranks with
    ``all_reduce``), and a row without valid tokens gets 0 everywhere.
    """
    _without_critic("reinforce_pp", values, lam)
    if all_reduce is None and int(mask.sum()) < 2:
        raise ValueError(f"mask has {int(mask.sum())} valid token(s); whitening the returns needs at least 2")
    _, returns = discounted_returns(token_rewards, None, mask, gamma=gamma, lam=1.0)  # (N, T)
    return whiten(returns, mask, all_reduce=all_reduce), returns


def _packing(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, packed)``, both (N, K) with ``K`` the most valid tokens of a row: the positions of each
    row's valid tokens in order (right-padded with 0) and the right-padded mask of the packed rows."""
    counts = valid.sum(-1)  # (N,)
    width = max(int(counts.max()), 1) if len(counts) else 1
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)[:, :width]  # valid positions first
    packed = torch.arange(width, device=valid.device) < counts[:, None]  # (N, K)
    return torch.where(packed, order, 0), packed


def _unpacked(
    x: torch.Tensor, index: torch.Tensor, packed: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros(valid.shape, dtype=x.dtype, device=x.device)  # (N, T)
    return out.scatter_add_(1, index, torch.where(packed, x, torch.zeros_like(x)))


def token_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str | TokenAdvantageEstimator,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages and returns from per-token rewards (algorithms.md §12).

    Args:
        token_rewards: (N, T) reward of each response token (e.g. :func:`alignlit.ops.kl_penalized_rewards`:
            ``-β·kl_t``, plus the sequence reward on the last valid token); padding may hold anything.
        mask: (N, T) 1 on response tokens; right-padded, or with gaps (a multi-turn episode's
            environment tokens): a row's valid tokens are then one sequence, the gaps skipped (the value
            after a turn's last token is the value at the next turn's first), and the advantages and
            returns at the gaps are 0.
        estimator: a name in :data:`TOKEN_ADVANTAGE_ESTIMATORS` (``"gae"``, ``"returns"``,
            ``"reinforce_pp"``, or one added with :func:`register_token_advantage`), or such a function.
        values: (N, T) critic values ``V(s_t)``, for the estimators that use a critic (``"gae"``); None
            for the others.
        gamma: discount ``γ ∈ [0, 1]``.
        lam: GAE's ``λ ∈ [0, 1]``; the estimators without a critic take only ``λ = 1``.
        all_reduce: with several data-parallel ranks, a sum over them
            (:data:`~alignlit.ops.stats.AllReduce`), for the statistics an estimator takes over the whole
            batch (``"reinforce_pp"``'s whitening). None: one process.

    Returns:
        ``(advantages, returns)``, both (N, T) and 0 at padding. Call it on detached tensors.
    """
    check_ndim("token_rewards", token_rewards, 2, "(N, T)")
    check_same_shape(token_rewards=token_rewards, mask=mask)
    if values is not None:
        check_same_shape(token_rewards=token_rewards, values=values)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    valid = mask.bool()  # (N, T)
    if (valid.any(-1) & ~valid[:, 0]).any() if valid.shape[-1] else False:
        raise ValueError("mask must be right-padded: a row's first valid token is after a padding position")
    if (valid[:, 1:] & ~valid[:, :-1]).any():  # gaps (a multi-turn episode's environment tokens)
        index, packed = _packing(valid)  # (N, K)
        take = lambda x: None if x is None else torch.where(packed, x.gather(1, index), 0)  # noqa: E731
        advantages, returns = token_advantages(
            take(token_rewards), packed, estimator=estimator, values=take(values), gamma=gamma, lam=lam,
            all_reduce=all_reduce,
        )  # fmt: skip
        return _unpacked(advantages, index, packed, valid), _unpacked(returns, index, packed, valid)
    if callable(estimator):
        fn = estimator
    elif estimator in TOKEN_ADVANTAGE_ESTIMATORS:
        fn = TOKEN_ADVANTAGE_ESTIMATORS[estimator]
    elif estimator in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage estimator {estimator!r} is a group estimator: it takes (B, n) sequence rewards; "
            "use alignlit.ops.group_advantages"
        )
    else:
        raise _unknown(estimator)
    rewards = _on_valid("token_rewards", token_rewards, valid)  # (N, T)
    if values is not None:
        values = _on_valid("values", values.to(rewards.dtype), valid)  # (N, T)
    advantages, returns = fn(rewards, values, valid, gamma=gamma, lam=lam, all_reduce=all_reduce)
    for name, out in (("advantages", advantages), ("returns", returns)):
        if out.shape != rewards.shape:
            raise ValueError(
                f"advantage estimator {estimator!r} returned {name} of shape {tuple(out.shape)}, expected "
                f"the shape of token_rewards {tuple(rewards.shape)}"
            )
    return advantages, returns


def reinforce_pp_returns(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float = 1.0,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """REINFORCE++ token advantages (Hu et al. 2025; algorithms.md §10) from sequence scores and token KL.

    Token rewards ``r_t = -β·kl_t`` on every response token, plus the sequence reward ``R`` on the
    last valid token (PPO's, :func:`alignlit.ops.kl_penalized_rewards`), then the ``"reinforce_pp"``
    per-token estimator (:func:`token_advantages`): returns ``G_t = Σ_{s≥t} γ^{s-t}·r_s`` over the
    sample's valid tokens (no critic, no bootstrapping), whitened over all valid tokens of the batch,
    ``(G - mean) / sqrt(var + 1e-8)`` with the unbiased variance. A row without valid tokens (no
    response token to carry its score) gets advantages 0 everywhere.

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
    valid = mask.bool()  # (N, T)
    kl = _on_valid("kl", kl, valid)  # (N, T)
    scores = _as_float("scores", scores).to(kl.dtype)
    _check_finite("scores", scores)
    rewards = kl_penalized_rewards(scores, kl, valid, kl_coef=kl_coef)  # (N, T)
    advantages, _ = token_advantages(
        rewards, valid, estimator="reinforce_pp", gamma=gamma, all_reduce=all_reduce
    )
    return advantages
