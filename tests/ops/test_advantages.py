"""Tests for alignlit.ops.advantages: hand-computed values and naive per-element references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from alignlit.ops import (
    ADVANTAGE_ESTIMATORS,
    gae,
    group_advantages,
    register_advantage,
    reinforce_pp_returns,
)

# Two prompts, four samples each.
#   row 0: rewards 1, 2, 3, 6 -> mean 3, deviations -2, -1, 0, 3, population variance 14/4 = 3.5
#   row 1: rewards 0, 0, 1, 1 -> mean 0.5, deviations ±0.5, population variance 0.25
REWARDS = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)


def test_grpo_by_hand():
    """A = (r - mean)/std: row 0 (-2, -1, 0, 3)/√3.5 = (-1.069045, -0.534522, 0, 1.603567);
    row 1 (-0.5, -0.5, 0.5, 0.5)/0.5 = (-1, -1, 1, 1)."""
    advantages = group_advantages(REWARDS, estimator="grpo", eps=0.0)
    expected = torch.tensor(
        [[-1.069045, -0.534522, 0.0, 1.603567], [-1.0, -1.0, 1.0, 1.0]], dtype=torch.float64
    )
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_grpo_eps_is_added_to_the_std():
    """Row 1 has std 0.5; with ε = 0.5 the advantages are ±0.5/(0.5 + 0.5) = ±0.5."""
    advantages = group_advantages(REWARDS[1:], estimator="grpo", eps=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[-0.5, -0.5, 0.5, 0.5]], dtype=torch.float64))


def test_grpo_equal_rewards_give_zero_advantages():
    """A group with rewards (2, 2, 2): deviations 0, std 0, so 0/(0 + 1e-6) = 0 (no NaN)."""
    advantages = group_advantages(torch.full((1, 3), 2.0), estimator="grpo")
    torch.testing.assert_close(advantages, torch.zeros(1, 3))


def test_dr_grpo_by_hand():
    """A = r - mean: row 0 (-2, -1, 0, 3); row 1 (-0.5, -0.5, 0.5, 0.5); no std division."""
    advantages = group_advantages(REWARDS, estimator="dr_grpo")
    expected = torch.tensor([[-2.0, -1.0, 0.0, 3.0], [-0.5, -0.5, 0.5, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)


def test_rloo_by_hand():
    """Leave-one-out baselines, row 0: r_0 = 1 vs mean(2, 3, 6) = 11/3 -> -8/3;
    r_1 = 2 vs mean(1, 3, 6) = 10/3 -> -4/3; r_2 = 3 vs mean(1, 2, 6) = 3 -> 0;
    r_3 = 6 vs mean(1, 2, 3) = 2 -> 4.
    Row 1: r = 0 vs mean(0, 1, 1) = 2/3 -> -2/3; r = 1 vs mean(0, 0, 1) = 1/3 -> 2/3.
    """
    advantages = group_advantages(REWARDS, estimator="rloo")
    expected = torch.tensor([[-8 / 3, -4 / 3, 0.0, 4.0], [-2 / 3, -2 / 3, 2 / 3, 2 / 3]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)


def test_reinforce_pp_baseline_by_hand():
    """Centred per group c = (-2, -1, 0, 3 | -0.5, -0.5, 0.5, 0.5); over all 8 values mean 0, population
    variance (4 + 1 + 0 + 9 + 4·0.25)/8 = 15/8, std 1.369306; A = c/1.369306 =
    (-1.460593, -0.730297, 0, 2.190890 | -0.365148, -0.365148, 0.365148, 0.365148).
    A per-group std would give row 1 (-1, -1, 1, 1) instead (that is GRPO)."""
    advantages = group_advantages(REWARDS, estimator="reinforce_pp_baseline", eps=0.0)
    expected = torch.tensor(
        [[-1.460593, -0.730297, 0.0, 2.190890], [-0.365148, -0.365148, 0.365148, 0.365148]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def naive_advantages(rewards: list[list[float]], estimator: str, eps: float) -> list[list[float]]:
    """Element-by-element reference with Python's ``statistics`` module."""
    out = []
    if estimator == "reinforce_pp_baseline":
        centred = [[r - statistics.fmean(row) for r in row] for row in rewards]
        std = statistics.pstdev([c for row in centred for c in row])
        return [[c / (std + eps) for c in row] for row in centred]
    for row in rewards:
        mean = statistics.fmean(row)
        if estimator == "grpo":
            out.append([(r - mean) / (statistics.pstdev(row) + eps) for r in row])
        elif estimator == "dr_grpo":
            out.append([r - mean for r in row])
        elif estimator == "rloo":
            out.append([r - statistics.fmean(row[:j] + row[j + 1 :]) for j, r in enumerate(row)])
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_estimators_match_naive_reference(estimator):
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    expected = torch.tensor(naive_advantages(rewards.tolist(), estimator, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(
        group_advantages(rewards, estimator=estimator), expected, rtol=1e-12, atol=1e-12
    )


def test_integer_and_bool_rewards_are_converted():
    """0/1 correctness rewards (1, 0, 0, 1): mean 0.5, Dr. GRPO advantages ±0.5 in the default float dtype."""
    for rewards in (torch.tensor([[1, 0, 0, 1]]), torch.tensor([[True, False, False, True]])):
        advantages = group_advantages(rewards, estimator="dr_grpo")
        assert advantages.dtype == torch.get_default_dtype()
        torch.testing.assert_close(advantages, torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_register_advantage_makes_a_config_key():
    """A research estimator (here: the raw reward, no baseline) is usable by name once registered."""

    @register_advantage("test_raw_reward")
    def raw_reward(rewards: torch.Tensor, *, eps: float) -> torch.Tensor:
        return rewards.clone()

    try:
        torch.testing.assert_close(group_advantages(REWARDS, estimator="test_raw_reward"), REWARDS)
        with pytest.raises(ValueError, match="'test_raw_reward' is already registered"):
            register_advantage("test_raw_reward")(raw_reward)
    finally:
        del ADVANTAGE_ESTIMATORS["test_raw_reward"]
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_advantage("grpo")(raw_reward)


def test_a_function_can_be_passed_directly():
    torch.testing.assert_close(group_advantages(REWARDS, estimator=lambda r, eps: r * 2), REWARDS * 2)


def test_group_advantages_input_validation():
    with pytest.raises(ValueError, match=r"rewards must have shape \(B, n\), got \(4,\)"):
        group_advantages(REWARDS[0], estimator="grpo")
    with pytest.raises(ValueError, match=r"rloo needs at least 2 samples per prompt .* got n=1"):
        group_advantages(REWARDS[:, :1], estimator="rloo")
    with pytest.raises(ValueError, match=r"at least one prompt and one sample, got shape \(2, 0\)"):
        group_advantages(REWARDS[:, :0], estimator="grpo")
    bad = REWARDS.clone()
    bad[1, 2] = math.nan
    with pytest.raises(ValueError, match=r"rewards must be finite; .* at index \(1, 2\): nan"):
        group_advantages(bad, estimator="grpo")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gpro'; expected one of \['dr_grpo'"):
        group_advantages(REWARDS, estimator="gpro")
    with pytest.raises(ValueError, match=r"'reinforce_pp' needs per-token KL .*reinforce_pp_returns"):
        group_advantages(REWARDS, estimator="reinforce_pp")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        group_advantages(REWARDS, estimator="grpo", eps=-1.0)
    with pytest.raises(ValueError, match=r"returned shape \(2,\), expected the shape of rewards \(2, 4\)"):
        group_advantages(REWARDS, estimator=lambda r, eps: r.mean(1))


# ---------------------------------------------------------------- REINFORCE++

SCORES = torch.tensor([1.0, -1.0], dtype=torch.float64)
# Row 0 has 3 response tokens, row 1 one; padding holds garbage that must be ignored.
KL = torch.tensor([[0.1, 0.2, 0.3], [0.5, math.nan, 9.0]], dtype=torch.float64)
TOKEN_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_reinforce_pp_returns_by_hand():
    """β = 0.5, γ = 1. Token rewards -β·kl: row 0 (-0.05, -0.1, -0.15 + 1) = (-0.05, -0.1, 0.85);
    row 1 (-0.25 - 1) = (-1.25). Returns (suffix sums): row 0 (0.70, 0.75, 0.85), row 1 (-1.25).
    Whitening over the 4 valid returns: mean 1.05/4 = 0.2625, deviations (0.4375, 0.4875, 0.5875, -1.5125),
    unbiased variance 3.061875/3 = 1.020625; advantages = deviations/√1.020625 =
    (0.433057, 0.482549, 0.581534 | -1.497140), 0 at padding.
    """
    advantages = reinforce_pp_returns(SCORES, KL, TOKEN_MASK, kl_coef=0.5, gamma=1.0)
    expected = torch.tensor([[0.433057, 0.482549, 0.581534], [-1.497140, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_reinforce_pp_returns_discount_by_hand():
    """γ = 0.5, same token rewards: row 0 G_2 = 0.85, G_1 = -0.1 + 0.5·0.85 = 0.325,
    G_0 = -0.05 + 0.5·0.325 = 0.1125; row 1 G_0 = -1.25. Mean 0.0375/4 = 0.009375, unbiased variance
    0.800977; advantages (0.115227, 0.352664, 0.939274 | -1.407165).
    """
    advantages = reinforce_pp_returns(SCORES, KL, TOKEN_MASK, kl_coef=0.5, gamma=0.5)
    expected = torch.tensor([[0.115227, 0.352664, 0.939274], [-1.407165, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def naive_reinforce_pp(scores, kl, mask, kl_coef, gamma):
    """Per-token loops: rewards, suffix returns, then whitening with torch's unbiased var."""
    rows, steps = mask.shape
    returns = torch.zeros(rows, steps, dtype=torch.float64)
    for i in range(rows):
        length = int(mask[i].sum())
        rewards = [-kl_coef * float(kl[i, t]) for t in range(length)]
        if length:
            rewards[-1] += float(scores[i])
        for t in range(length):
            returns[i, t] = sum(gamma ** (s - t) * rewards[s] for s in range(t, length))
    valid = returns[mask.bool()]
    out = (returns - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    return out * mask


def test_reinforce_pp_returns_matches_naive_reference():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(6, generator=generator, dtype=torch.float64)
    kl = torch.rand(6, 5, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 0, 3, 4, 2])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    advantages = reinforce_pp_returns(scores, kl, mask, kl_coef=0.05, gamma=0.9)
    expected = naive_reinforce_pp(scores, kl, mask, 0.05, 0.9)
    torch.testing.assert_close(advantages, expected, rtol=1e-10, atol=1e-10)
    assert (advantages[2] == 0).all()


def test_reinforce_pp_returns_are_gae_with_zero_values():
    """Before whitening, the returns are GAE with V ≡ 0 and λ = 1: check the reference formula the docstring
    states on the same inputs (β = 0 and γ = 1: every token's return is the score)."""
    advantages = reinforce_pp_returns(SCORES, KL, TOKEN_MASK, kl_coef=0.0, gamma=1.0)
    returns, _ = gae(
        torch.tensor([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0]], dtype=torch.float64),
        torch.zeros(2, 3, dtype=torch.float64),
        TOKEN_MASK,
        gamma=1.0,
        lam=1.0,
    )
    torch.testing.assert_close(
        returns, torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    )
    # Valid returns (1, 1, 1, -1): mean 0.5, deviations (0.5, 0.5, 0.5, -1.5), unbiased variance 3/3 = 1.
    std = math.sqrt(1.0 + 1e-8)
    expected = torch.tensor([[0.5 / std] * 3, [-1.5 / std, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)


def test_reinforce_pp_returns_input_validation():
    with pytest.raises(ValueError, match=r"scores has 3 rows but kl has 2"):
        reinforce_pp_returns(torch.zeros(3), KL, TOKEN_MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"scores must have shape \(N,\)"):
        reinforce_pp_returns(torch.zeros(2, 1), KL, TOKEN_MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"kl has shape \(2, 3\) but mask has shape \(2, 2\)"):
        reinforce_pp_returns(SCORES, KL, TOKEN_MASK[:, :2], kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        reinforce_pp_returns(SCORES, KL, TOKEN_MASK, kl_coef=-0.1)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        reinforce_pp_returns(SCORES, KL, TOKEN_MASK, kl_coef=0.1, gamma=1.5)
    with pytest.raises(ValueError, match="mask has 1 valid token"):
        reinforce_pp_returns(SCORES, KL, torch.tensor([[1, 0, 0], [0, 0, 0]]), kl_coef=0.1)
    with pytest.raises(ValueError, match="right-padded"):
        reinforce_pp_returns(SCORES, KL, torch.tensor([[0, 1, 1], [1, 0, 0]]), kl_coef=0.1)
    bad = KL.clone()
    bad[0, 1] = math.inf
    with pytest.raises(ValueError, match=r"kl \(at valid tokens\) must be finite.*index \(0, 1\)"):
        reinforce_pp_returns(SCORES, bad, TOKEN_MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"scores must be finite.*index \(1,\)"):
        reinforce_pp_returns(torch.tensor([0.0, math.nan]), KL, TOKEN_MASK, kl_coef=0.1)
