"""Tests for alignlit.losses.ppo with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.losses import entropy_bonus, ppo_policy_loss, ppo_value_loss

# Tokens (row, col) with ε = 0.2; the third column is padding (ρ = 5, A = 100, must be ignored).
#   (0,0) ρ = 1.5, A = +1: unclipped 1.5, clipped 1.2 -> min 1.2   (clip active)
#   (0,1) ρ = 0.5, A = +1: unclipped 0.5, clipped 0.8 -> min 0.5
#   (1,0) ρ = 0.5, A = -1: unclipped -0.5, clipped -0.8 -> min -0.8 (clip active)
#   (1,1) ρ = 1.0, A = +2: 2, 2 -> 2
RATIOS = torch.tensor([[1.5, 0.5, 5.0], [0.5, 1.0, 5.0]], dtype=torch.float64)
ADVANTAGES = torch.tensor([[1.0, 1.0, 100.0], [-1.0, 2.0, 100.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])
OLD_LOGPROBS = torch.full((2, 3), -2.0, dtype=torch.float64)


def test_ppo_policy_loss_by_hand():
    """loss = -(1.2 + 0.5 - 0.8 + 2)/4 = -0.725; clip_frac = 2/4; ratio mean (1.5 + 0.5 + 0.5 + 1)/4 = 0.875.

    approx_kl = ½·(ln²1.5 + 2·ln²0.5 + 0)/4 = ½·(0.164402 + 0.960906)/4 = 0.140663.
    Gradient w.r.t. log π_θ: -ρ·A/4 where unclipped and 0 where clipped: (0, -0.125, 0 | 0, -0.5, 0).
    """
    logprobs = (OLD_LOGPROBS + torch.log(RATIOS)).requires_grad_(True)
    loss, metrics = ppo_policy_loss(logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.725)
    assert metrics["clip_frac"].item() == pytest.approx(0.5)
    assert metrics["ratio"].item() == pytest.approx(0.875)
    assert metrics["approx_kl"].item() == pytest.approx(
        0.5 * (math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4
    )
    assert metrics["approx_kl"].item() == pytest.approx(0.140663, abs=1e-6)
    loss.backward()
    expected_grad = torch.tensor([[0.0, -0.125, 0.0], [0.0, -0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected_grad)
    assert all(not value.requires_grad for value in metrics.values())


def test_ppo_policy_loss_with_importance_weights_by_hand():
    """Weights w = (2, 0.5 | 1, 0.25) on the four valid tokens (padding weight 9 ignored):
    loss = -(2·1.2 + 0.5·0.5 + 1·(-0.8) + 0.25·2)/4 = -(2.4 + 0.25 - 0.8 + 0.5)/4 = -0.5875.
    Gradient: -w·ρ·A/4 where unclipped: (0, -0.5·0.5/4 = -0.0625, 0 | 0, -0.25·2/4 = -0.125, 0)."""
    weights = torch.tensor([[2.0, 0.5, 9.0], [1.0, 0.25, 9.0]], dtype=torch.float64)
    logprobs = (OLD_LOGPROBS + torch.log(RATIOS)).requires_grad_(True)
    loss, _ = ppo_policy_loss(logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, clip_eps=0.2, is_weights=weights)
    assert loss.item() == pytest.approx(-0.5875)
    loss.backward()
    expected_grad = torch.tensor([[0.0, -0.0625, 0.0], [0.0, -0.125, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected_grad)


def test_ppo_policy_loss_is_token_weighted_mean_of_single_sequences():
    """The loss is a mean over all valid tokens of the batch: a length-weighted mean of per-sequence losses."""
    generator = torch.Generator().manual_seed(0)
    logprobs, old_logprobs, advantages = (
        torch.randn(4, 6, generator=generator, dtype=torch.float64) for _ in range(3)
    )
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    batch_loss, _ = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.1)
    lengths = mask.sum(-1).double()
    singles = torch.stack(
        [
            ppo_policy_loss(
                logprobs[i : i + 1],
                old_logprobs[i : i + 1],
                advantages[i : i + 1],
                mask[i : i + 1],
                clip_eps=0.1,
            )[0]
            for i in range(4)
        ]
    )
    assert batch_loss.item() == pytest.approx(((singles * lengths).sum() / lengths.sum()).item(), rel=1e-12)


def test_ppo_value_loss_by_hand():
    """ε_v = 0.2; the last column is padding.
    (V, V_old, G) = (1.0, 0.5, 1.0): V_clip = 0.7; max(0, 0.09) = 0.09 (clipped term used)
                    (0.6, 0.5, 0.0): V_clip = 0.6; max(0.36, 0.36) = 0.36
                    (0.0, 0.5, 1.0): V_clip = 0.3; max(1.0, 0.49) = 1.0
    loss = ½·(0.09 + 0.36 + 1.0)/3 = 0.241667; value_clip_frac = 1/3; value mean (1.0 + 0.6 + 0)/3 = 0.533333.
    Gradient: 0 (clipped, V - V_old outside the band), (0.6 - 0)/3 = 0.2, (0 - 1)/3 = -0.333333, 0 at padding.
    """
    values = torch.tensor([[1.0, 0.6, 0.0, 9.0]], dtype=torch.float64, requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 0.0, 1.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = ppo_value_loss(values, old_values, returns, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 * 1.45 / 3)
    assert metrics["value_clip_frac"].item() == pytest.approx(1 / 3)
    assert metrics["value"].item() == pytest.approx(1.6 / 3)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.2, -1 / 3, 0.0]], dtype=torch.float64))


def test_entropy_bonus_by_hand():
    """Valid entropies 1 and 2: mean 1.5; loss = -0.01·1.5 = -0.015."""
    loss, metrics = entropy_bonus(torch.tensor([[1.0, 2.0, 5.0]]), torch.tensor([[1, 1, 0]]), coef=0.01)
    assert loss.item() == pytest.approx(-0.015)
    assert metrics["entropy"].item() == pytest.approx(1.5)


def test_ppo_input_validation():
    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 3\) but advantages has shape \(2, 2\)"):
        ppo_policy_loss(OLD_LOGPROBS, OLD_LOGPROBS, ADVANTAGES[:, :2], MASK, clip_eps=0.2)
    with pytest.raises(ValueError, match=r"values has shape \(2, 3\) but mask has shape \(2, 4\)"):
        ppo_value_loss(OLD_LOGPROBS, OLD_LOGPROBS, OLD_LOGPROBS, torch.ones(2, 4), clip_eps=0.2)
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        ppo_policy_loss(OLD_LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, clip_eps=0.0)
    with pytest.raises(ValueError, match="no valid element"):
        entropy_bonus(torch.ones(1, 2), torch.zeros(1, 2), coef=0.1)
