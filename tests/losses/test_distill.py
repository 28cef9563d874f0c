"""GKD's generalised JSD (alignlit.losses.distill) against hand-computed values and SciPy's
Jensen-Shannon distance, and its end points against the two KL divergences."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.spatial.distance import jensenshannon

from alignlit.losses import generalized_jsd, generalized_jsd_loss


def test_hand_computed_two_tokens():
    """Teacher P = (3/4, 1/4) (logits log 3, 0), student Q = (1/4, 3/4) (logits 0, log 3).

    M = (1/2, 1/2) at β = 1/2; KL(P‖M) = 3/4·log(3/2) + 1/4·log(1/2) = KL(Q‖M) = 0.1308120,
    so JSD_½ = 0.1308120. KL(P‖Q) = 3/4·log 3 − 1/4·log 3 = ½·log 3 = 0.5493061 = KL(Q‖P).
    At β = 1/4: M = (3/16 + 3/16, 1/16 + 9/16) = (3/8, 5/8); KL(P‖M) = 3/4·log 2 + 1/4·log(2/5) = 0.2907877,
    KL(Q‖M) = 1/4·log(2/3) + 3/4·log(6/5) = 0.0353749; JSD = 1/4·0.2907877 + 3/4·0.0353749 = 0.0992281.
    """
    student = torch.tensor([[0.0, math.log(3.0)]])
    teacher = torch.tensor([[math.log(3.0), 0.0]])
    assert float(generalized_jsd(student, teacher, beta=0.5)) == pytest.approx(0.1308120, abs=1e-6)
    assert float(generalized_jsd(student, teacher, beta=0.0)) == pytest.approx(0.5493061, abs=1e-6)
    assert float(generalized_jsd(student, teacher, beta=1.0)) == pytest.approx(0.5493061, abs=1e-6)
    assert float(generalized_jsd(student, teacher, beta=0.25)) == pytest.approx(0.0992281, abs=1e-6)


def test_against_scipy_and_the_kl_end_points():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 4, 11, generator=g), torch.randn(3, 4, 11, generator=g)
    p, q = teacher.softmax(-1).double(), student.softmax(-1).double()
    ours = generalized_jsd(student, teacher, beta=0.5)  # (3, 4)
    want = torch.tensor(jensenshannon(p.numpy(), q.numpy(), axis=-1) ** 2)  # natural log: JS divergence
    torch.testing.assert_close(ours.double(), want, atol=1e-6, rtol=1e-5)
    forward_kl = (p * (p.log() - q.log())).sum(-1)
    reverse_kl = (q * (q.log() - p.log())).sum(-1)
    torch.testing.assert_close(
        generalized_jsd(student, teacher, beta=0.0).double(), forward_kl, atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(
        generalized_jsd(student, teacher, beta=1.0).double(), reverse_kl, atol=1e-6, rtol=1e-5
    )
    # the end points are the limits of JSD_β/β and JSD_β/(1-β)
    near0 = generalized_jsd(student.double(), teacher.double(), beta=1e-6) / 1e-6
    torch.testing.assert_close(near0, forward_kl, atol=1e-4, rtol=1e-4)
    # temperature divides both sets of logits
    torch.testing.assert_close(
        generalized_jsd(student, teacher, beta=0.3, temperature=2.0),
        generalized_jsd(student / 2, teacher / 2, beta=0.3),
    )


def test_loss_masks_reduces_and_reaches_only_the_student():
    g = torch.Generator().manual_seed(1)
    student = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    teacher = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    per_token = generalized_jsd(student, teacher, beta=0.5).detach()
    loss, metrics = generalized_jsd_loss(student, teacher, mask, beta=0.5)
    want = (per_token[0, 0] + per_token[0, 1] + per_token[1, 0]) / 3
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-6)
    assert float(metrics["jsd"]) == pytest.approx(float(want), rel=1e-6)
    seq, _ = generalized_jsd_loss(student, teacher, mask, aggregation="seq_mean_token_mean", max_length=3)
    want_seq = ((per_token[0, 0] + per_token[0, 1]) / 2 + per_token[1, 0]) / 2
    assert float(seq.detach()) == pytest.approx(float(want_seq), rel=1e-6)
    loss.backward()
    assert teacher.grad is None and student.grad is not None
    assert float(student.grad[0, 2].abs().sum()) == 0 and float(student.grad[1, 1:].abs().sum()) == 0
    # identical distributions: zero divergence, zero gradient
    same, _ = generalized_jsd_loss(teacher.detach().clone().requires_grad_(), teacher, mask)
    assert float(same.detach()) == pytest.approx(0.0, abs=1e-7)


def test_bad_input_named():
    x = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(x, x, beta=1.5)
    with pytest.raises(ValueError, match="differ"):
        generalized_jsd(x, torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="no scored token"):
        generalized_jsd_loss(x, x, torch.zeros(1, 2, dtype=torch.bool))
