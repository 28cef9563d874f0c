"""The rollout-correction registry against hand-computed values (issue 34 item 3)."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.ops.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    correction_metrics,
    resolve_rollout_correction,
)

LO = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 7.0]])  # the padding holds junk
LE = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -1.0, float("nan")]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
E = math.exp


def test_registry_names():
    assert {"tis", "seq_tis", "geo_mask", "icepop"} <= set(ROLLOUT_CORRECTIONS)


def test_tis_by_hand():
    w = ROLLOUT_CORRECTIONS["tis"](LO, LE, MASK, cap=1.5)
    want = [[1.5, E(-1.0), 1.0], [E(0.1), E(-2.0), 0.0]]  # min(exp(0.5), 1.5) = 1.5
    assert torch.allclose(w, torch.tensor(want), atol=1e-6)


def test_seq_tis_by_hand():
    w = ROLLOUT_CORRECTIONS["seq_tis"](LO, LE, MASK, cap=2.0)
    want = [[E(-0.5)] * 3, [E(-1.9), E(-1.9), 0.0]]  # row sums -0.5 and -1.9, both under the cap
    assert torch.allclose(w, torch.tensor(want), atol=1e-6)
    swapped = ROLLOUT_CORRECTIONS["seq_tis"](LE, LO, MASK, cap=2.0)  # row 0: sum +0.5, under the cap
    assert swapped[0].tolist() == pytest.approx([E(0.5)] * 3)
    assert ROLLOUT_CORRECTIONS["seq_tis"](LE, LO, MASK, cap=1.5)[0].tolist() == pytest.approx([1.5] * 3)
    big = ROLLOUT_CORRECTIONS["seq_tis"](
        torch.zeros(1, 4000), torch.full((1, 4000), -1.0), torch.ones(1, 4000), cap=3.0
    )
    assert torch.all(big == 3.0)  # exp(4000) never formed


def test_geo_mask_by_hand():
    w = ROLLOUT_CORRECTIONS["geo_mask"](LO, LE, MASK, cap=1.5)
    # row 0: g = exp(-0.5/3) = 0.846 in [1/1.5, 1.5] -> kept; row 1: g = exp(-1.9/2) = 0.387 < 0.667 -> masked
    assert w.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_icepop_by_hand_and_metrics():
    w = ROLLOUT_CORRECTIONS["icepop"](LO, LE, MASK, low=0.5, high=1.5)
    want = [[0.0, 0.0, 1.0], [E(0.1), 0.0, 0.0]]  # 1.6487 > 1.5 and 0.368, 0.135 < 0.5 are masked
    assert torch.allclose(w, torch.tensor(want), atol=1e-6)
    m = correction_metrics(w, MASK)
    assert m["masked_tokens"] == pytest.approx(3 / 5) and m["masked_seqs"] == 0.0
    assert m["weight_mean"] == pytest.approx((1.0 + E(0.1)) / 5)
    g = correction_metrics(ROLLOUT_CORRECTIONS["geo_mask"](LO, LE, MASK, cap=1.5), MASK)
    assert g["masked_seqs"] == 0.5 and g["masked_tokens"] == pytest.approx(2 / 5)
    t = correction_metrics(ROLLOUT_CORRECTIONS["tis"](LO, LE, MASK, cap=1.5), MASK, cap=1.5)
    assert t["capped_tokens"] == pytest.approx(1 / 5)


def test_weights_are_detached_and_arguments_checked():
    lo = LO.clone().requires_grad_()
    assert not ROLLOUT_CORRECTIONS["tis"](lo, LE, MASK, cap=2.0).requires_grad
    with pytest.raises(ValueError, match="cap must be a finite number >= 1"):
        ROLLOUT_CORRECTIONS["tis"](LO, LE, MASK, cap=0.5)
    with pytest.raises(ValueError, match="unknown rollout correction 'tiss'"):
        resolve_rollout_correction("tiss")
    with pytest.raises(ValueError, match="bad arguments"):
        resolve_rollout_correction("icepop", {"cap": 2.0})
    with pytest.raises(ValueError, match="engine_logprobs must be finite on valid tokens"):
        ROLLOUT_CORRECTIONS["tis"](LO, torch.full_like(LE, float("nan")), MASK)
    bound = resolve_rollout_correction("seq_tis", {"cap": 2.0})
    assert torch.equal(bound(LO, LE, MASK), ROLLOUT_CORRECTIONS["seq_tis"](LO, LE, MASK, cap=2.0))
