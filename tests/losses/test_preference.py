"""Tests for alignlit.losses.preference with hand-computed values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alignlit.losses import (
    ab_order_averaged_probability,
    ab_preference_loss,
    ab_probability,
    bradley_terry_loss,
    pearson_correlation,
    reward_model_loss,
    score_l2_loss,
)

CHOSEN = torch.tensor([2.0, 0.0])
REJECTED = torch.tensor([1.0, 1.0])


def test_bradley_terry_by_hand():
    """Gaps r_w - r_l = (1, -1): -log σ(1) = 0.313262, -log σ(-1) = 1.313262; mean 0.813262."""
    loss, metrics = bradley_terry_loss(CHOSEN, REJECTED)
    assert loss.item() == pytest.approx(0.813262, abs=1e-6)
    assert metrics["accuracy"].item() == 0.5
    assert metrics["margin"].item() == 0.0
    assert metrics["chosen"].item() == 1.0
    assert metrics["rejected"].item() == 1.0


@pytest.mark.parametrize(
    ("margin", "expected"),
    [
        # logits (1 - 0.5, -1 - 0) = (0.5, -1): (0.474077 + 1.313262)/2 = 0.893670
        (torch.tensor([0.5, 0.0]), 0.893670),
        # logits (0, -2): (ln 2 + 2.126928)/2 = (0.693147 + 2.126928)/2 = 1.410038
        (1.0, 1.410038),
        (torch.tensor(1.0), 1.410038),
    ],
)
def test_bradley_terry_with_margin_by_hand(margin, expected):
    loss, metrics = bradley_terry_loss(CHOSEN, REJECTED, margin)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["accuracy"].item() == 0.5  # accuracy ignores the margin: r_w > r_l


def test_bradley_terry_is_stable_and_batch_mean():
    """Gap -200: -log σ(-200) = 200 (a naive log(sigmoid) would give inf)."""
    loss, _ = bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([0.0]))
    assert loss.item() == pytest.approx(200.0)

    generator = torch.Generator().manual_seed(0)
    chosen, rejected, margin = (torch.randn(6, generator=generator, dtype=torch.float64) for _ in range(3))
    batch_loss, _ = bradley_terry_loss(chosen, rejected, margin.abs())
    singles = [
        bradley_terry_loss(chosen[i : i + 1], rejected[i : i + 1], margin.abs()[i : i + 1])[0]
        for i in range(6)
    ]
    assert batch_loss.item() == pytest.approx(torch.stack(singles).mean().item(), rel=1e-12)


def test_score_l2_by_hand():
    """(2² + 1² + 0² + 1²)/2 = 3."""
    loss, metrics = score_l2_loss(CHOSEN, REJECTED)
    assert loss.item() == pytest.approx(3.0)
    assert metrics["l2_loss"].item() == pytest.approx(3.0)


def test_reward_model_loss_by_hand():
    """0.813262 (BT) + 0.1·3 (L2) + 0.5·2.0 (LM) = 2.113262."""
    loss, metrics = reward_model_loss(
        CHOSEN, REJECTED, l2_weight=0.1, lm_loss=torch.tensor(2.0), lm_weight=0.5
    )
    assert loss.item() == pytest.approx(2.113262, abs=1e-6)
    assert metrics["bt_loss"].item() == pytest.approx(0.813262, abs=1e-6)
    assert metrics["l2_loss"].item() == pytest.approx(3.0)
    assert metrics["lm_loss"].item() == pytest.approx(2.0)
    assert metrics["loss"].item() == pytest.approx(2.113262, abs=1e-6)

    plain, plain_metrics = reward_model_loss(CHOSEN, REJECTED)
    assert plain.item() == pytest.approx(0.813262, abs=1e-6)
    assert "lm_loss" not in plain_metrics


def test_reward_model_loss_gradient_and_detached_metrics():
    """∂L/∂r_w for one pair with gap 1 and λ_reg = 0.1: -σ(-1) + 0.1·2·r_w = -0.268941 + 0.4 = 0.131059."""
    chosen = torch.tensor([2.0], requires_grad=True)
    loss, metrics = reward_model_loss(chosen, torch.tensor([1.0]), l2_weight=0.1)
    loss.backward()
    assert chosen.grad.item() == pytest.approx(0.131059, abs=1e-6)
    assert all(not value.requires_grad for value in metrics.values())


def test_reward_model_loss_validation():
    with pytest.raises(ValueError, match="lm_loss is None"):
        reward_model_loss(CHOSEN, REJECTED, lm_weight=0.5)
    with pytest.raises(
        ValueError, match=r"chosen_scores has shape \(2,\) but rejected_scores has shape \(3,\)"
    ):
        bradley_terry_loss(CHOSEN, torch.zeros(3))
    with pytest.raises(ValueError, match=r"chosen_scores has shape \(2,\) but margin has shape \(3,\)"):
        bradley_terry_loss(CHOSEN, REJECTED, torch.zeros(3))
    with pytest.raises(ValueError, match=r"must have shape \(B,\), got \(2, 1\)"):
        score_l2_loss(CHOSEN[:, None], REJECTED[:, None])


def test_ab_preference_loss_by_hand():
    """Pair 1: A preferred, logit gap 2 -> -log σ(2) = 0.126928. Pair 2: B preferred, gap -1 -> -log σ(1) = 0.313262.

    Mean 0.220095; both predictions right; P(A) = (σ(2) + σ(-1))/2 = (0.880797 + 0.268941)/2 = 0.574869.
    """
    logit_a, logit_b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    labels = torch.tensor([True, False])
    loss, metrics = ab_preference_loss(logit_a, logit_b, labels)
    assert loss.item() == pytest.approx(0.220095, abs=1e-6)
    assert metrics["accuracy"].item() == 1.0
    assert metrics["prob_a"].item() == pytest.approx(0.574869, abs=1e-6)
    reference = F.cross_entropy(torch.stack([logit_a, logit_b], dim=-1), (~labels).long())
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)


def test_ab_probability_and_order_average_by_hand():
    """Forward P(A) = σ(2 - 0) = 0.880797; swapped P(A) = σ(0 - 1) = 0.268941.

    Averaged P(y_1 ≻ y_2) = ½(0.880797 + 1 - 0.268941) = 0.805928; both orders prefer y_1 -> consistent.
    Second pair: swapped P(A) = σ(3) = 0.952574 -> ½(0.880797 + 0.047426) = 0.464112, inconsistent.
    """
    assert ab_probability(torch.tensor([2.0]), torch.tensor([0.0])).item() == pytest.approx(
        0.880797, abs=1e-6
    )
    probability, consistent = ab_order_averaged_probability(
        torch.tensor([2.0, 2.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 3.0]), torch.tensor([1.0, 0.0])
    )
    torch.testing.assert_close(probability, torch.tensor([0.805928, 0.464112]), atol=1e-6, rtol=0)
    assert consistent.tolist() == [True, False]


def test_ab_preference_loss_validation():
    with pytest.raises(ValueError, match="bool"):
        ab_preference_loss(torch.zeros(2), torch.zeros(2), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"logit_a has shape \(2,\) but label_is_a has shape \(3,\)"):
        ab_preference_loss(torch.zeros(2), torch.zeros(2), torch.ones(3, dtype=torch.bool))


def test_pearson_correlation_by_hand():
    """x = (1, 2, 3, 4), y = (1, 3, 2, 4): deviations (-1.5, -.5, .5, 1.5) and (-1.5, .5, -.5, 1.5),
    Σ dx·dy = 4, Σ dx² = Σ dy² = 5, ρ = 0.8; a constant input gives 0 with a zero gradient."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    assert pearson_correlation(x, torch.tensor([1, 3, 2, 4])).item() == pytest.approx(0.8, abs=1e-6)
    rho = pearson_correlation(x, torch.full((4,), 7.0))
    rho.backward()
    assert rho.item() == 0.0 and x.grad.abs().sum().item() == 0.0


def test_reward_model_loss_with_length_head_by_hand():
    """Quality scores r_Q: chosen (2, 0, 1), rejected (1, 1, 1); length head w = 0.5 on lengths chosen
    (2, 4, 3), rejected (4, 2, 1): r_L chosen (1, 2, 1.5), rejected (2, 1, 0.5). The Bradley-Terry term is
    on r_Q + r_L: gaps (0, 0, 1), loss (2 ln 2 + softplus(-1))/3 = (1.386294 + 0.313262)/3 = 0.566519,
    accuracy 1/3 (ties count as wrong); r_Q alone has gaps (1, -1, 0): quality_accuracy 1/3. Decorrelation
    within pairs: score gaps (1, -1, 0) against length gaps (-2, 2, 2): Σ dx·dy = -4, Σ dx² = 2,
    Σ dy² = 96/9, ρ = -4/√(192/9) = -0.866025; with λ_ρ = 0.5 the total is 0.566519 + 0.433013 = 0.999532."""
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])
    lengths = (torch.tensor([2.0, 4.0, 3.0]), torch.tensor([4.0, 2.0, 1.0]))
    loss, metrics = reward_model_loss(
        chosen,
        rejected,
        length_scores=(0.5 * lengths[0], 0.5 * lengths[1]),
        lengths=lengths,
        decorrelation_weight=0.5,
    )
    assert metrics["bt_loss"].item() == pytest.approx(0.566519, abs=1e-6)
    assert metrics["accuracy"].item() == pytest.approx(1 / 3)
    assert metrics["quality_accuracy"].item() == pytest.approx(1 / 3)
    assert metrics["length_corr"].item() == pytest.approx(-0.866025, abs=1e-6)
    assert loss.item() == pytest.approx(0.999532, abs=1e-6)
    # without the decorrelation weight the term is reported, not added
    loss0, _ = reward_model_loss(
        chosen, rejected, length_scores=(0.5 * lengths[0], 0.5 * lengths[1]), lengths=lengths
    )
    assert loss0.item() == pytest.approx(0.566519, abs=1e-6)
    with pytest.raises(ValueError, match=r"decorrelation_weight is 0\.5 but lengths is None"):
        reward_model_loss(CHOSEN, REJECTED, decorrelation_weight=0.5)
    with pytest.raises(ValueError, match="shape"):
        reward_model_loss(CHOSEN, REJECTED, length_scores=(torch.zeros(3), torch.zeros(2)))
