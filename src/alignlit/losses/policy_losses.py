"""Per-token policy losses: PPO's clipped surrogate with clip-higher, dual-clip PPO, GSPO, CISPO
(algorithms.md §13).

A registry of small pure functions keyed by the name a config uses (``policy_loss:``); add one with
:func:`register_policy_loss`. Each returns the per-token term ``l_t`` that
:func:`~alignlit.losses.policy_gradient_loss` weights and aggregates. Tensors are (N, T) over response
tokens; ``mask`` is 1 on response tokens and 0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from alignlit.ops.stats import masked_mean, masked_sum

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``fn(logprobs (N, T), old_logprobs (N, T), advantages (N, T), mask (N, T) bool, *, clip_low: float,
clip_high: float, **options) -> (token_losses (N, T), metrics)``.

``token_losses`` is the per-token policy term ``l_t`` (to be minimised) that :func:`policy_gradient_loss`
multiplies by the importance weights and aggregates; it is 0 at padding, and its gradient flows through
``logprobs`` only. The inputs are 0 at padding, ``old_logprobs`` and ``advantages`` carry no gradient,
``ε_low = clip_low ∈ (0, 1]`` and ``ε_high = clip_high > 0``. ``metrics`` are scalars, means over the
valid tokens: ``clip_frac_high`` and ``clip_frac_low`` (the entry's docstring says which tokens they
count) and any of the entry's own. ``options`` are the entry's own hyperparameters, keyword-only with
defaults, set through ``policy_loss_args``."""

POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Per-token policy losses by name (the value of ``policy_loss`` in :func:`policy_gradient_loss`)."""


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding ``fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, **options)
    -> (token_losses, metrics)`` (see :data:`PolicyLoss`) to :data:`POLICY_LOSSES` as ``name``.

    Raises ``ValueError`` when ``name`` is already registered.
    """

    def decorate(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorate


@torch.no_grad()
def _clip_fractions(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float
) -> dict[str, torch.Tensor]:
    """Fractions of valid tokens where the clipped term of the surrogate is the smaller one, so that the
    token gives no gradient: ``A_t > 0`` and ``ratio > 1 + ε_high`` (high), ``A_t < 0`` and
    ``ratio < 1 - ε_low`` (low)."""
    high = (advantages > 0) & (ratio > 1.0 + clip_high)
    low = (advantages < 0) & (ratio < 1.0 - clip_low)
    return {
        "clip_frac_high": masked_mean(high.to(ratio.dtype), mask),
        "clip_frac_low": masked_mean(low.to(ratio.dtype), mask),
    }


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """(N, T) ``-min(ratio·A, clip(ratio, 1 - ε_low, 1 + ε_high)·A)``."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped)


@register_policy_loss("ppo_clip")
def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, Eq. 7) with asymmetric clip ranges (DAPO's
    clip-higher, Yu et al. 2025 §3.1, ``ε_high > ε_low``):
    ``l_t = -min(ρ_t·A_t, clip(ρ_t, 1 - ε_low, 1 + ε_high)·A_t)``, ``ρ_t = exp(log π_θ - log π_old)``.

    Metrics: ``clip_frac_high`` (``A_t > 0``, ``ρ_t > 1 + ε_high``) and ``clip_frac_low`` (``A_t < 0``,
    ``ρ_t < 1 - ε_low``), exactly the tokens that give no gradient.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # (N, T)
    losses = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return losses, _clip_fractions(ratio, advantages, mask, clip_low, clip_high)


@register_policy_loss("dual_clip")
def dual_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO (Ye et al. 2020, §"Dual-clip PPO"): where ``A_t < 0`` the surrogate is bounded too,
    ``max(min(ρ_t·A_t, clip(ρ_t, 1 - ε_low, 1 + ε_high)·A_t), c·A_t)``, so
    ``l_t = min(l_t^ppo_clip, c·|A_t|)``; ``ppo_clip``'s loss where ``A_t ≥ 0``.

    With ``A_t < 0`` the plain surrogate grows without bound in ``ρ_t``: one token far more likely under
    ``π_θ`` than under ``π_old`` (a stale or off-policy sample) would dominate the batch. The bound
    ``c·|A_t|`` is active, and the token gives no gradient, where ``ρ_t > c``.

    Args:
        clip_ratio_c: ``c > 1`` (3 as in verl), from ``policy_loss_args``.

    Metrics: ``ppo_clip``'s, and ``clip_frac_dual``, the fraction of tokens with ``A_t < 0`` and
    ``ρ_t > c``.
    """
    if not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    losses, metrics = ppo_clip(
        logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high
    )  # (N, T)
    bound = -clip_ratio_c * advantages  # (N, T), c·|A_t| where A_t < 0
    dual = (advantages < 0) & (losses > bound)  # (N, T)
    metrics["clip_frac_dual"] = masked_mean(dual.to(losses.dtype), mask)
    return torch.where(dual, bound, losses), metrics


@register_policy_loss("gspo")
def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, §4.1 Eq. 5 and 7): one ratio per sequence, the geometric mean of its token
    ratios over the valid tokens, ``s_i = exp((1/|y_i|)·Σ_t (log π_θ(y_it) - log π_old(y_it)))``, clipped
    per sequence. The paper's ranges are far narrower than PPO's: ``ε_low = 3e-4``, ``ε_high = 4e-4``.

    Written in the GSPO-token form (§4.3, Eq. 13–14), ``s_it = sg[s_i]·π_θ(y_it)/sg[π_θ(y_it)]``: its value
    is ``s_i`` and its gradient ``s_i·∇log π_θ(y_it)``, and
    ``l_t = -min(s_it·A_t, clip(s_it, 1 - ε_low, 1 + ε_high)·A_t)``. With one advantage per sequence and
    the ``seq_mean_token_mean`` aggregation this is GSPO's objective, value and gradient:
    ``mean_i -min(s_i·A_i, clip(s_i, ...)·A_i)``; another aggregation weights the sequences otherwise.

    Metrics: ``clip_frac_high``/``clip_frac_low`` count the tokens of clipped sequences (``A > 0`` and
    ``s_i > 1 + ε_high``; ``A < 0`` and ``s_i < 1 - ε_low``); ``seq_ratio_mean``, the mean of ``s_i``
    over the sequences with valid tokens.
    """
    lengths = mask.sum(dim=1, keepdim=True).clamp_min(1)  # (N, 1)
    log_ratio = logprobs.detach() - old_logprobs  # (N, T), 0 at padding
    seq_log_ratio = masked_sum(log_ratio, mask, dim=1)[:, None] / lengths  # (N, 1), log s_i
    token_log_ratio = seq_log_ratio + logprobs - logprobs.detach()  # (N, T), log s_it
    ratio = torch.exp(torch.where(mask, token_log_ratio, torch.zeros_like(token_log_ratio)))  # (N, T)
    losses = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    metrics = _clip_fractions(ratio, advantages, mask, clip_low, clip_high)
    metrics["seq_ratio_mean"] = seq_log_ratio[mask.any(dim=1)].exp().mean()
    return losses, metrics


@register_policy_loss("cispo")
def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, MiniMax-M1 §3.1 Eq. 4–5): clip the importance weight, not the update,
    ``l_t = -sg(clip(ρ_t, 1 - ε_low, 1 + ε_high))·A_t·log π_θ(y_t)``.

    The clipped weight is a constant, so every token keeps the gradient ``-ŵ_t·A_t·∇log π_θ(y_t)``;
    PPO's clip instead drops the tokens whose ratio left the range, which are often the rare tokens
    that matter (the paper's "However", "Wait"). The paper sets no lower bound (here ``ε_low = 1``: the
    weight is never below 0) and tunes ``ε_high``. Only the gradient is meaningful: the value
    ``-ŵ·A·log π_θ`` is not a surrogate of the objective's value, so its ``pg_loss`` is not comparable
    with another entry's.

    Metrics: ``clip_frac_high``, the fraction of tokens whose weight is cut to ``1 + ε_high``
    (``ρ_t > 1 + ε_high``, either sign of ``A_t``), ``clip_frac_low`` those raised to ``1 - ε_low``;
    these tokens still have a gradient.
    """
    ratio = torch.exp(logprobs - old_logprobs).detach()  # (N, T)
    weights = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (N, T), constants
    losses = -weights * advantages * logprobs
    metrics = {
        "clip_frac_high": masked_mean((ratio > 1.0 + clip_high).to(ratio.dtype), mask),
        "clip_frac_low": masked_mean((ratio < 1.0 - clip_low).to(ratio.dtype), mask),
    }
    return losses, metrics
