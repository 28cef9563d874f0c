"""Tests for alignlit.ops: hand-computed values and independent naive references."""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest
import torch

import alignlit.ops.logprobs as logprobs_module
from alignlit.ops import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    entropy_from_logits,
    gae,
    gather_logprobs,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    masked_mean,
    masked_sum,
    masked_var,
    sequence_logprobs,
    whiten,
)
from alignlit.ops.logprobs import _tiling, linear_logprobs

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def random_right_padded_mask(generator: torch.Generator, batch: int, steps: int) -> torch.Tensor:
    lengths = torch.randint(0, steps + 1, (batch,), generator=generator)
    return (torch.arange(steps)[None, :] < lengths[:, None]).float()


# ---------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("mask", [MASK, MASK.bool(), MASK.float()])
def test_masked_sum_and_mean_by_hand(mask):
    """Valid values: row 0 -> 1, 2; row 1 -> 4. Sum 7, mean 7/3; per row sums (3, 4), means (1.5, 4)."""
    assert masked_sum(X, mask).item() == pytest.approx(7.0)
    assert masked_mean(X, mask).item() == pytest.approx(7.0 / 3.0)
    torch.testing.assert_close(masked_sum(X, mask, dim=-1), torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(masked_mean(X, mask, dim=-1), torch.tensor([1.5, 4.0]))


def test_masked_var_by_hand():
    """Valid values 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 14/3.

    Unbiased: (14/3)/2 = 7/3; biased: (14/3)/3 = 14/9.
    """
    assert masked_var(X, MASK).item() == pytest.approx(7.0 / 3.0)
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(14.0 / 9.0)


def test_masked_stats_match_torch_on_valid_elements():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=generator, dtype=torch.float64)
    mask = random_right_padded_mask(generator, 6, 9)
    mask[0, 0] = 1.0
    valid = x[mask.bool()]
    assert masked_mean(x, mask).item() == pytest.approx(valid.mean().item(), rel=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(valid.var().item(), rel=1e-12)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(
        valid.var(correction=0).item(), rel=1e-12
    )


def test_masked_mean_rejects_empty_mask():
    with pytest.raises(ValueError, match="no valid element"):
        masked_mean(X, torch.zeros_like(X))
    with pytest.raises(ValueError, match="1 of 2 slices"):
        masked_mean(X, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=-1)
    with pytest.raises(ValueError, match="no valid element"):
        masked_var(X, torch.zeros_like(X))
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_masked_sum_of_empty_slice_is_zero():
    torch.testing.assert_close(
        masked_sum(X, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=-1), torch.tensor([1.0, 0.0])
    )


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"x has shape \(2, 3\) but mask has shape \(2, 2\)"):
        masked_mean(X, MASK[:, :2])


def test_whiten_by_hand():
    """Valid values 1, 2, 4 have mean 7/3 and unbiased variance 7/3: out = (x - 7/3)/sqrt(7/3 + 1e-8)."""
    scale = 1.0 / math.sqrt(7.0 / 3.0 + 1e-8)
    expected = torch.tensor(
        [[(1 - 7 / 3) * scale, (2 - 7 / 3) * scale, 0.0], [(4 - 7 / 3) * scale, 0.0, 0.0]]
    )
    torch.testing.assert_close(whiten(X, MASK), expected)
    expected_scaled = torch.tensor([[1 * scale, 2 * scale, 0.0], [4 * scale, 0.0, 0.0]])
    expected_scaled[MASK.bool()] += 7 / 3 - 7 / 3 * scale
    torch.testing.assert_close(whiten(X, MASK, shift_mean=False), expected_scaled)


def test_whiten_gives_unit_moments_and_zero_padding():
    generator = torch.Generator().manual_seed(1)
    x = 3.0 + 2.0 * torch.randn(5, 8, generator=generator, dtype=torch.float64)
    mask = random_right_padded_mask(generator, 5, 8)
    mask[0, :3] = 1.0
    out = whiten(x, mask)
    assert out[~mask.bool()].abs().max().item() == 0.0
    assert masked_mean(out, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(out, mask).item() == pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------- GAE


def naive_gae(rewards, values, mask, gamma, lam):
    """Per-sequence reference: loop over each sequence's valid tokens only."""
    advantages = torch.zeros_like(rewards)
    returns = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        length = int(mask[b].sum().item())
        for t in range(length):
            total = 0.0
            for step in range(t, length):
                next_value = values[b, step + 1].item() if step + 1 < length else 0.0
                delta = rewards[b, step].item() + gamma * next_value - values[b, step].item()
                total += (gamma * lam) ** (step - t) * delta
            advantages[b, t] = total
            returns[b, t] = total + values[b, t].item()
    return advantages, returns


def test_gae_by_hand():
    """mask (1, 1, 0), rewards (0, 1, 5), values (0.5, 0.2, 9), γ = 0.9, λ = 0.8 (padding values ignored).

    δ_1 = 1 + 0.9·0 - 0.2 = 0.8                      -> A_1 = 0.8
    δ_0 = 0 + 0.9·0.2 - 0.5 = -0.32                  -> A_0 = -0.32 + 0.72·0.8 = 0.256
    returns = A + V = (0.756, 1.0, 0).
    """
    rewards = torch.tensor([[0.0, 1.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.256, 0.8, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor([[0.756, 1.0, 0.0]], dtype=torch.float64))


def test_gae_monte_carlo_case_by_hand():
    """γ = λ = 1: returns are rewards-to-go. rewards (1, 0, 2) -> G = (3, 2, 2); A = G - V = (3, 1, 1)."""
    advantages, returns = gae(
        torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.0, 1.0, 1.0]]), torch.ones(1, 3), gamma=1.0, lam=1.0
    )
    torch.testing.assert_close(returns, torch.tensor([[3.0, 2.0, 2.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[3.0, 1.0, 1.0]]))


@pytest.mark.parametrize(
    ("gamma", "lam", "seed"), [(1.0, 0.95, 0), (0.99, 0.9, 1), (0.5, 0.0, 2), (0.9, 1.0, 3)]
)
def test_gae_matches_naive_loop_on_random_masks(gamma, lam, seed):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(7, 11, generator=generator, dtype=torch.float64)
    values = torch.randn(7, 11, generator=generator, dtype=torch.float64)
    mask = random_right_padded_mask(generator, 7, 11)
    mask[0] = 1.0  # one full-length row
    mask[1] = 0.0  # one empty row
    advantages, returns = gae(rewards, values, mask.bool(), gamma=gamma, lam=lam)
    expected_advantages, expected_returns = naive_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected_advantages)
    torch.testing.assert_close(returns, expected_returns)


def test_gae_rejects_left_padding_and_shape_mismatch():
    with pytest.raises(ValueError, match="right-padded"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[0, 1, 1]]), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"rewards has shape \(1, 3\) but values has shape \(1, 4\)"):
        gae(torch.zeros(1, 3), torch.zeros(1, 4), torch.ones(1, 3), gamma=1.0, lam=1.0)


# ---------------------------------------------------------------- log-probs and entropy


def test_gather_logprobs_by_hand():
    """logits (0, ln 3): softmax (1/4, 3/4); log p = (ln 0.25, ln 0.75) = (-1.386294, -0.287682)."""
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    result = gather_logprobs(logits, torch.tensor([[0, 1]]))
    torch.testing.assert_close(result, torch.tensor([[-1.386294, -0.287682]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_elements", [1 << 24, 7, 30])
def test_gather_logprobs_matches_log_softmax_values_and_gradients(monkeypatch, chunk_elements):
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (3, 6), generator=generator)
    upstream = torch.randn(3, 5, generator=generator, dtype=torch.float64)

    ours = gather_logprobs(logits[:, :-1], labels[:, 1:])  # non-contiguous slice, as after shifting
    (grad_ours,) = torch.autograd.grad((ours * upstream).sum(), logits)
    reference = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    (grad_reference,) = torch.autograd.grad((reference * upstream).sum(), logits)

    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad_ours, grad_reference)


def test_gather_logprobs_gradcheck_2d():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 2, 1, 2])
    assert torch.autograd.gradcheck(lambda z: gather_logprobs(z, labels), (logits,))


def test_gather_logprobs_bfloat16_is_computed_in_float32():
    generator = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(2, 5, 50, generator=generator)).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 5), generator=generator)
    result = gather_logprobs(logits, labels)
    assert result.dtype == torch.float32
    reference = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(result, reference)


def test_gather_logprobs_rejects_bad_labels_and_shapes():
    with pytest.raises(ValueError, match=r"got values in \[-100, 1\]"):
        gather_logprobs(torch.zeros(1, 2, 4), torch.tensor([[-100, 1]]))
    with pytest.raises(ValueError, match=r"logits has shape \(1, 2, 4\) but labels has shape \(1, 3\)"):
        gather_logprobs(torch.zeros(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("chunk_elements", [1 << 24, 3])
def test_entropy_from_logits(monkeypatch, chunk_elements):
    """Uniform over 4: H = ln 4 = 1.386294. Logits (0, ln 3, -inf-like): H = -(¼ ln ¼ + ¾ ln ¾) = 0.562335."""
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", chunk_elements)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([[1.386294, 0.562335]]), atol=1e-6, rtol=0
    )

    generator = torch.Generator().manual_seed(3)
    random_logits = torch.randn(3, 4, 6, generator=generator, dtype=torch.float64)
    reference = -(torch.softmax(random_logits, -1) * torch.log_softmax(random_logits, -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(random_logits), reference)
    torch.testing.assert_close(entropy_from_logits(random_logits[0]), reference[0])


def naive_head(hidden, weight, bias, labels, *, temperature=1.0, logit_scale=1.0, softcap=None):
    z = (hidden @ weight.t() + (bias if bias is not None else 0)) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_linear_logprobs_by_hand():
    """h = (1, 0), W rows (0, 0) and (ln 3, 0): logits (0, ln 3), p = (1/4, 3/4).
    log p = (-1.386294, -0.287682); H = -(¼ ln ¼ + ¾ ln ¾) = 0.562335.
    At T = 0.5 the logits are (0, 2 ln 3): p = (1/10, 9/10), log p(1) = ln 0.9 = -0.105361."""
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    weight = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    logprobs, entropy = linear_logprobs(hidden, weight, torch.tensor([0, 1]), with_entropy=True)
    torch.testing.assert_close(logprobs, torch.tensor([-1.386294, -0.287682]), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([0.562335, 0.562335]), atol=1e-6, rtol=0)
    cold, none = linear_logprobs(hidden[:1], weight, torch.tensor([1]), temperature=0.5)
    torch.testing.assert_close(cold, torch.tensor([-0.105361]), atol=1e-6, rtol=0)
    assert none is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "options",
    [{}, {"temperature": 0.7}, {"temperature": 1.3, "logit_scale": 0.5, "softcap": 3.0}],
    ids=["plain", "temperature", "scale-softcap"],
)
@pytest.mark.parametrize("chunk_rows", [None, 5, 1])
def test_linear_logprobs_matches_the_full_logits_values_and_gradients(dtype, options, chunk_rows):
    """Values, entropies and the gradients w.r.t. hidden states, head weight and bias, through both
    outputs, equal those of the materialised logits; to 1e-6 in float32 (logits of order 1, as a
    language model's: float32 itself carries ~1e-7 relative error on their log-normaliser)."""
    generator = torch.Generator().manual_seed(4)
    hidden = (0.3 * torch.randn(37, 8, generator=generator, dtype=dtype)).requires_grad_()
    weight = torch.randn(50, 8, generator=generator, dtype=dtype, requires_grad=True)
    bias = torch.randn(50, generator=generator, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=generator)
    u, v = torch.randn(2, 37, generator=generator, dtype=dtype)

    ours = linear_logprobs(
        hidden, weight, labels, bias=bias, with_entropy=True, chunk_rows=chunk_rows, **options
    )
    reference = naive_head(hidden, weight, bias, labels, **options)
    ours_grads = torch.autograd.grad((ours[0] * u + ours[1] * v).sum(), (hidden, weight, bias))
    reference_grads = torch.autograd.grad((reference[0] * u + reference[1] * v).sum(), (hidden, weight, bias))
    atol = 1e-12 if dtype == torch.float64 else 1e-6
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-6)
    for a, b in zip(ours_grads, reference_grads):
        scale = float(b.abs().max())
        torch.testing.assert_close(a / scale, b / scale, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_linear_logprobs_in_tiles_matches_a_float64_reference(dtype):
    """V = 1000 in tiles of 128 (the last one 104 wide) and 23 rows in chunks of 7: log-probs, entropies
    and gradients (hidden, weight, bias, through both outputs) equal those of the full float64 logits,
    labels in the first, a middle and the last tile; to 1e-10 in float64 and 1e-5 in float32."""
    generator = torch.Generator().manual_seed(7)
    hidden = 0.3 * torch.randn(23, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(1000, 8, generator=generator, dtype=torch.float64)
    bias = torch.randn(1000, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 1000, (23,), generator=generator)
    labels[:4] = torch.tensor([0, 127, 128, 999])
    u, v = torch.randn(2, 23, generator=generator, dtype=torch.float64)
    options = {"temperature": 0.8, "logit_scale": 1.7, "softcap": 4.0}

    def reference(h, w, b):
        z = 4.0 * torch.tanh(1.7 * (h @ w.t() + b) / 4.0) / 0.8
        logp = torch.log_softmax(z, -1)
        return logp.gather(-1, labels[:, None]).squeeze(-1), -(torch.softmax(z, -1) * logp).sum(-1)

    inputs = [x.to(dtype).requires_grad_() for x in (hidden, weight, bias)]
    ours = linear_logprobs(
        inputs[0], inputs[1], labels, bias=inputs[2], with_entropy=True, chunk_rows=7, tile=128, **options
    )
    exact = [x.detach().to(torch.float64).requires_grad_() for x in inputs]
    expected = reference(*exact)
    ours_grads = torch.autograd.grad((ours[0] * u.to(dtype) + ours[1] * v.to(dtype)).sum(), inputs)
    expected_grads = torch.autograd.grad((expected[0] * u + expected[1] * v).sum(), exact)
    atol = 1e-10 if dtype == torch.float64 else 1e-5
    assert ours[0].dtype == dtype
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=0)
    for a, b in zip(ours_grads, expected_grads):
        scale = float(b.abs().max())
        torch.testing.assert_close(a.double() / scale, b / scale, atol=atol, rtol=0)

    def tiled(h, w):  # 7 entries in tiles of 3, 3 and 1
        return linear_logprobs(h, w, labels[:6] % 7, with_entropy=True, chunk_rows=4, tile=3)

    small = (hidden[:6].clone().requires_grad_(), weight[:7].clone().requires_grad_())
    assert torch.autograd.gradcheck(tiled, small)


def test_linear_logprobs_default_tiles_bound_the_memory():
    """A large vocabulary: 1024-row chunks x 2048-entry tiles (2**21 logits); a small one is one tile of
    2**21 // V rows, as before tiling; few rows widen the tile; given rows or tile set the other."""
    assert _tiling(6144, 151_936, None, None) == (1024, 2048)
    assert _tiling(6144, 512, None, None) == (4096, 512)
    assert _tiling(100, 151_936, None, None) == (1024, 20_971)
    assert _tiling(6144, 151_936, 32, None) == (32, 65_536)
    assert _tiling(6144, 151_936, None, 32_768) == (64, 32_768)
    with pytest.raises(ValueError, match="tile must be >= 1"):
        _tiling(4, 10, None, 0)


def test_linear_logprobs_gradcheck_and_no_weight_grad():
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (6,), generator=generator)

    def both(h, w):
        return linear_logprobs(h, w, labels, with_entropy=True, temperature=0.5, softcap=2.0, chunk_rows=4)

    assert torch.autograd.gradcheck(both, (hidden, weight))
    assert torch.autograd.gradcheck(lambda h, w: both(h, w)[0], (hidden, weight))
    frozen = weight.detach()
    (grad,) = torch.autograd.grad(linear_logprobs(hidden, frozen, labels)[0].sum(), hidden)
    assert grad.shape == hidden.shape


def test_linear_logprobs_bfloat16_head_is_reduced_in_float32():
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(5, 16, generator=generator).to(torch.bfloat16)
    weight = torch.randn(40, 16, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 40, (5,), generator=generator)
    logprobs, _ = linear_logprobs(hidden, weight, labels)
    assert logprobs.dtype == torch.float32
    reference = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, reference)


def test_linear_logprobs_rejects_bad_input():
    hidden, weight = torch.zeros(2, 3), torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"got values in \[-100, 1\]"):
        linear_logprobs(hidden, weight, torch.tensor([-100, 1]))
    with pytest.raises(ValueError, match=r"hidden must be \(M, H\) and weight \(V, H\)"):
        linear_logprobs(hidden, torch.zeros(4, 2), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"labels must be \(2,\)"):
        linear_logprobs(hidden, weight, torch.tensor([0]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        linear_logprobs(hidden, weight, torch.tensor([0, 1]), temperature=0.0)


def test_sequence_logprobs_by_hand():
    """Row 0: -1 - 2 - 3 = -6 (mean -2); row 1: only -0.5 is valid (sum and mean -0.5)."""
    token_logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(sequence_logprobs(token_logps, mask), torch.tensor([-6.0, -0.5]))
    torch.testing.assert_close(sequence_logprobs(token_logps, mask, average=True), torch.tensor([-2.0, -0.5]))
    with pytest.raises(ValueError, match="no valid element"):
        sequence_logprobs(token_logps, torch.tensor([[1, 1, 1], [0, 0, 0]]), average=True)


# ---------------------------------------------------------------- running moments


def test_running_moments_halves_merge_to_one_pass_and_match_numpy():
    generator = torch.Generator().manual_seed(4)
    batches = [
        5.0 + 3.0 * torch.randn(shape, generator=generator, dtype=torch.float64)
        for shape in [(4, 3), (7,), (2, 2, 2), (1,)]
    ]
    data = np.concatenate([b.reshape(-1).numpy() for b in batches])

    one_pass = RunningMoments()
    for batch in batches:
        one_pass.update(batch)
    first, second = RunningMoments(), RunningMoments()
    for batch in batches[:2]:
        first.update(batch)
    for batch in batches[2:]:
        second.update(batch)
    first.merge(second)

    for moments in (one_pass, first):
        assert moments.count == data.size == 28
        assert moments.mean == pytest.approx(data.mean(), rel=1e-12)
        assert moments.var == pytest.approx(data.var(ddof=1), rel=1e-12)
        assert moments.std == pytest.approx(data.std(ddof=1), rel=1e-12)
    assert first.state_dict() == pytest.approx(one_pass.state_dict(), rel=1e-12)


def test_running_moments_by_hand_and_state_dict():
    """Values 1, 2 then 4: mean 7/3, unbiased variance 7/3 (see test_masked_var_by_hand)."""
    moments = RunningMoments()
    with pytest.raises(ValueError, match="no value"):
        _ = moments.mean
    moments.update(torch.tensor([1.0, 2.0]))
    moments.update(torch.tensor([], dtype=torch.float32))
    moments.update(torch.tensor(4.0))
    assert moments.count == 3
    assert moments.mean == pytest.approx(7 / 3)
    assert moments.var == pytest.approx(7 / 3)

    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored.state_dict() == moments.state_dict()
    with pytest.raises(KeyError, match="m2"):
        restored.load_state_dict({"count": 1, "mean": 0.0})
    single = RunningMoments()
    single.update(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="at least 2 values"):
        _ = single.var


def test_running_moments_all_reduce_without_process_group_is_a_no_op():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 4.0]))
    before = moments.state_dict()
    moments.all_reduce()
    assert moments.state_dict() == before


def _all_reduce_worker(rank: int, world_size: int, init_file: str, result_file: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        moments = RunningMoments()
        moments.update(torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([4.0, 10.0, -3.0]))
        moments.all_reduce()
        with open(f"{result_file}.{rank}", "w") as handle:
            handle.write(f"{moments.count} {moments.mean!r} {moments.var!r}")
    finally:
        torch.distributed.destroy_process_group()


def test_running_moments_all_reduce_merges_what_each_rank_gathered(monkeypatch):
    """Simulated 2-rank gather: rank 0 saw (1, 2), the other rank (4, 10, -3); the merge covers all five."""
    other = RunningMoments()
    other.update(torch.tensor([4.0, 10.0, -3.0]))

    def fake_all_gather(outputs, local):
        outputs[0].copy_(local)
        outputs[1].copy_(
            torch.tensor([other.count, other.mean, other.var * (other.count - 1)], dtype=torch.float64)
        )

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "gloo")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_gather", fake_all_gather)
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0]))
    moments.all_reduce()
    data = np.array([1.0, 2.0, 4.0, 10.0, -3.0])
    assert moments.count == 5
    assert moments.mean == pytest.approx(data.mean(), rel=1e-12)
    assert moments.var == pytest.approx(data.var(ddof=1), rel=1e-12)


def test_running_moments_all_reduce_in_a_real_single_rank_group():
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            moments = RunningMoments()
            moments.update(torch.tensor([1.0, 2.0, 4.0]))
            before = moments.state_dict()
            moments.all_reduce()
        finally:
            torch.distributed.destroy_process_group()
    assert moments.state_dict() == pytest.approx(before, rel=1e-15)


@pytest.mark.slow
def test_running_moments_all_reduce_across_two_gloo_ranks():
    """Two real processes: rank 0 saw (1, 2), rank 1 saw (4, 10, -3): both end with the moments of all five."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result")
        torch.multiprocessing.spawn(_all_reduce_worker, args=(2, init_file, result_file), nprocs=2, join=True)
        results = []
        for rank in range(2):
            with open(f"{result_file}.{rank}") as handle:
                count, mean, var = handle.read().split()
            results.append((int(count), float(mean), float(var)))
    data = np.array([1.0, 2.0, 4.0, 10.0, -3.0])
    for count, mean, var in results:
        assert count == 5
        assert mean == pytest.approx(data.mean(), rel=1e-12)
        assert var == pytest.approx(data.var(ddof=1), rel=1e-12)


# ---------------------------------------------------------------- KL estimators and controllers


def test_kl_estimators_by_hand():
    """logp = -1, ref = -2: k1 = 1, k2 = ½·1² = 0.5, k3 = e^(-1) - 1 + 1 = 0.367879.
    logp = -2, ref = -1: k1 = -1, k2 = 0.5, k3 = e^1 - 1 - 1 = 0.718282.
    """
    logprobs = torch.tensor([-1.0, -2.0])
    ref_logprobs = torch.tensor([-2.0, -1.0])
    torch.testing.assert_close(kl_k1(logprobs, ref_logprobs), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_k2(logprobs, ref_logprobs), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(
        kl_k3(logprobs, ref_logprobs), torch.tensor([0.367879, 0.718282]), atol=1e-6, rtol=0
    )
    for kind, function in (("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)):
        torch.testing.assert_close(
            kl_estimate(logprobs, ref_logprobs, kind), function(logprobs, ref_logprobs)
        )


def test_kl_estimate_rejects_unknown_kind_and_shape_mismatch():
    with pytest.raises(ValueError, match="'k4'"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match=r"logprobs has shape \(2,\) but ref_logprobs has shape \(3,\)"):
        kl_k3(torch.zeros(2), torch.zeros(3))


def test_adaptive_kl_controller_by_hand():
    """β = 0.1, target 6, horizon 10000.
    KL 9: error (9-6)/6 = 0.5 -> clipped 0.2; β = 0.1·(1 + 0.2·256/10000) = 0.100512.
    KL 5.4: error -0.1; β = 0.100512·(1 - 0.1·100/10000) = 0.100512·0.999 = 0.100411488.
    """
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    controller.update(torch.tensor(9.0), n_steps=256)
    assert controller.value == pytest.approx(0.100512, rel=1e-12)
    controller.update(5.4, n_steps=100)
    assert controller.value == pytest.approx(0.100411488, rel=1e-12)

    restored = AdaptiveKLController(init_coef=1.0, target=6.0, horizon=10000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    with pytest.raises(ValueError, match="target must be > 0"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=10)


def test_fixed_kl_controller():
    controller = FixedKLController(0.05)
    controller.update(100.0, n_steps=1000)
    assert controller.value == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == 0.05
