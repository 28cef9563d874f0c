"""Group advantage estimators: a group without spread gets advantages exactly 0; lookup errors."""

from __future__ import annotations

import pytest
import torch

from alignlit.ops import ADVANTAGE_ESTIMATORS, TOKEN_ADVANTAGE_ESTIMATORS, group_advantages

BUILT_IN = ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]


def constant_groups(generator: torch.Generator, groups: int, n: int) -> torch.Tensor:
    """(groups, n) float32 rows of one random value each: magnitudes from 1e-3 to 1e3, either sign, and
    tenths such as 0.1 and 0.7 (whose float32 mean is not the value itself)."""
    scale = 10.0 ** torch.randint(-3, 4, (groups, 1), generator=generator).float()
    value = torch.rand(groups, 1, generator=generator) * scale
    tenths = torch.randint(1, 10, (groups, 1), generator=generator).float() / 10
    value = torch.where(torch.rand(groups, 1, generator=generator) < 0.3, tenths, value)
    sign = torch.where(torch.rand(groups, 1, generator=generator) < 0.5, -1.0, 1.0)
    return (sign * value).expand(groups, n).contiguous()


def test_eight_tenths_give_zero():
    """Eight float32 0.1: their float mean is 0.1 + 7.45e-9, and GRPO divided that residue by a std of the
    same order (advantages of ±0.0074 before the fix); the group carries no signal, so A = 0 exactly."""
    rewards = torch.full((1, 8), 0.1)
    for estimator in BUILT_IN:
        assert group_advantages(rewards, estimator=estimator).eq(0).all(), estimator


@pytest.mark.parametrize("estimator", BUILT_IN)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_groups_without_spread_give_exactly_zero(estimator, eps):
    """1005 float32 groups of random constants, 67 of each size 2..16: every advantage is exactly 0 (and
    not NaN with ε = 0: the 0/0 of a group without spread is 0)."""
    generator = torch.Generator().manual_seed(0)
    for n in range(2, 17):
        rewards = constant_groups(generator, 67, n)
        advantages = group_advantages(rewards, estimator=estimator, eps=eps)
        assert advantages.dtype == torch.float32
        assert advantages.eq(0).all(), (n, advantages.abs().max().item())


@pytest.mark.parametrize("estimator", BUILT_IN)
def test_constant_groups_stay_zero_beside_informative_ones(estimator):
    """Constant groups mixed with groups that have a spread (REINFORCE++-baseline scales every group by the
    batch's std): the constant ones are exactly 0, the others not."""
    generator = torch.Generator().manual_seed(1)
    constant = constant_groups(generator, 50, 6)
    informative = torch.randn(50, 6, generator=generator)
    rewards = torch.cat([constant, informative])
    advantages = group_advantages(rewards, estimator=estimator)
    assert advantages[:50].eq(0).all()
    assert advantages[50:].ne(0).any(dim=1).all()


def test_constant_groups_over_ranks_give_zero():
    """REINFORCE++-baseline with the std over every rank (here two ranks holding the same values)."""
    rewards = constant_groups(torch.Generator().manual_seed(2), 40, 5)
    advantages = group_advantages(
        rewards, estimator="reinforce_pp_baseline", all_reduce=lambda t: 2 * t, eps=0.0
    )
    assert advantages.eq(0).all()


def test_unknown_name_lists_every_estimator_and_suggests_one():
    with pytest.raises(ValueError) as error:
        group_advantages(torch.ones(1, 2), estimator="gpro")
    message = str(error.value)
    assert message.startswith("unknown advantage estimator 'gpro'; expected one of ['dr_grpo'")
    for name in [*ADVANTAGE_ESTIMATORS, *TOKEN_ADVANTAGE_ESTIMATORS]:
        assert repr(name) in message
    assert "'reinforce_pp'" in message and "did you mean 'grpo'?" in message


def test_per_token_name_points_to_token_advantages():
    with pytest.raises(ValueError, match=r"'gae' needs per-token KL or rewards .*token_advantages"):
        group_advantages(torch.ones(1, 2), estimator="gae")
