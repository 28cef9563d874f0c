"""Per-token advantage estimators (alignlit.ops.token_advantages): hand-computed values and the registry."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.checks import resolve_registered
from alignlit.ops import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_ADVANTAGE_ESTIMATORS,
    gae,
    kl_penalized_rewards,
    register_advantage,
    register_token_advantage,
    reinforce_pp_returns,
    token_advantages,
)
from alignlit.ops.token_advantages import discounted_returns

# Row 0 has 3 response tokens, row 1 two; row 1's padding holds NaN (must be ignored).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
REWARDS = torch.tensor([[0.0, 0.0, 1.0], [2.0, -1.0, math.nan]], dtype=torch.float64)


def rows(row0: list[float], row1: list[float]) -> torch.Tensor:
    return torch.tensor([row0, row1], dtype=torch.float64)


def test_returns_by_hand():
    """γ = 0.9. Row 0: rewards (0, 0, 1) -> G = (0.9²·1, 0.9·1, 1) = (0.81, 0.9, 1).
    Row 1: rewards (2, -1) -> G_1 = -1, G_0 = 2 + 0.9·(-1) = 1.1; padding 0. Advantages are the returns."""
    advantages, returns = token_advantages(REWARDS, MASK, estimator="returns", gamma=0.9)
    expected = rows([0.81, 0.9, 1.0], [1.1, -1.0, 0.0])
    torch.testing.assert_close(returns, expected)
    torch.testing.assert_close(advantages, expected)


def test_reinforce_pp_by_hand():
    """γ = 0.5. Row 0: rewards (0, 0, 4) -> G = (1, 2, 4); row 1: rewards (1, -2) -> G = (1 + 0.5·(-2), -2)
    = (0, -2). The 5 valid returns (1, 2, 4, 0, -2): mean 1, deviations (0, 1, 3, -1, -3), squares sum 20,
    unbiased variance 20/4 = 5; A = deviation/√(5 + 1e-8) = (0, 0.447214, 1.341641 | -0.447214, -1.341641)."""
    rewards = rows([0.0, 0.0, 4.0], [1.0, -2.0, math.nan])
    advantages, returns = token_advantages(rewards, MASK, estimator="reinforce_pp", gamma=0.5)
    torch.testing.assert_close(returns, rows([1.0, 2.0, 4.0], [0.0, -2.0, 0.0]))
    std = math.sqrt(5.0 + 1e-8)
    torch.testing.assert_close(advantages, rows([0.0, 1 / std, 3 / std], [-1 / std, -3 / std, 0.0]))


def test_reinforce_pp_over_ranks_by_hand():
    """Two ranks holding the same batch (all_reduce doubles every sum): count 10, mean 1, M2 = 2·20 = 40,
    unbiased variance 40/9; A = deviation/√(40/9 + 1e-8) = (0, 0.474342, 1.423025 | -0.474342, -1.423025)."""
    rewards = rows([0.0, 0.0, 4.0], [1.0, -2.0, 0.0])
    advantages, _ = token_advantages(
        rewards, MASK, estimator="reinforce_pp", gamma=0.5, all_reduce=lambda t: 2 * t
    )
    std = math.sqrt(40 / 9 + 1e-8)
    torch.testing.assert_close(advantages, rows([0.0, 1 / std, 3 / std], [-1 / std, -3 / std, 0.0]))


def test_gae_by_hand():
    """γ = 1, λ = 0.5. Row 0: V = (0.5, 0.5, 0.5), rewards (0, 0, 1): δ_2 = 1 + 0 - 0.5 = 0.5,
    δ_1 = 0 + 0.5 - 0.5 = 0, δ_0 = 0; A_2 = 0.5, A_1 = 0 + 0.5·0.5 = 0.25, A_0 = 0.5·0.25 = 0.125;
    returns A + V = (0.625, 0.75, 1). Row 1: V = (1, 0), rewards (2, -1): δ_1 = -1 + 0 - 0 = -1,
    δ_0 = 2 + 0 - 1 = 1; A = (1 + 0.5·(-1), -1) = (0.5, -1); returns (1.5, -1)."""
    values = rows([0.5, 0.5, 0.5], [1.0, 0.0, 9.0])
    advantages, returns = token_advantages(REWARDS, MASK, estimator="gae", values=values, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, rows([0.125, 0.25, 0.5], [0.5, -1.0, 0.0]))
    torch.testing.assert_close(returns, rows([0.625, 0.75, 1.0], [1.5, -1.0, 0.0]))
    direct = gae(REWARDS.nan_to_num(), values, MASK, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, direct[0], rtol=0, atol=0)


def test_reinforce_pp_returns_is_the_registry_entry_on_kl_shaped_rewards():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, generator=generator, dtype=torch.float64)
    kl = torch.rand(4, 6, generator=generator, dtype=torch.float64)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 1, 0, 4])[:, None]
    rewards = kl_penalized_rewards(scores, kl, mask, kl_coef=0.1)
    expected, _ = token_advantages(rewards, mask, estimator="reinforce_pp", gamma=0.9)
    got = reinforce_pp_returns(scores, kl, mask, kl_coef=0.1, gamma=0.9)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_function_can_be_passed_directly():
    advantages, _ = token_advantages(REWARDS, MASK, estimator=discounted_returns, gamma=0.9)
    torch.testing.assert_close(advantages, rows([0.81, 0.9, 1.0], [1.1, -1.0, 0.0]))


def test_register_token_advantage_makes_a_config_key():
    """A research estimator (undiscounted reward-to-go doubled) is usable by name once registered; a
    second one with the same name, or with a group estimator's name, is refused."""

    @register_token_advantage("test_doubled_returns")
    def doubled(token_rewards, values, mask, *, gamma, lam, all_reduce=None):
        returns = 2 * token_rewards.flip(1).cumsum(1).flip(1) * mask
        return returns, returns

    try:
        advantages, _ = token_advantages(REWARDS, MASK, estimator="test_doubled_returns")
        torch.testing.assert_close(advantages, rows([2.0, 2.0, 2.0], [2.0, -2.0, 0.0]))
        with pytest.raises(ValueError, match="'test_doubled_returns' is already registered"):
            register_token_advantage("test_doubled_returns")(doubled)
    finally:
        del TOKEN_ADVANTAGE_ESTIMATORS["test_doubled_returns"]
    with pytest.raises(ValueError, match=r"'gae' is already registered \(a per-token estimator\)"):
        register_token_advantage("gae")(doubled)
    with pytest.raises(ValueError, match=r"'grpo' is already registered \(a group estimator\)"):
        register_token_advantage("grpo")(doubled)
    with pytest.raises(ValueError, match=r"'reinforce_pp' is already registered \(a per-token estimator\)"):
        register_advantage("reinforce_pp")(lambda rewards, *, eps: rewards)


def test_dotted_path_resolves_like_the_other_registries():
    """A config may name an estimator by its dotted path (alignlit.checks.resolve_registered)."""
    assert (
        resolve_registered("reinforce_pp", TOKEN_ADVANTAGE_ESTIMATORS, "advantage estimator")
        == "reinforce_pp"
    )
    fn = resolve_registered(
        "alignlit.ops.token_advantages.discounted_returns", TOKEN_ADVANTAGE_ESTIMATORS, "advantage estimator"
    )
    assert fn is discounted_returns


def test_unknown_name_lists_every_estimator_and_suggests_one():
    with pytest.raises(ValueError) as error:
        token_advantages(REWARDS, MASK, estimator="reinforce_ppp")
    message = str(error.value)
    assert message.startswith("unknown advantage estimator 'reinforce_ppp'; expected one of")
    for name in [*ADVANTAGE_ESTIMATORS, *TOKEN_ADVANTAGE_ESTIMATORS]:
        assert repr(name) in message
    assert "did you mean 'reinforce_pp'?" in message
    with pytest.raises(ValueError, match=r"'grpo' is a group estimator.*group_advantages"):
        token_advantages(REWARDS, MASK, estimator="grpo")


def test_token_advantages_input_validation():
    values = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="'gae' needs the critic's values"):
        token_advantages(REWARDS, MASK, estimator="gae", lam=0.95)
    with pytest.raises(ValueError, match="'returns' uses no critic"):
        token_advantages(REWARDS, MASK, estimator="returns", values=values)
    with pytest.raises(ValueError, match=r"'reinforce_pp' has no λ .* got lam=0\.95"):
        token_advantages(REWARDS, MASK, estimator="reinforce_pp", lam=0.95)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1\.5"):
        token_advantages(REWARDS, MASK, estimator="returns", gamma=1.5)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got -0\.1"):
        token_advantages(REWARDS, MASK, estimator="gae", values=values, lam=-0.1)
    with pytest.raises(ValueError, match="right-padded"):
        token_advantages(REWARDS, torch.tensor([[0, 1, 1], [1, 0, 0]]), estimator="returns")
    with pytest.raises(ValueError, match=r"token_rewards must have shape \(N, T\)"):
        token_advantages(REWARDS[0], MASK[0], estimator="returns")
    with pytest.raises(ValueError, match=r"token_rewards has shape \(2, 3\) but values has shape \(2, 2\)"):
        token_advantages(REWARDS, MASK, estimator="gae", values=values[:, :2])
    bad = REWARDS.clone()
    bad[0, 1] = math.inf
    with pytest.raises(ValueError, match=r"token_rewards \(at valid tokens\) must be finite.*\(0, 1\)"):
        token_advantages(bad, MASK, estimator="returns")
    with pytest.raises(ValueError, match="mask has 1 valid token"):
        token_advantages(REWARDS, torch.tensor([[1, 0, 0], [0, 0, 0]]), estimator="reinforce_pp")
    with pytest.raises(ValueError, match=r"returned advantages of shape \(2,\)"):
        token_advantages(REWARDS, MASK, estimator=lambda r, v, m, **kw: (r.sum(1), r))
