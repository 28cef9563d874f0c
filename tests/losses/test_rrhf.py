"""Tests for alignlit.losses.rrhf: hand-computed values and a naive per-example reference."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.losses import rrhf_loss

# One prompt, k = 3 responses, T = 3; padding positions hold 50.0 to show they are excluded.
#   response 0: tokens (-1, -3), p_0 = -2, sum -4, reward 0.5
#   response 1: token (-1),      p_1 = -1, sum -1, reward 0.1
#   response 2: tokens (-2, -2, -2), p_2 = -2, sum -6, reward 0.9
TOKEN_LOGPS = torch.tensor([[[-1.0, -3.0, 50.0], [-1.0, 50.0, 50.0], [-2.0, -2.0, -2.0]]])
MASK = torch.tensor([[[1, 1, 0], [1, 0, 0], [1, 1, 1]]])
REWARDS = torch.tensor([[0.5, 0.1, 0.9]])


def naive_rrhf(token_logps, mask, rewards, rank_weight, sft_weight):
    """Loops over examples and pairs; independent of the vectorised implementation."""
    total_rank, total_sft = 0.0, 0.0
    batch, k, _ = token_logps.shape
    for b in range(batch):
        sums = [
            sum(token_logps[b, i, t].item() for t in range(mask.shape[2]) if mask[b, i, t]) for i in range(k)
        ]
        scores = [sums[i] / int(mask[b, i].sum()) for i in range(k)]
        for i in range(k):
            for j in range(k):
                if rewards[b, i] < rewards[b, j]:
                    total_rank += max(0.0, scores[i] - scores[j])
        best = max(range(k), key=lambda i: (rewards[b, i].item(), -i))
        total_sft += -sums[best]
    return rank_weight * total_rank / batch + sft_weight * total_sft / batch


def test_rrhf_by_hand():
    """Pairs with r_i < r_j: (1,0): max(0, -1 - -2) = 1; (1,2): max(0, -1 - -2) = 1; (0,2): max(0, 0) = 0.
    L_rank = 2. Best response is 2 (reward 0.9): L_ft = -(-6) = 6. L = 2 + 6 = 8.
    Weights (0.5, 0.1): 0.5·2 + 0.1·6 = 1.6. Ranking accuracy: p_1 < p_0? no; p_1 < p_2? no;
    p_0 < p_2? no (equal) -> 0/3.
    """
    loss, metrics = rrhf_loss(TOKEN_LOGPS, MASK, REWARDS)
    assert loss.item() == pytest.approx(8.0)
    assert metrics["rank_loss"].item() == pytest.approx(2.0)
    assert metrics["sft_loss"].item() == pytest.approx(6.0)
    assert metrics["ranking_accuracy"].item() == 0.0
    weighted, _ = rrhf_loss(TOKEN_LOGPS, MASK, REWARDS, rank_weight=0.5, sft_weight=0.1)
    assert weighted.item() == pytest.approx(1.6)


def test_rrhf_ties_pick_the_first_best_and_make_no_pairs():
    """Rewards (1, 1): no pair with r_i < r_j, so L_rank = 0 and accuracy is NaN; i* = 0 (first): L_ft = 4."""
    loss, metrics = rrhf_loss(TOKEN_LOGPS[:, :2], MASK[:, :2], torch.tensor([[1.0, 1.0]]))
    assert loss.item() == pytest.approx(4.0)
    assert metrics["rank_loss"].item() == 0.0
    assert math.isnan(metrics["ranking_accuracy"].item())


def test_rrhf_gradient_by_hand():
    """∂L/∂token: rank pairs (1,0) and (1,2) are active: p_1 gets +2 (token weight 1/1), p_0 gets -1 (weight 1/2),
    p_2 gets -1 (weight 1/3); SFT on response 2 adds -1 per valid token. Padding gets 0.
    """
    token_logps = TOKEN_LOGPS.clone().requires_grad_(True)
    loss, _ = rrhf_loss(token_logps, MASK, REWARDS)
    loss.backward()
    expected = torch.tensor([[[-0.5, -0.5, 0.0], [2.0, 0.0, 0.0], [-1 / 3 - 1, -1 / 3 - 1, -1 / 3 - 1]]])
    torch.testing.assert_close(token_logps.grad, expected)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("batch", [1, 5])
def test_rrhf_matches_naive_reference_and_mean_of_single_examples(k, batch):
    generator = torch.Generator().manual_seed(10 * k + batch)
    steps = 6
    token_logps = -3 * torch.rand(batch, k, steps, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, steps + 1, (batch, k), generator=generator)
    mask = torch.arange(steps)[None, None, :] < lengths[..., None]  # (B, k, T)
    token_logps = token_logps.masked_fill(~mask, 100.0)  # garbage at padding must not matter
    rewards = torch.randint(0, 3, (batch, k), generator=generator).double()  # includes ties

    loss, _ = rrhf_loss(token_logps, mask, rewards, rank_weight=0.7, sft_weight=1.3)
    assert loss.item() == pytest.approx(naive_rrhf(token_logps, mask, rewards, 0.7, 1.3), rel=1e-12)
    singles = [
        rrhf_loss(
            token_logps[b : b + 1], mask[b : b + 1], rewards[b : b + 1], rank_weight=0.7, sft_weight=1.3
        )[0]
        for b in range(batch)
    ]
    assert loss.item() == pytest.approx(torch.stack(singles).mean().item(), rel=1e-12)


def test_rrhf_validation():
    mask = MASK.clone().repeat(2, 1, 1)
    mask[1, 2] = 0
    with pytest.raises(ValueError, match=r"zero valid tokens at \(batch, k\) indices \[\(1, 2\)\]"):
        rrhf_loss(TOKEN_LOGPS.repeat(2, 1, 1), mask, REWARDS.repeat(2, 1))
    with pytest.raises(ValueError, match=r"token_logps has shape \(1, 3, 3\) but mask has shape \(1, 3, 2\)"):
        rrhf_loss(TOKEN_LOGPS, MASK[..., :2], REWARDS)
    with pytest.raises(
        ValueError, match=r"token_logps.shape\[:2\] has shape \(1, 3\) but rewards has shape \(1, 2\)"
    ):
        rrhf_loss(TOKEN_LOGPS, MASK, REWARDS[:, :2])
    with pytest.raises(ValueError, match=r"must have shape \(B, k, T\), got \(3, 3\)"):
        rrhf_loss(TOKEN_LOGPS[0], MASK[0], REWARDS)
