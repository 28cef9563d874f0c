"""Tests for alignlit.ops.dapo: dynamic-sampling group filter and overlong filtering/penalty."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.ops import informative_groups, overlong_mask, overlong_penalty


def test_informative_groups_by_hand():
    """Groups (1, 1, 1): spread 0, dropped; (1, 1, 2): spread 1, kept; (0.5, 0.5 + 1e-9, 0.5): spread 1e-9,
    kept with atol = 0 and dropped with atol = 1e-6; (0, 1, 0): kept."""
    rewards = torch.tensor(
        [[1.0, 1.0, 1.0], [1.0, 1.0, 2.0], [0.5, 0.5 + 1e-9, 0.5], [0.0, 1.0, 0.0]], dtype=torch.float64
    )
    assert informative_groups(rewards).tolist() == [False, True, True, True]
    assert informative_groups(rewards, atol=1e-6).tolist() == [False, True, False, True]


def test_informative_groups_integer_rewards_and_single_samples():
    assert informative_groups(torch.tensor([[0, 0], [0, 1]])).tolist() == [False, True]
    assert informative_groups(torch.tensor([[3.0], [4.0]])).tolist() == [False, False]


def test_informative_groups_input_validation():
    with pytest.raises(ValueError, match=r"rewards must have shape \(B, n\)"):
        informative_groups(torch.zeros(3))
    with pytest.raises(ValueError, match="atol must be >= 0"):
        informative_groups(torch.zeros(2, 2), atol=-1.0)
    with pytest.raises(ValueError, match="rewards must be finite"):
        informative_groups(torch.tensor([[0.0, math.nan]]))


def test_overlong_mask_from_truncation_flags_and_finish_reasons():
    """Samples cut at the limit are left out: truncated (False, True, False) -> keep (True, False, True)."""
    assert overlong_mask(torch.tensor([False, True, False])).tolist() == [True, False, True]
    assert overlong_mask(["stop", "length", "stop"]).tolist() == [True, False, True]
    with pytest.raises(ValueError, match=r"finish_reasons\[1\] is 'abort'; expected 'stop' or 'length'"):
        overlong_mask(["stop", "abort"])
    with pytest.raises(ValueError, match="truncated must be a bool tensor"):
        overlong_mask(torch.tensor([0, 1]))


def test_overlong_penalty_by_hand():
    """L = 10, L_c = 4, penalty 0.5: no penalty up to L - L_c = 6; then -0.5·(|y| - 6)/4:
    |y| = 7 -> -0.125, 8 -> -0.25, 10 -> -0.5; beyond L -> -0.5."""
    lengths = torch.tensor([0, 6, 7, 8, 10, 12])
    penalties = overlong_penalty(lengths, max_length=10, buffer=4, penalty=0.5)
    torch.testing.assert_close(penalties, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))


def test_overlong_penalty_full_buffer_is_linear_in_length():
    """L_c = L = 4, penalty 1: -|y|/4 for |y| = 0..4."""
    penalties = overlong_penalty(torch.arange(5), max_length=4, buffer=4)
    torch.testing.assert_close(penalties, torch.tensor([0.0, -0.25, -0.5, -0.75, -1.0]))


def test_overlong_penalty_input_validation():
    with pytest.raises(ValueError, match=r"buffer must be in \(0, max_length=10\], got 11"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer=11)
    with pytest.raises(ValueError, match=r"buffer must be in \(0, max_length=10\], got 0"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer=0)
    with pytest.raises(ValueError, match="max_length must be > 0"):
        overlong_penalty(torch.tensor([1]), max_length=0, buffer=1)
    with pytest.raises(ValueError, match="penalty must be >= 0"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer=2, penalty=-1.0)
    with pytest.raises(ValueError, match="lengths must be an integer tensor"):
        overlong_penalty(torch.tensor([1.5]), max_length=10, buffer=2)
    with pytest.raises(ValueError, match="lengths must be >= 0, got minimum -1"):
        overlong_penalty(torch.tensor([3, -1]), max_length=10, buffer=2)
    with pytest.raises(ValueError, match=r"lengths must have shape \(N,\)"):
        overlong_penalty(torch.ones(2, 2, dtype=torch.long), max_length=10, buffer=2)
