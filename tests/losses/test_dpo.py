"""Tests for alignlit.losses.dpo with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.losses import dpo_loss, ipo_loss, rpo_sft_term

# One pair: policy (chosen -1, rejected -3), reference (chosen -2, rejected -2).
# Log-ratio difference (-1 - -2) - (-3 - -2) = 1 - (-1) = 2, so h = 2β.
ONE_PAIR = tuple(torch.tensor([value], dtype=torch.float64) for value in (-1.0, -3.0, -2.0, -2.0))


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


@pytest.mark.parametrize(
    ("beta", "label_smoothing", "expected"),
    [
        # h = 0.1·2 = 0.2; -log σ(0.2) = log(1 + e^-0.2) = 0.598139
        (0.1, 0.0, 0.598139),
        # -0.9·log σ(0.2) - 0.1·log σ(-0.2) = 0.9·0.598139 + 0.1·0.798139 = 0.618139
        (0.1, 0.1, 0.618139),
        # h = 0.5·2 = 1; -log σ(1) = 0.313262
        (0.5, 0.0, 0.313262),
        # 0.75·0.313262 + 0.25·1.313262 = 0.563262
        (0.5, 0.25, 0.563262),
        # ε = 0.5: ½(softplus(-1) + softplus(1)) = ½(0.313262 + 1.313262) = 0.813262
        (0.5, 0.5, 0.813262),
    ],
)
def test_dpo_loss_by_hand(beta, label_smoothing, expected):
    loss, metrics = dpo_loss(*ONE_PAIR, beta=beta, label_smoothing=label_smoothing)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(beta * 1.0)  # β(-1 - -2)
    assert metrics["rewards/rejected"].item() == pytest.approx(beta * -1.0)  # β(-3 - -2)
    assert metrics["rewards/margin"].item() == pytest.approx(2 * beta)
    assert metrics["rewards/accuracy"].item() == 1.0
    assert all(not value.requires_grad for value in metrics.values())


def test_dpo_gradient_by_hand():
    """∂(-log σ(h))/∂π_c = -β·σ(-h); β = 0.1, h = 0.2: -0.1·σ(-0.2) = -0.1·0.450166 = -0.0450166."""
    policy_chosen = ONE_PAIR[0].clone().requires_grad_(True)
    loss, _ = dpo_loss(policy_chosen, *ONE_PAIR[1:], beta=0.1)
    loss.backward()
    assert policy_chosen.grad.item() == pytest.approx(-0.0450166, abs=1e-7)


@pytest.mark.parametrize(
    ("beta", "expected"),
    [
        (0.1, 9.0),  # h/β = 2, 1/(2β) = 5: (2 - 5)² = 9
        (0.5, 1.0),  # (2 - 1)² = 1
        (1.0, 2.25),  # (2 - 0.5)² = 2.25
    ],
)
def test_ipo_loss_by_hand(beta, expected):
    loss, metrics = ipo_loss(*ONE_PAIR, beta=beta)
    assert loss.item() == pytest.approx(expected)
    assert metrics["rewards/margin"].item() == pytest.approx(2 * beta)


@pytest.mark.parametrize("loss_fn", [dpo_loss, ipo_loss])
@pytest.mark.parametrize("beta", [0.05, 0.3])
def test_batch_equals_mean_of_single_examples(loss_fn, beta):
    generator = torch.Generator().manual_seed(0)
    batch = [-10 * torch.rand(5, generator=generator, dtype=torch.float64) for _ in range(4)]
    kwargs = {"beta": beta} if loss_fn is ipo_loss else {"beta": beta, "label_smoothing": 0.2}
    batch_loss, batch_metrics = loss_fn(*batch, **kwargs)
    singles = [loss_fn(*(x[i : i + 1] for x in batch), **kwargs) for i in range(5)]
    assert batch_loss.item() == pytest.approx(sum(loss.item() for loss, _ in singles) / 5, rel=1e-12)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"):
        expected = sum(metrics[key].item() for _, metrics in singles) / 5
        assert batch_metrics[key].item() == pytest.approx(expected, rel=1e-12)


def test_dpo_accuracy_counts_pairs_with_positive_h():
    """h = β·((c - rc) - (r - rr)) per pair: (2, -2, 0) with β = 1 -> accuracy 1/3 (h = 0 is not > 0)."""
    chosen = torch.tensor([1.0, -1.0, 0.0])
    rejected = torch.tensor([-1.0, 1.0, 0.0])
    zeros = torch.zeros(3)
    _, metrics = dpo_loss(chosen, rejected, zeros, zeros, beta=1.0)
    assert metrics["rewards/accuracy"].item() == pytest.approx(1 / 3)


def test_dpo_is_stable_for_large_margins():
    """h = ±1000: -log σ(1000) ≈ 0 and -log σ(-1000) ≈ 1000, both finite."""
    zeros = torch.zeros(2)
    loss, _ = dpo_loss(torch.tensor([1000.0, -1000.0]), zeros, zeros, zeros, beta=1.0)
    assert loss.item() == pytest.approx(500.0)


def test_rpo_sft_term_by_hand():
    """NLL sums (6, 3) over lengths (3, 1): per token (2, 3), mean 2.5."""
    loss, metrics = rpo_sft_term(torch.tensor([6.0, 3.0]), torch.tensor([3, 1]))
    assert loss.item() == pytest.approx(2.5)
    assert metrics["sft_loss"].item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match=r"batch indices \[1\]"):
        rpo_sft_term(torch.tensor([6.0, 3.0]), torch.tensor([3, 0]))


def test_dpo_input_validation():
    four = [torch.zeros(3) for _ in range(4)]
    with pytest.raises(
        ValueError, match=r"policy_chosen_logps has shape \(3,\) but ref_rejected_logps has shape \(2,\)"
    ):
        dpo_loss(*four[:3], torch.zeros(2), beta=0.1)
    with pytest.raises(ValueError, match=r"must have shape \(B,\), got \(3, 4\)"):
        ipo_loss(*(torch.zeros(3, 4) for _ in range(4)), beta=0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(*four, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*four, beta=0.1, label_smoothing=0.7)
    with pytest.raises(
        ValueError, match=r"chosen_nll_sum has shape \(2,\) but chosen_lengths has shape \(3,\)"
    ):
        rpo_sft_term(torch.zeros(2), torch.ones(3))
