"""Reward shaping and diagnostics of the online stages, against hand-computed values: KL-penalised token
rewards, running-statistics normalisation, the critic's explained variance, the per-prompt reward-length
correlation."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.ops import (
    RunningMoments,
    explained_variance,
    kl_penalized_rewards,
    length_reward_correlation,
    normalize_scores,
)


def test_kl_penalty_placement():
    """r_t = -β·kl_t on response tokens; R̃ added at the last valid token; an empty row gets nothing.

    β = 0.5, kl row 0 = [0.1, 0.2, 0.3] (3 tokens), row 1 = [0.5, ·, ·] (1 token), row 2 empty:
    row 0: [-0.05, -0.1, -0.15 + 1.0] = [-0.05, -0.1, 0.85]; row 1: [-0.25 - 2.0, 0, 0] = [-2.25, 0, 0].
    """
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    rewards = kl_penalized_rewards(torch.tensor([1.0, -2.0, 7.0]), kl, mask, kl_coef=0.5)
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-2.25, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    with pytest.raises(ValueError, match=r"scores must have shape \(N,\)"):
        kl_penalized_rewards(torch.zeros(2), kl, mask, kl_coef=0.5)


def test_normalize_scores_by_hand():
    """Moments of [1, 2, 3, 4]: μ = 2.5, σ = sqrt(5/3) = 1.290994 (unbiased).

    R = [4, -2]: normalise -> [1.161895, -3.485685]; clip ±1 -> [1, -1]; scale -> [3.098387, -1.549193].
    """
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    scores = torch.tensor([4.0, -2.0])
    torch.testing.assert_close(
        normalize_scores(scores, moments, mode="normalize", clip=None), torch.tensor([1.161895, -3.485685])
    )
    torch.testing.assert_close(
        normalize_scores(scores, moments, mode="normalize", clip=1.0), torch.tensor([1.0, -1.0])
    )
    torch.testing.assert_close(
        normalize_scores(scores, moments, mode="scale", clip=None), torch.tensor([3.098387, -1.549193])
    )
    torch.testing.assert_close(
        normalize_scores(scores, moments, mode="none", clip=3.0), torch.tensor([3.0, -2.0])
    )
    with pytest.raises(ValueError, match="reward_norm must be"):
        normalize_scores(scores, moments, mode="whiten", clip=None)


def test_explained_variance_by_hand():
    """G = [1, 2, 3] (var 1), V = [1, 2, 2]: G - V = [0, 0, 1] (var 1/3) -> 1 - 1/3 = 2/3; the padding column is ignored."""
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    values = torch.tensor([[1.0, 2.0, 2.0, -50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(2 / 3)


def test_length_reward_correlation_by_hand():
    """Row 0: r = [1, 2, 3], |y| = [1, 2, 4]: centred [-1, 0, 1] and [-4/3, -1/3, 5/3], covariance sum 3,
    norms² 2 and 14/3, so ρ = 3/sqrt(28/3) = 0.981981. Row 1 constant reward and row 3 constant length
    are excluded; row 2 is exactly anti-correlated (-1). Mean over the used prompts: (0.981981 - 1)/2."""
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [3.0, 2.0, 1.0], [0.0, 1.0, 2.0]])
    lengths = torch.tensor([[1, 2, 4], [1, 2, 3], [1, 2, 3], [5, 5, 5]])
    corr, used, excluded = length_reward_correlation(rewards, lengths)
    assert (used, excluded) == (2, 2)
    assert corr == pytest.approx((3 / math.sqrt(28 / 3) - 1) / 2, abs=1e-12)
    corr, used, excluded = length_reward_correlation(rewards[1:2], lengths[1:2])
    assert math.isnan(corr) and (used, excluded) == (0, 1)
    with pytest.raises(ValueError, match=r"\(B, n\)"):
        length_reward_correlation(rewards, lengths[:, :2])
