"""Reward shaping for online stages: running-statistics normalisation, token-level KL penalty, and
the diagnostics: the value function's explained variance (algorithms.md §4) and the per-prompt
reward-length correlation (RLHF-Workflow §2.3)."""

from __future__ import annotations

from typing import Literal

import torch

from alignlit.ops.stats import RunningMoments, masked_var

RewardNorm = Literal["none", "normalize", "scale"]


def normalize_scores(
    scores: torch.Tensor, moments: RunningMoments, *, mode: RewardNorm, clip: float | None
) -> torch.Tensor:
    """PPO-max reward normalisation on running statistics: ``R̃ = clip((R - μ)/σ, -δ, δ)``.

    ``mode``: ``"normalize"`` uses ``(R - μ)/σ``, ``"scale"`` ``R/σ``, ``"none"`` ``R``; ``μ, σ`` are
    the running mean and standard deviation of ``moments`` (``σ = 1`` while it has < 2 values);
    ``clip`` (``δ``) is applied to the result when given.
    """
    if mode not in ("none", "normalize", "scale"):
        raise ValueError(f"reward_norm must be 'none', 'normalize' or 'scale', got {mode!r}")
    out = scores
    if mode != "none":
        std = moments.std if moments.count >= 2 else 1.0
        shift = moments.mean if mode == "normalize" and moments.count else 0.0
        out = (scores - shift) / max(std, 1e-8)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return out


def kl_penalized_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token rewards with a token-level KL penalty (PPO-max §5.3.2, ChatGLM eq. 4-5).

    ``r_t = -β·kl_t`` on every response token, and the sequence reward ``R̃`` is added at the last
    valid token: ``r_T += R̃``. Rows without a response token get no reward.

    Multi-turn episodes: the mask may have gaps (environment tokens, not valid here), and
    ``turn_rewards`` (the environment's step rewards on the last token of each turn, part of ``R̃``) are
    added where they are, the last valid token getting the rest: ``r_t += turn_t``, ``r_T += R̃ - Σ_t
    turn_t``, so a row's rewards still sum to ``R̃ - β·Σ kl_t``.

    Args:
        scores: (N,) sequence rewards ``R̃``.
        kl: (N, T) per-token KL estimates.
        mask: (N, T) 1 on response tokens (right-padded, or with gaps).
        kl_coef: ``β``.
        turn_rewards: (N, T) rewards on turn-end tokens (valid tokens), or None.

    Returns:
        (N, T) rewards, 0 at padding.
    """
    if scores.dim() != 1 or scores.shape[0] != kl.shape[0]:
        raise ValueError(f"scores must have shape (N,) = ({kl.shape[0]},), got {tuple(scores.shape)}")
    weights = mask.to(kl.dtype)  # (N, T)
    rewards = -kl_coef * kl * weights
    positions = torch.arange(mask.shape[-1], device=mask.device)  # (T,)
    last = torch.where(mask.bool(), positions, -1).amax(-1) if mask.shape[-1] else weights.sum(-1).long() - 1
    rows = (last >= 0).nonzero().flatten()
    final = scores.to(rewards.dtype)
    if turn_rewards is not None:
        turns = turn_rewards.to(rewards.dtype) * weights  # (N, T)
        rewards = rewards + turns
        final = final - turns.sum(-1)
    rewards[rows, last[rows]] += final[rows]
    return rewards


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(G - V) / Var(G)`` over valid tokens: 1 for a perfect critic, 0 for a constant one."""
    return 1.0 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp_min(1e-12)


def length_reward_correlation(rewards: torch.Tensor, lengths: torch.Tensor) -> tuple[float, int, int]:
    """Pearson correlation of reward and length within each prompt, averaged over prompts
    (RLHF-Workflow §2.3, Fig. 5: ``n`` samples per prompt, one correlation per prompt).

    Args:
        rewards: (B, n) rewards of each prompt's samples.
        lengths: (B, n) their lengths.

    Returns:
        ``(mean correlation, prompts used, prompts excluded)``: prompts whose rewards or lengths are
        all equal have no correlation and are excluded (counted); the mean is NaN when none is left.
    """
    if rewards.dim() != 2 or rewards.shape != lengths.shape:
        raise ValueError(
            f"rewards and lengths must both be (B, n), got {tuple(rewards.shape)} and {tuple(lengths.shape)}"
        )
    r, n = rewards.double(), lengths.double()  # (B, n)
    varies = (r.amax(-1) > r.amin(-1)) & (n.amax(-1) > n.amin(-1))  # (B,)
    r, n = r[varies] - r[varies].mean(-1, keepdim=True), n[varies] - n[varies].mean(-1, keepdim=True)
    corr = (r * n).sum(-1) / (r.pow(2).sum(-1) * n.pow(2).sum(-1)).sqrt()  # (B',)
    used = int(varies.sum())
    return (float(corr.mean()) if used else float("nan")), used, len(varies) - used
