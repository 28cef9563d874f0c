"""PPO losses over response tokens (algorithms.md §4; Schulman et al. 2017, PPO-max).

Tensors are (B, T); ``mask`` is 1 on response tokens and 0 on padding. Every mean is a masked mean
over all valid tokens of the batch.
"""

from __future__ import annotations

import torch

from alignlit.ops.stats import check_same_shape, masked_mean


def _check_clip(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate ``L_π = -mean_t min(ρ_t·A_t, clip(ρ_t, 1-ε, 1+ε)·A_t)``, ``ρ_t = exp(log π_θ - log π_θ_old)``.

    ``old_logprobs`` and ``advantages`` are treated as constants (detached here).

    Args:
        logprobs: (B, T) ``log π_θ`` of the sampled tokens (with gradient).
        old_logprobs: (B, T) ``log π_θ_old`` at sampling time.
        advantages: (B, T) advantage estimates (e.g. whitened GAE).
        mask: (B, T) 1 on response tokens.
        clip_eps: ``ε > 0``.
        is_weights: (B, T) per-token importance weights multiplying each token's loss (truncated
            importance sampling of the rollout/trainer mismatch, algorithms.md §11); None: 1.

    Returns:
        ``(loss, metrics)``; metrics ``policy_loss``; ``clip_frac``, the fraction of valid tokens where
        the clipped term is strictly smaller than the unclipped one, i.e. the clip is active and the
        token contributes no gradient; ``approx_kl``, the masked mean of ``½(log π_θ - log π_θ_old)²``
        (the k2 estimator of ``KL(π_θ_old ‖ π_θ)``); ``ratio``, the masked mean of ``ρ``.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    _check_clip("clip_eps", clip_eps)
    old_logprobs = old_logprobs.detach()
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    token_loss = -torch.minimum(unclipped, clipped)  # (B, T)
    if is_weights is not None:
        check_same_shape(logprobs=logprobs, is_weights=is_weights)
        token_loss = token_loss * is_weights.detach()
    loss = masked_mean(token_loss, mask)
    with torch.no_grad():
        metrics = {
            "policy_loss": loss.detach(),
            "clip_frac": masked_mean((clipped < unclipped).to(ratio.dtype), mask),
            "approx_kl": masked_mean(0.5 * log_ratio**2, mask),
            "ratio": masked_mean(ratio, mask),
        }
    return loss, metrics


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``L_V = ½·mean_t max((V - G)², (V_clip - G)²)``, ``V_clip = V_old + clip(V - V_old, ±ε_v)``.

    ``old_values`` and ``returns`` are treated as constants (detached here).

    Args:
        values: (B, T) current critic values (with gradient).
        old_values: (B, T) critic values at sampling time.
        returns: (B, T) GAE returns ``G``.
        mask: (B, T) 1 on response tokens.
        clip_eps: ``ε_v > 0``.

    Returns:
        ``(loss, metrics)``; metrics ``value_loss``, ``value_clip_frac`` (fraction of valid tokens where
        the clipped error is strictly larger, i.e. the clipped term is the one used) and ``value``
        (masked mean of ``values``).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    _check_clip("clip_eps", clip_eps)
    old_values = old_values.detach()
    returns = returns.detach()
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)  # (B, T)
    error = (values - returns) ** 2
    error_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(error, error_clipped), mask)
    with torch.no_grad():
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_frac": masked_mean((error_clipped > error).to(values.dtype), mask),
            "value": masked_mean(values, mask),
        }
    return loss, metrics


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, *, coef: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus as a loss, ``-c_H·mean_t H(π_θ(·|s_t))`` (PPO-max).

    Args:
        entropy: (B, T) per-token entropies (e.g. from :func:`alignlit.ops.entropy_from_logits`).
        mask: (B, T) 1 on response tokens.
        coef: ``c_H``.

    Returns:
        ``(loss, {"entropy": masked mean entropy})``.
    """
    check_same_shape(entropy=entropy, mask=mask)
    mean_entropy = masked_mean(entropy, mask)
    return -coef * mean_entropy, {"entropy": mean_entropy.detach()}
