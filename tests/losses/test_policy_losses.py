"""Policy losses of alignlit.losses.policy_gradient (POLICY_LOSSES) with hand-computed values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from alignlit.checks import resolve_registered
from alignlit.losses import POLICY_LOSSES, policy_gradient_loss, register_policy_loss
from alignlit.losses.policy_losses import cispo

# Two sequences, log π_old = -2, ε_low = 0.2, ε_high = 0.28, advantages (N,) = (+1, -2) broadcast over tokens.
# Row 0 has 3 valid tokens, row 1 two; row 1's padding holds ρ = 7 (must be ignored).
#   (0,0) ρ = 1.5,  A = +1: unclipped 1.5,  clipped 1.28 -> min 1.28, l = -1.28 (high clip)
#   (0,1) ρ = 0.5,  A = +1: unclipped 0.5,  clipped 0.8  -> min 0.5,  l = -0.5
#   (0,2) ρ = 1.25, A = +1: unclipped 1.25, clipped 1.25 -> l = -1.25
#   (1,0) ρ = 4,    A = -2: unclipped -8,   clipped -2.56 -> min -8,  l = 8
#   (1,1) ρ = 0.5,  A = -2: unclipped -1,   clipped -1.6 -> min -1.6, l = 1.6 (low clip)
# ppo_clip: sum 6.57 over 5 valid tokens; gradient w.r.t. log π_θ: -ρ·A unclipped, 0 clipped:
#   (0, -0.5, -1.25 | 8, 0).
RATIOS = torch.tensor([[1.5, 0.5, 1.25], [4.0, 0.5, 7.0]], dtype=torch.float64)
ADVANTAGES = torch.tensor([1.0, -2.0], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD_LOGPROBS = torch.full((2, 3), -2.0, dtype=torch.float64)
CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def run(policy_loss, aggregation="token_mean", ratios=RATIOS, advantages=ADVANTAGES, mask=MASK, **kwargs):
    """Loss, metrics and the gradient w.r.t. log π_θ."""
    logprobs = (OLD_LOGPROBS + torch.log(ratios)).requires_grad_(True)
    loss, metrics = policy_gradient_loss(
        logprobs, OLD_LOGPROBS, advantages, mask, policy_loss=policy_loss, aggregation=aggregation,
        **{**CLIP, **kwargs},
    )  # fmt: skip
    loss.backward()
    return loss, metrics, logprobs.grad


def rows(row0: list[float], row1: list[float]) -> torch.Tensor:
    return torch.tensor([row0, row1], dtype=torch.float64)


def test_ppo_clip_by_hand():
    """token_mean 6.57/5 = 1.314; gradient (0, -0.5, -1.25 | 8, 0)/5 = (0, -0.1, -0.25 | 1.6, 0);
    clip_frac_high 1/5 ((0,0)), clip_frac_low 1/5 ((1,1)). The default is ppo_clip, bit for bit."""
    loss, metrics, grad = run("ppo_clip")
    assert loss.item() == pytest.approx(1.314)
    torch.testing.assert_close(grad, rows([0.0, -0.1, -0.25], [1.6, 0.0, 0.0]))
    assert metrics["clip_frac_high"].item() == pytest.approx(0.2)
    assert metrics["clip_frac_low"].item() == pytest.approx(0.2)
    logprobs = (OLD_LOGPROBS + torch.log(RATIOS)).requires_grad_(True)
    default, _ = policy_gradient_loss(
        logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, **CLIP, aggregation="token_mean"
    )
    default.backward()
    assert torch.equal(default, loss) and torch.equal(logprobs.grad, grad)


def test_dual_clip_by_hand():
    """c = 3: where A < 0 the loss is at most c·|A|. (1,0): A = -2, ρ = 4 > c, l = min(8, 3·2) = 6, no
    gradient; (1,1): l = min(1.6, 6) = 1.6. Sum 6.57 - 8 + 6 = 4.57, token_mean 0.914;
    gradient (0, -0.1, -0.25 | 0, 0); clip_frac_dual 1/5, the other clip fractions as ppo_clip's."""
    loss, metrics, grad = run("dual_clip")
    assert loss.item() == pytest.approx(0.914)
    torch.testing.assert_close(grad, rows([0.0, -0.1, -0.25], [0.0, 0.0, 0.0]))
    assert metrics["clip_frac_dual"].item() == pytest.approx(0.2)
    assert metrics["clip_frac_high"].item() == pytest.approx(0.2)
    assert metrics["clip_frac_low"].item() == pytest.approx(0.2)


def test_dual_clip_bound_is_an_option():
    """c = 5 (policy_loss_args): the bound c·|A| = 10 is above (1,0)'s 8, so the loss is ppo_clip's 1.314."""
    loss, metrics, grad = run("dual_clip", policy_loss_args={"clip_ratio_c": 5.0})
    assert loss.item() == pytest.approx(1.314)
    assert metrics["clip_frac_dual"].item() == 0.0
    torch.testing.assert_close(grad, rows([0.0, -0.1, -0.25], [1.6, 0.0, 0.0]))
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1, got 1\.0"):
        run("dual_clip", policy_loss_args={"clip_ratio_c": 1.0})


def test_cispo_by_hand():
    """ŵ = clip(ρ, 0.8, 1.28) = (1.28, 0.8, 1.25 | 1.28, 0.8), constants;
    log π_θ = -2 + ln ρ = (-1.594535, -2.693147, -1.776856 | -0.613706, -2.693147);
    l = -ŵ·A·log π_θ = (2.041005, 2.154518, 2.221071 | -1.571086, -4.309035), sum 0.536471,
    token_mean 0.107294. Gradient -ŵ·A/5 = (-0.256, -0.16, -0.25 | 0.512, 0.32): every token keeps one,
    the clipped ones too. clip_frac_high: ρ > 1.28 at (0,0), (1,0) -> 2/5; clip_frac_low: ρ < 0.8 at
    (0,1), (1,1) -> 2/5."""
    loss, metrics, grad = run("cispo")
    assert loss.item() == pytest.approx(0.107294, abs=1e-6)
    torch.testing.assert_close(grad, rows([-0.256, -0.16, -0.25], [0.512, 0.32, 0.0]))
    assert metrics["clip_frac_high"].item() == pytest.approx(0.4)
    assert metrics["clip_frac_low"].item() == pytest.approx(0.4)


# GSPO: token ratios (2, 0.5, 1 | 4, 1), advantages (-1, +1):
#   s_0 = (2·0.5·1)^(1/3) = 1, s_1 = (4·1)^(1/2) = 2.
#   Row 0, A = -1, s = 1 inside the range: l = -min(-1, -1) = 1 on each of its 3 tokens; gradient of
#     -A·s_it w.r.t. log π_θ(y_t) is -A·s_0 = 1 (the token form's gradient is s_i·∇log π_θ(y_t)).
#   Row 1, A = +1, s = 2 > 1.28: l = -min(2, 1.28) = -1.28 on its 2 tokens, no gradient.
# ppo_clip would clip (0,0) (A < 0, ρ = 2: unclipped) and (0,1) (ρ = 0.5 < 0.8) token by token instead.
GSPO_RATIOS = torch.tensor([[2.0, 0.5, 1.0], [4.0, 1.0, 7.0]], dtype=torch.float64)
GSPO_ADVANTAGES = torch.tensor([-1.0, 1.0], dtype=torch.float64)


def test_gspo_by_hand():
    """token_mean: (3·1 + 2·(-1.28))/5 = 0.088, gradient (1, 1, 1 | 0, 0)/5;
    seq_mean_token_mean: (1 + (-1.28))/2 = -0.14, gradient 1/(2·3) = 1/6 on row 0's tokens.
    clip_frac_high 2/5 (row 1's tokens), clip_frac_low 0; seq_ratio_mean (1 + 2)/2 = 1.5."""
    loss, metrics, grad = run("gspo", ratios=GSPO_RATIOS, advantages=GSPO_ADVANTAGES)
    assert loss.item() == pytest.approx(0.088)
    torch.testing.assert_close(grad, rows([0.2, 0.2, 0.2], [0.0, 0.0, 0.0]))
    assert metrics["clip_frac_high"].item() == pytest.approx(0.4)
    assert metrics["clip_frac_low"].item() == 0.0
    assert metrics["seq_ratio_mean"].item() == pytest.approx(1.5)
    loss, _, grad = run("gspo", "seq_mean_token_mean", ratios=GSPO_RATIOS, advantages=GSPO_ADVANTAGES)
    assert loss.item() == pytest.approx(-0.14)
    torch.testing.assert_close(grad, rows([1 / 6] * 3, [0.0, 0.0, 0.0]))


def gspo_sequence_level(logprobs, old, advantages, mask, clip_low, clip_high):
    """GSPO's objective as the paper writes it (Eq. 5, 7): mean_i -min(s_i·A_i, clip(s_i)·A_i)."""
    lengths = mask.sum(1)
    s = torch.exp(((logprobs - old) * mask).sum(1) / lengths)  # (N,)
    return -torch.minimum(s * advantages, torch.clamp(s, 1 - clip_low, 1 + clip_high) * advantages).mean()


@pytest.mark.parametrize("case", ["by_hand", "random"])
def test_gspo_token_form_equals_the_sequence_level_objective(case):
    """With seq_mean_token_mean the token form has GSPO's value and gradient: on the hand-built case and on
    random sequences with the paper's ranges (ε = 3e-4, 4e-4), some of them clipped and some not."""
    if case == "by_hand":
        old, advantages, mask, clip = OLD_LOGPROBS, GSPO_ADVANTAGES, MASK, CLIP
        logprobs = OLD_LOGPROBS + torch.log(GSPO_RATIOS)
    else:
        generator = torch.Generator().manual_seed(0)
        old = -3 * torch.rand(8, 6, generator=generator, dtype=torch.float64)
        logprobs = old + 1e-3 * torch.randn(8, 6, generator=generator, dtype=torch.float64)
        advantages = torch.randn(8, generator=generator, dtype=torch.float64)
        mask = (torch.arange(6)[None, :] < torch.tensor([6, 1, 3, 5, 2, 6, 4, 6])[:, None]).long()
        clip = {"clip_low": 3e-4, "clip_high": 4e-4}
    token = logprobs.clone().requires_grad_(True)
    loss, metrics = policy_gradient_loss(
        token, old, advantages, mask, policy_loss="gspo", aggregation="seq_mean_token_mean", **clip
    )
    loss.backward()
    sequence = logprobs.clone().requires_grad_(True)
    expected = gspo_sequence_level(sequence, old, advantages, mask, **clip)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(token.grad, sequence.grad)
    if case == "random":
        clipped = metrics["clip_frac_high"] + metrics["clip_frac_low"]
        assert 0 < clipped.item() < 1


def test_gspo_on_one_token_sequences_is_ppo_clip():
    """A sequence of one token has s_i = ρ_t, so GSPO is the clipped surrogate token by token."""
    mask = torch.tensor([[1, 0, 0], [1, 0, 0]])
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        gspo_loss, _, gspo_grad = run("gspo", aggregation, mask=mask)
        ppo_loss, _, ppo_grad = run("ppo_clip", aggregation, mask=mask)
        torch.testing.assert_close(gspo_loss, ppo_loss)
        torch.testing.assert_close(gspo_grad, ppo_grad)


def test_importance_weights_multiply_every_policy_loss():
    """w = 2 on every token doubles the policy term (and its gradient) of each entry."""
    weights = torch.full((2, 3), 2.0, dtype=torch.float64)
    for name in ("ppo_clip", "dual_clip", "gspo", "cispo"):
        loss, _, grad = run(name)
        weighted, metrics, weighted_grad = run(name, is_weights=weights)
        torch.testing.assert_close(weighted, 2 * loss)
        torch.testing.assert_close(weighted_grad, 2 * grad)
        assert metrics["is_weight_mean"].item() == 2.0


def test_padding_garbage_reaches_no_policy_loss():
    logprobs = (OLD_LOGPROBS + torch.log(RATIOS)).detach()
    logprobs[1, 2] = math.nan
    old = OLD_LOGPROBS.clone()
    old[1, 2] = -math.inf
    for name in ("ppo_clip", "dual_clip", "gspo", "cispo"):
        grad_in = logprobs.clone().requires_grad_(True)
        loss, metrics = policy_gradient_loss(
            grad_in, old, ADVANTAGES, MASK, **CLIP, aggregation="token_mean", policy_loss=name
        )
        loss.backward()
        assert loss.item() == pytest.approx(run(name)[0].item())
        assert torch.isfinite(grad_in.grad).all() and grad_in.grad[1, 2] == 0
        assert all(torch.isfinite(value) and not value.requires_grad for value in metrics.values())


def test_register_policy_loss_makes_a_config_key():
    """A research loss (REINFORCE with the raw ratio: l = -ρ·A, no clipping) by name: token_mean
    -(1.5 + 0.5 + 1.25 - 8 - 1)/5 = 1.15; a second registration under its name is refused."""

    @register_policy_loss("test_unclipped")
    def unclipped(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high):
        ratio = torch.exp(logprobs - old_logprobs)
        zero = torch.zeros((), dtype=ratio.dtype)
        return -ratio * advantages, {"clip_frac_high": zero, "clip_frac_low": zero}

    try:
        assert run("test_unclipped")[0].item() == pytest.approx(1.15)
        with pytest.raises(ValueError, match="policy loss 'test_unclipped' is already registered"):
            register_policy_loss("test_unclipped")(unclipped)
    finally:
        del POLICY_LOSSES["test_unclipped"]
    with pytest.raises(ValueError, match="policy loss 'ppo_clip' is already registered"):
        register_policy_loss("ppo_clip")(unclipped)


def test_dotted_path_and_function_lookups():
    assert resolve_registered("gspo", POLICY_LOSSES, "policy loss") == "gspo"
    fn = resolve_registered("alignlit.losses.policy_losses.cispo", POLICY_LOSSES, "policy loss")
    assert fn is cispo
    assert run(fn)[0].item() == run("cispo")[0].item()


def test_policy_loss_lookup_errors():
    with pytest.raises(ValueError) as error:
        run("ppo_clp")
    message = str(error.value)
    assert message.startswith(f"unknown policy loss 'ppo_clp'; expected one of {sorted(POLICY_LOSSES)}")
    assert all(repr(name) in message for name in ("ppo_clip", "dual_clip", "gspo", "cispo"))
    assert "did you mean 'ppo_clip'?" in message
    with pytest.raises(
        ValueError, match=r"policy loss 'ppo_clip' has no option 'clip_ratio_c'; it takes \[\]"
    ):
        run("ppo_clip", policy_loss_args={"clip_ratio_c": 3.0})
    with pytest.raises(ValueError, match=r"'dual_clip' has no option 'c'; it takes \['clip_ratio_c'\]"):
        run("dual_clip", policy_loss_args={"c": 3.0})
    with pytest.raises(
        ValueError, match=r"unknown loss aggregation 'token_means'.*did you mean 'token_mean'"
    ):
        run("ppo_clip", aggregation="token_means")
    with pytest.raises(ValueError, match=r"returned token losses of shape \(2,\), expected \(2, 3\)"):
        run(lambda lp, old, a, m, **kw: (lp.sum(1), {}))
