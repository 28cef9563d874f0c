"""Tests for alignlit.ops.mismatch on constructed off-policy batches with hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.losses import policy_gradient_loss
from alignlit.ops import logprob_mismatch, truncated_is_weights

# Probabilities of the sampled tokens under the trainer (π_old) and the engine (μ); row 1's last
# column is padding (garbage there, NaN included, must be ignored).
#   π_old / μ per valid token: 0.5/0.25 = 2, 0.25/0.5 = 0.5, 0.1/0.01 = 10 | 0.8/0.8 = 1, 0.3/0.6 = 0.5
TRAINER = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.8, 0.3, 1.0]], dtype=torch.float64))
ENGINE = torch.log(torch.tensor([[0.25, 0.5, 0.01], [0.8, 0.6, math.nan]], dtype=torch.float64))
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_logprob_mismatch_by_hand():
    """Δ = log π_old - log μ = (ln 2, -ln 2, ln 10 | 0, -ln 2).
    mean |Δ| = (3·0.693147 + 2.302585)/5 = 0.876405; max |Δ| = ln 10 = 2.302585.
    k3 with w = π_old/μ = (2, 0.5, 10 | 1, 0.5), w - 1 - ln w = (0.306853, 0.193147, 6.697415 | 0, 0.193147);
    mean 7.390562/5 = 1.478112.
    """
    metrics = logprob_mismatch(TRAINER, ENGINE, MASK)
    assert metrics["mismatch_abs_mean"].item() == pytest.approx(0.876405, abs=1e-6)
    assert metrics["mismatch_abs_max"].item() == pytest.approx(math.log(10))
    assert metrics["mismatch_kl"].item() == pytest.approx(1.478112, abs=1e-6)
    assert all(not value.requires_grad for value in metrics.values())


def test_mismatch_kl_estimates_kl_engine_to_trainer():
    """Tokens drawn from μ = (0.9, 0.05, 0.05) in exactly those proportions (18, 1, 1 of 20), π_old =
    (0.5, 0.25, 0.25). The mean k3 then equals its expectation under μ, KL(μ ‖ π_old) =
    0.9·ln 1.8 + 0.1·ln 0.2 = 0.368064, not KL(π_old ‖ μ) = 0.5·ln(5/9) + 0.5·ln 5 = 0.510826.
    """
    mu = torch.tensor([0.9, 0.05, 0.05], dtype=torch.float64)
    pi = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    tokens = torch.tensor([0] * 18 + [1, 2]).reshape(4, 5)
    metrics = logprob_mismatch(pi.log()[tokens], mu.log()[tokens], torch.ones(4, 5))
    kl_mu_pi = float((mu * (mu / pi).log()).sum())
    assert kl_mu_pi == pytest.approx(0.368064, abs=1e-6)
    assert float((pi * (pi / mu).log()).sum()) == pytest.approx(0.510826, abs=1e-6)
    assert metrics["mismatch_kl"].item() == pytest.approx(kl_mu_pi, rel=1e-12)


def test_identical_logprobs_have_no_mismatch():
    metrics = logprob_mismatch(TRAINER, TRAINER.clone(), MASK)
    assert all(value.item() == 0.0 for value in metrics.values())


def test_truncated_is_weights_by_hand():
    """w = min(π_old/μ, C) with C = 3: (2, 0.5, min(10, 3) = 3 | 1, 0.5, 0 at padding)."""
    weights = truncated_is_weights(TRAINER, ENGINE, MASK, cap=3.0)
    expected = torch.tensor([[2.0, 0.5, 3.0], [1.0, 0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)


def test_truncated_is_weights_are_constants():
    trainer = TRAINER.clone().requires_grad_(True)
    weights = truncated_is_weights(trainer, ENGINE, MASK, cap=2.0)
    assert not weights.requires_grad
    assert truncated_is_weights(TRAINER, ENGINE, torch.zeros(2, 3), cap=2.0).eq(0).all()


def test_tis_weights_the_policy_loss_of_an_off_policy_batch():
    """The trainer has not moved since the rollout (log π_θ = log π_old, ρ = 1, no clipping); advantages
    (+1 for row 0, -1 for row 1). Token losses -w·ρ·A with C = 3: (-2, -0.5, -3 | 1, 0.5);
    token-mean loss (-5.5 + 1.5)/5 = -0.8 (without weights: (-3 + 2)/5 = -0.2).
    """
    weights = truncated_is_weights(TRAINER, ENGINE, MASK, cap=3.0)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    kwargs = {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "token_mean"}
    loss, metrics = policy_gradient_loss(TRAINER, TRAINER, advantages, MASK, is_weights=weights, **kwargs)
    assert loss.item() == pytest.approx(-0.8)
    assert metrics["is_weight_mean"].item() == pytest.approx(7.0 / 5.0)
    assert policy_gradient_loss(TRAINER, TRAINER, advantages, MASK, **kwargs)[0].item() == pytest.approx(-0.2)


def test_mismatch_input_validation():
    with pytest.raises(
        ValueError, match=r"trainer_logprobs has shape \(2, 3\) but engine_logprobs has shape \(2, 2\)"
    ):
        logprob_mismatch(TRAINER, ENGINE[:, :2], MASK)
    with pytest.raises(ValueError, match=r"trainer_old_logprobs must have shape \(N, T\)"):
        truncated_is_weights(TRAINER[0], ENGINE[0], MASK[0], cap=2.0)
    with pytest.raises(ValueError, match="no valid token"):
        logprob_mismatch(TRAINER, ENGINE, torch.zeros(2, 3))
    with pytest.raises(
        ValueError, match=r"engine_logprobs must be finite on valid tokens; found nan at \(1, 2\)"
    ):
        logprob_mismatch(TRAINER, ENGINE, torch.ones(2, 3))
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_is_weights(TRAINER, ENGINE, MASK, cap=0.5)
