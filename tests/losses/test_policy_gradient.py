"""Tests for alignlit.losses.policy_gradient with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.losses import LOSS_AGGREGATIONS, policy_gradient_loss, ppo_policy_loss, register_aggregation

# Two sequences, ε_low = 0.2, ε_high = 0.28 (DAPO), advantages (N,) = (+1, -2) broadcast over tokens.
# Row 0 has 3 valid tokens, row 1 one; row 1's padding holds ρ = 5 (must be ignored).
#   (0,0) ρ = 1.5,  A = +1: unclipped 1.5,  clipped 1.28 -> min 1.28, l = -1.28  (high clip active)
#   (0,1) ρ = 0.5,  A = +1: unclipped 0.5,  clipped 0.8  -> min 0.5,  l = -0.5   (no clip: A > 0)
#   (0,2) ρ = 1.25, A = +1: unclipped 1.25, clipped 1.25 -> l = -1.25 (a symmetric ε = 0.2 would clip it)
#   (1,0) ρ = 0.5,  A = -2: unclipped -1.0, clipped -1.6 -> min -1.6, l = 1.6    (low clip active)
# Row sums: -3.03 (3 tokens) and 1.6 (1 token); total -1.43 over 4 valid tokens.
# Gradient of l w.r.t. log π_θ: -ρ·A where unclipped, 0 where clipped: (0, -0.5, -1.25 | 0).
RATIOS = torch.tensor([[1.5, 0.5, 1.25], [0.5, 5.0, 5.0]], dtype=torch.float64)
ADVANTAGES = torch.tensor([1.0, -2.0], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
OLD_LOGPROBS = torch.full((2, 3), -1.0, dtype=torch.float64)
CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def run(aggregation="token_mean", advantages=ADVANTAGES, ratios=RATIOS, **kwargs):
    """Loss, metrics and the gradient w.r.t. log π_θ."""
    logprobs = (OLD_LOGPROBS + torch.log(ratios)).requires_grad_(True)
    kwargs = {**CLIP, **kwargs}
    loss, metrics = policy_gradient_loss(
        logprobs, OLD_LOGPROBS, advantages, MASK, aggregation=aggregation, **kwargs
    )
    loss.backward()
    return loss, metrics, logprobs.grad


def grad_rows(row0: list[float], row1: list[float]) -> torch.Tensor:
    return torch.tensor([row0, row1], dtype=torch.float64)


def test_token_mean_by_hand():
    """token_mean: -1.43/4 = -0.3575; gradient (0, -0.5, -1.25 | 0)/4 = (0, -0.125, -0.3125 | 0)."""
    loss, metrics, grad = run("token_mean")
    assert loss.item() == pytest.approx(-0.3575)
    assert metrics["pg_loss"].item() == pytest.approx(-0.3575)
    torch.testing.assert_close(grad, grad_rows([0.0, -0.125, -0.3125], [0.0, 0.0, 0.0]))


def test_seq_mean_token_mean_by_hand():
    """seq_mean_token_mean: row means -3.03/3 = -1.01 and 1.6; mean (-1.01 + 1.6)/2 = 0.295.
    Gradient: row 0 tokens weigh 1/(2·3): (0, -0.5/6, -1.25/6) = (0, -0.083333, -0.208333)."""
    loss, _, grad = run("seq_mean_token_mean")
    assert loss.item() == pytest.approx(0.295)
    torch.testing.assert_close(grad, grad_rows([0.0, -0.5 / 6, -1.25 / 6], [0.0, 0.0, 0.0]))


def test_seq_mean_token_sum_by_hand():
    """seq_mean_token_sum: row sums -3.03 and 1.6; mean -1.43/2 = -0.715. Gradient (0, -0.5, -1.25)/2."""
    loss, _, grad = run("seq_mean_token_sum")
    assert loss.item() == pytest.approx(-0.715)
    torch.testing.assert_close(grad, grad_rows([0.0, -0.25, -0.625], [0.0, 0.0, 0.0]))


def test_seq_mean_token_sum_norm_by_hand():
    """seq_mean_token_sum_norm, L_max = 4: -1.43/(N·L_max) = -1.43/8 = -0.17875.
    Gradient (0, -0.5, -1.25 | 0)/8."""
    loss, _, grad = run("seq_mean_token_sum_norm", max_length=4)
    assert loss.item() == pytest.approx(-0.17875)
    torch.testing.assert_close(grad, grad_rows([0.0, -0.0625, -0.15625], [0.0, 0.0, 0.0]))


def test_both_clip_sides_by_hand():
    """clip_frac_high: (0,0) only (A > 0, ρ = 1.5 > 1.28) -> 1/4; clip_frac_low: (1,0) only (A < 0,
    ρ = 0.5 < 0.8) -> 1/4. ratio_mean (1.5 + 0.5 + 1.25 + 0.5)/4 = 0.9375, ratio_max 1.5.
    approx_kl = ½(ln²1.5 + 2·ln²0.5 + ln²1.25)/4 = ½(0.164402 + 0.960906 + 0.049793)/4 = 0.146888.
    """
    _, metrics, _ = run()
    assert metrics["clip_frac_high"].item() == pytest.approx(0.25)
    assert metrics["clip_frac_low"].item() == pytest.approx(0.25)
    assert metrics["ratio_mean"].item() == pytest.approx(0.9375)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    assert metrics["approx_kl"].item() == pytest.approx(0.146888, abs=1e-6)
    assert not {"kl", "entropy", "is_weight_mean"} & set(metrics)
    assert all(not value.requires_grad for value in metrics.values())


def test_clip_higher_vs_symmetric_clip_by_hand():
    """ε_high = 0.2 (symmetric): (0,2) ρ = 1.25 > 1.2 is now clipped, l = -1.2; (0,0) l = -1.2.
    token_mean = (-1.2 - 0.5 - 1.2 + 1.6)/4 = -0.325; clip_frac_high 2/4; the gradient at (0,2) is 0.
    Equal to ppo_policy_loss with ε = 0.2 on the broadcast advantages."""
    loss, metrics, grad = run(clip_high=0.2)
    assert loss.item() == pytest.approx(-0.325)
    assert metrics["clip_frac_high"].item() == pytest.approx(0.5)
    torch.testing.assert_close(grad, grad_rows([0.0, -0.125, 0.0], [0.0, 0.0, 0.0]))
    logprobs = OLD_LOGPROBS + torch.log(RATIOS)
    ppo_loss, _ = ppo_policy_loss(
        logprobs, OLD_LOGPROBS, ADVANTAGES[:, None].expand(2, 3), MASK, clip_eps=0.2
    )
    assert loss.item() == pytest.approx(ppo_loss.item())


def test_wider_low_clip_by_hand():
    """ε_low = 0.6 (lower bound 0.4): (1,0) ρ = 0.5 is inside, l = -ρ·A = 1.0, no low clip.
    token_mean = (-3.03 + 1.0)/4 = -0.5075; clip_frac_low 0; gradient at (1,0) -ρ·A/4 = 1.0/4 = 0.25."""
    loss, metrics, grad = run(clip_low=0.6)
    assert loss.item() == pytest.approx(-0.5075)
    assert metrics["clip_frac_low"].item() == 0.0
    torch.testing.assert_close(grad, grad_rows([0.0, -0.125, -0.3125], [0.25, 0.0, 0.0]))


def test_per_token_advantages_equal_broadcast_ones():
    per_token = ADVANTAGES[:, None].expand(2, 3).clone()
    per_token[1, 1:] = math.nan  # padding
    loss_tokens, _, grad_tokens = run(advantages=per_token)
    loss_rows, _, grad_rows_ = run(advantages=ADVANTAGES)
    assert loss_tokens.item() == loss_rows.item()
    torch.testing.assert_close(grad_tokens, grad_rows_)


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
def test_gradient_is_zero_exactly_where_the_clip_is_active(aggregation):
    """Random ratios in (0.5, 1.5) and advantages ±: the gradient vanishes on a valid token iff
    (A > 0 and ρ > 1 + ε_high) or (A < 0 and ρ < 1 - ε_low); the clip fractions count those tokens."""
    generator = torch.Generator().manual_seed(0)
    ratios = 0.5 + torch.rand(6, 8, generator=generator, dtype=torch.float64)
    advantages = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    mask = (torch.arange(8)[None, :] < torch.tensor([8, 1, 5, 3, 8, 6])[:, None]).long()
    old = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    logprobs = (old + torch.log(ratios)).requires_grad_(True)
    loss, metrics = policy_gradient_loss(
        logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28, aggregation=aggregation, max_length=8
    )
    loss.backward()
    valid = mask.bool()
    high = (advantages > 0) & (ratios > 1.28) & valid
    low = (advantages < 0) & (ratios < 0.8) & valid
    assert high.any() and low.any() and (valid & ~high & ~low).any()
    assert torch.equal(logprobs.grad == 0, high | low | ~valid)
    assert metrics["clip_frac_high"].item() == pytest.approx(high.sum().item() / valid.sum().item())
    assert metrics["clip_frac_low"].item() == pytest.approx(low.sum().item() / valid.sum().item())


def test_dr_grpo_aggregation_has_no_length_bias():
    """ρ = 1, A = 1 on a 1-token and a 3-token sequence. seq_mean_token_sum_norm (L_max = 4) gives every
    token the same gradient -1/(N·L_max) = -1/8; seq_mean_token_mean gives the short sequence's token
    -1/(2·1) = -0.5 and each long-sequence token -1/(2·3) = -0.166667."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    for aggregation, expected in (
        ("seq_mean_token_sum_norm", grad_rows([-0.125, 0.0, 0.0], [-0.125] * 3)),
        ("seq_mean_token_mean", grad_rows([-0.5, 0.0, 0.0], [-1 / 6] * 3)),
    ):
        logprobs = OLD_LOGPROBS.clone().requires_grad_(True)
        loss, _ = policy_gradient_loss(
            logprobs,
            OLD_LOGPROBS,
            torch.ones(2, dtype=torch.float64),
            mask,
            **CLIP,
            aggregation=aggregation,
            max_length=4,
        )
        loss.backward()
        torch.testing.assert_close(logprobs.grad, expected)


def test_sequence_means_skip_sequences_without_tokens():
    """A third, empty row changes neither seq_mean_token_mean (0.295) nor seq_mean_token_sum (-0.715)."""
    logprobs = torch.cat([OLD_LOGPROBS + torch.log(RATIOS), torch.zeros(1, 3, dtype=torch.float64)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.long)])
    advantages = torch.cat([ADVANTAGES, torch.tensor([5.0], dtype=torch.float64)])
    old = torch.cat([OLD_LOGPROBS, torch.zeros(1, 3, dtype=torch.float64)])
    for aggregation, expected in (("seq_mean_token_mean", 0.295), ("seq_mean_token_sum", -0.715)):
        loss, _ = policy_gradient_loss(logprobs, old, advantages, mask, **CLIP, aggregation=aggregation)
        assert loss.item() == pytest.approx(expected)


def test_kl_loss_term_by_hand():
    """k3 with log π_0 - log π_θ = ln 2 at (0,0) and -ln 2 at (1,0), 0 elsewhere:
    k3 = e^d - 1 - d = (2 - 1 - 0.693147, 0, 0 | 0.5 - 1 + 0.693147) = (0.306853, 0, 0 | 0.193147), sum 0.5.
    token_mean: kl = 0.5/4 = 0.125; loss = -0.3575 + 0.1·0.125 = -0.345.
    seq_mean_token_mean: (0.306853/3 + 0.193147)/2 = 0.147716; loss = 0.295 + 0.1·0.147716 = 0.309772.
    Gradient of k3 w.r.t. log π_θ is 1 - e^d: -1 at (0,0), 0.5 at (1,0); token_mean adds 0.1·(-1, 0.5)/4.
    """
    logprobs = OLD_LOGPROBS + torch.log(RATIOS)
    ref = logprobs + torch.tensor(
        [[math.log(2), 0.0, 0.0], [-math.log(2), math.nan, 0.0]], dtype=torch.float64
    )
    loss, metrics, grad = run(ref_logprobs=ref, kl_coef=0.1, kl_estimator="k3")
    assert loss.item() == pytest.approx(-0.345)
    assert metrics["kl"].item() == pytest.approx(0.125)
    assert metrics["pg_loss"].item() == pytest.approx(-0.3575)
    torch.testing.assert_close(grad, grad_rows([-0.025, -0.125, -0.3125], [0.0125, 0.0, 0.0]))
    loss, _, _ = run("seq_mean_token_mean", ref_logprobs=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.309772, abs=1e-6)
    loss, metrics, _ = run(ref_logprobs=ref, kl_coef=0.0, kl_estimator="k1")
    assert loss.item() == pytest.approx(-0.3575)
    assert metrics["kl"].item() == pytest.approx(0.0)  # k1 = log π_θ - log π_0: (-ln 2 + ln 2)/4


def test_entropy_bonus_by_hand():
    """Entropies (1, 2, 3 | 4), c_H = 0.01, token_mean: mean 2.5; loss = -0.3575 - 0.01·2.5 = -0.3825;
    the entropy's gradient is -0.01/4 = -0.0025 on every valid token, 0 at padding."""
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, math.nan, 9.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics, _ = run(entropy=entropy, entropy_coef=0.01)
    assert loss.item() == pytest.approx(-0.3825)
    assert metrics["entropy"].item() == pytest.approx(2.5)
    torch.testing.assert_close(entropy.grad, -0.0025 * MASK.double())


def test_importance_weights_by_hand():
    """w = (2, 0.5, 3 | 1): token losses (-2.56, -0.25, -3.75 | 1.6), token_mean -4.96/4 = -1.24;
    is_weight_mean (2 + 0.5 + 3 + 1)/4 = 1.625;
    gradient w·(0, -0.5, -1.25 | 0)/4 = (0, -0.0625, -0.9375 | 0)."""
    weights = torch.tensor([[2.0, 0.5, 3.0], [1.0, 7.0, math.nan]], dtype=torch.float64)
    loss, metrics, grad = run(is_weights=weights)
    assert loss.item() == pytest.approx(-1.24)
    assert metrics["is_weight_mean"].item() == pytest.approx(1.625)
    torch.testing.assert_close(grad, grad_rows([0.0, -0.0625, -0.9375], [0.0, 0.0, 0.0]))


def test_padding_garbage_reaches_neither_loss_nor_gradient():
    logprobs = (OLD_LOGPROBS + torch.log(RATIOS)).detach()
    logprobs[1, 1] = math.nan
    logprobs.requires_grad_(True)
    old = OLD_LOGPROBS.clone()
    old[1, 2] = -math.inf
    ref = torch.full((2, 3), math.nan, dtype=torch.float64)
    ref[0] = logprobs[0].detach()
    ref[1, 0] = logprobs[1, 0].detach()
    loss, metrics = policy_gradient_loss(
        logprobs, old, ADVANTAGES, MASK, **CLIP, aggregation="token_mean", ref_logprobs=ref, kl_coef=0.1
    )
    loss.backward()
    assert loss.item() == pytest.approx(-0.3575)
    assert torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(value) for value in metrics.values())


def test_register_aggregation_makes_a_config_key():
    """A research aggregation (sum over every valid token, no normalisation): -1.43."""

    @register_aggregation("test_token_sum")
    def token_sum(values, mask, *, max_length):
        return (values * mask).sum()

    try:
        assert run("test_token_sum")[0].item() == pytest.approx(-1.43)
        with pytest.raises(ValueError, match="'test_token_sum' is already registered"):
            register_aggregation("test_token_sum")(token_sum)
    finally:
        del LOSS_AGGREGATIONS["test_token_sum"]


def test_policy_gradient_loss_input_validation():
    logprobs = OLD_LOGPROBS + torch.log(RATIOS)

    def call(**overrides):
        kwargs = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean", **overrides}
        args = {"logprobs": logprobs, "old_logprobs": OLD_LOGPROBS, "advantages": ADVANTAGES, "mask": MASK}
        for name in list(args):
            if name in kwargs:
                args[name] = kwargs.pop(name)
        return policy_gradient_loss(*args.values(), **kwargs)

    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 3\) but old_logprobs has shape \(2, 2\)"):
        call(old_logprobs=OLD_LOGPROBS[:, :2])
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\) but logprobs has 2 rows"):
        call(advantages=torch.zeros(3))
    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 3\) but advantages has shape \(2, 2\)"):
        call(advantages=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 3\) but is_weights has shape \(2, 4\)"):
        call(is_weights=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"logprobs must have shape \(N, T\)"):
        call(logprobs=logprobs[0], old_logprobs=OLD_LOGPROBS[0], mask=MASK[0])
    with pytest.raises(ValueError, match=r"clip_low must be in \(0, 1\], got 0.0"):
        call(clip_low=0.0)
    with pytest.raises(ValueError, match="clip_high must be > 0"):
        call(clip_high=-0.1)
    with pytest.raises(
        ValueError, match=r"unknown loss aggregation 'mean'; expected one of \['seq_mean_token_mean'"
    ):
        call(aggregation="mean")
    with pytest.raises(ValueError, match="'seq_mean_token_sum_norm' needs max_length"):
        call(aggregation="seq_mean_token_sum_norm")
    with pytest.raises(
        ValueError, match=r"max_length must be >= 1 and >= the longest response \(3 valid tokens\)"
    ):
        call(aggregation="seq_mean_token_sum_norm", max_length=2)
    with pytest.raises(ValueError, match=r"kl_coef=0\.1 > 0 needs ref_logprobs"):
        call(kl_coef=0.1)
    with pytest.raises(ValueError, match=r"entropy_coef=0\.1 > 0 needs entropy"):
        call(entropy_coef=0.1)
    with pytest.raises(ValueError, match="is_weights must be >= 0"):
        call(is_weights=-torch.ones(2, 3))
    bad = ADVANTAGES.clone()
    bad[1] = math.inf
    with pytest.raises(ValueError, match=r"advantages must be finite on valid tokens; found inf at \(1, 0\)"):
        call(advantages=bad)
    with pytest.raises(ValueError, match="mask has no valid token"):
        call(mask=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="unknown KL estimator kind 'k4'"):
        call(ref_logprobs=logprobs, kl_estimator="k4")
