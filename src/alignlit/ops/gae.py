"""Generalised advantage estimation over right-padded response tokens."""

from __future__ import annotations

import torch

from alignlit.ops.stats import check_ndim, check_same_shape


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns (Schulman et al. 2016; algorithms.md §4).

    ``δ_t = r_t + γ·V(s_{t+1}) - V(s_t)``, ``A_t = Σ_l (γλ)^l·δ_{t+l}``, with ``V = 0`` after the last
    valid token, and returns ``G_t = A_t + V(s_t)``. Rewards and values at padding are ignored.
    Vectorised over the batch, one step per token position (right to left). Call it on detached
    tensors (it does not detach them itself).

    Args:
        rewards: (B, T) per-token rewards (e.g. ``-β·kl_t``, plus the sequence reward on the last token).
        values: (B, T) critic values ``V(s_t)``.
        mask: (B, T) 1 on response tokens; must be right-padded (no valid token after a padding one).
        gamma: discount ``γ``.
        lam: GAE ``λ``.

    Returns:
        ``(advantages, returns)``, both (B, T) and 0 at padding.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    check_ndim("rewards", rewards, 2, "(B, T)")
    weights = mask.to(values.dtype)  # (B, T)
    if (weights[:, 1:] > weights[:, :-1]).any():
        raise ValueError("mask must be right-padded: found a valid token after a padding position")
    rewards = rewards * weights
    values = values * weights
    steps = rewards.shape[1]
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    running = torch.zeros_like(values[:, 0])  # (B,)
    advantages = []
    for t in reversed(range(steps)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # At padding every term is 0, so the accumulator restarts from 0 at each sequence's last token.
        running = (delta + gamma * lam * running) * weights[:, t]
        advantages.append(running)
        next_value = values[:, t]
    advantages_bt = torch.stack(advantages[::-1], dim=1) if advantages else torch.zeros_like(values)  # (B, T)
    returns = (advantages_bt + values) * weights
    return advantages_bt, returns
