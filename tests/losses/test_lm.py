"""Tests for alignlit.losses.lm with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from alignlit.losses import masked_nll, shift_for_next_token

# Every position has logits (0, ln 3): p(0) = 1/4, p(1) = 3/4; -ln p = (1.386294, 0.287682).
LOGITS = torch.tensor([[0.0, math.log(3.0)]]).expand(2, 3, 2)
LABELS = torch.tensor([[1, 0, 1], [0, -100, -100]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
NLL_1, NLL_0 = 0.287682, 1.386294


@pytest.mark.parametrize(
    ("reduction", "expected"),
    [
        # (0.287682 + 1.386294 + 1.386294)/3 = 1.020090
        ("token_mean", (NLL_1 + 2 * NLL_0) / 3),
        # ((0.287682 + 1.386294) + 1.386294)/2 = 1.530135
        ("sequence_sum", (NLL_1 + 2 * NLL_0) / 2),
        # ((0.287682 + 1.386294)/2 + 1.386294)/2 = 1.111641
        ("sequence_mean", ((NLL_1 + NLL_0) / 2 + NLL_0) / 2),
    ],
)
def test_masked_nll_by_hand(reduction, expected):
    loss, metrics = masked_nll(LOGITS, LABELS, MASK, reduction=reduction)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["nll"].item() == pytest.approx(1.020090, abs=1e-6)
    assert metrics["ppl"].item() == pytest.approx(math.exp(1.020090), abs=1e-5)
    assert metrics["tokens"].item() == 3


def test_masked_nll_matches_cross_entropy_with_ignore_index():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7), generator=generator)
    mask = torch.rand(3, 7, generator=generator) > 0.3
    loss, _ = masked_nll(logits, labels, mask)
    (grad,) = torch.autograd.grad(loss, logits)
    reference = F.cross_entropy(logits.reshape(-1, 11), labels.masked_fill(~mask, -100).reshape(-1))
    (reference_grad,) = torch.autograd.grad(reference, logits)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    torch.testing.assert_close(grad, reference_grad)


def test_shift_for_next_token():
    logits = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    input_ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    loss_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])
    shifted_logits, labels, mask = shift_for_next_token(logits, input_ids, loss_mask)
    torch.testing.assert_close(shifted_logits, logits[:, :3])
    assert labels.tolist() == [[6, 7, 8], [2, 3, 4]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    with pytest.raises(
        ValueError, match=r"logits.shape\[:-1\] has shape \(2, 4\) but input_ids has shape \(2, 3\)"
    ):
        shift_for_next_token(logits, input_ids[:, :3], loss_mask)


def test_masked_nll_validation():
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        masked_nll(LOGITS, LABELS, MASK, reduction="mean")
    with pytest.raises(
        ValueError, match=r"logits.shape\[:-1\] has shape \(2, 3\) but mask has shape \(2, 2\)"
    ):
        masked_nll(LOGITS, LABELS, MASK[:, :2])
    with pytest.raises(ValueError, match="no valid element"):
        masked_nll(LOGITS, LABELS, torch.tensor([[1, 1, 0], [0, 0, 0]]), reduction="sequence_mean")
    with pytest.raises(ValueError, match=r"got values in \[-100, 1\]"):
        masked_nll(LOGITS, LABELS, torch.ones(2, 3))
