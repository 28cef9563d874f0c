"""Tests for alignlit.models.forward: the fused-head and packed paths against the model's own full logits.

Every fast path is compared with the naive computation (``model(...).logits`` then ``log_softmax``):
values, entropies and gradients with respect to every weight, in float64 and float32, with
temperature, padding, rows that share a prompt and rows with nothing to score.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from alignlit.models import batch_layout, export_pretrained, make_tiny_llama, packing
from alignlit.models import forward as fwd
from alignlit.models.dispatch import CHECKPOINTING, plan_forward
from alignlit.models.forward_settings import ForwardSettings, forward_settings, use_forward_settings
from alignlit.models.loading import load_scalar_model
from alignlit.models.support import ForwardSupport, forward_support, probe_packing
from tests.conftest import TINY

# a preference-like batch: rows [0, 3) chosen, [3, 6) rejected; row 6 has nothing to score
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
CHOSEN = [[20, 21], [22], [23, 24, 25]]
REJECTED = [[30], [31, 32, 33], [34]]


def right_padded(seqs: list[list[int]], prompt_lengths: list[int]):
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros(len(seqs), width, dtype=torch.bool)
    loss = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_lengths)):
        ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = True
        loss[i, p : len(s)] = True
    return ids, attention, loss


def pair_batch():
    seqs = [p + c for p, c in zip(PROMPTS, CHOSEN)] + [p + r for p, r in zip(PROMPTS, REJECTED)] + [[40, 41]]
    lengths = [len(p) for p in PROMPTS] * 2 + [2]
    return right_padded(seqs, lengths)


def rollout_batch():
    """Left-padded prompts with n = 2 samples each, right-padded responses (one empty)."""
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9], [14]]
    responses = [[20, 21], [22], [23, 24, 25], [], [26, 27]]
    width, steps = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    prompt_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    response_ids = torch.zeros(len(prompts), steps, dtype=torch.long)
    response_mask = torch.zeros(len(prompts), steps, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[i, width - len(p) :] = torch.tensor(p)
        prompt_mask[i, width - len(p) :] = 1
        response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_tiny_llama(tokenizer, seed=0, **TINY)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(model, fn, **kwargs):
    """Values and weight gradients of ``Σ logprobs·u + Σ entropy·v`` (fixed random weights u, v)."""
    model.zero_grad(set_to_none=True)
    out = fn(model, **kwargs)
    generator = torch.Generator().manual_seed(0)
    u = torch.randn(out.logprobs.shape, generator=generator, dtype=out.logprobs.dtype)
    v = torch.randn(out.logprobs.shape, generator=generator, dtype=out.logprobs.dtype)
    objective = (out.logprobs * u).sum()
    if out.entropy is not None:
        objective = objective + (out.entropy * v).sum()
    objective.backward()
    return out, grads(model)


PATHS = [
    {"fused_head": True, "packing": False},
    {"fused_head": True, "packing": True},
]


def assert_same(naive, naive_grads, fast, fast_grads, *, dtype):
    # gradients: float32 rounding inside RMSNorm (which Hugging Face runs in float32 even in a float64
    # model) sums the two rows' contributions to a shared prompt in another order
    atol = 1e-10 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(fast.logprobs, naive.logprobs, atol=atol, rtol=1e-6)
    assert torch.equal(fast.mask, naive.mask)
    if naive.entropy is not None:
        torch.testing.assert_close(fast.entropy, naive.entropy, atol=atol, rtol=1e-6)
    assert fast_grads.keys() == naive_grads.keys()
    for name, g in naive_grads.items():
        scale = float(g.abs().max()) + 1e-12
        torch.testing.assert_close(fast_grads[name] / scale, g / scale, atol=2e-6, rtol=0, msg=name)


def test_a_hugging_face_llama_takes_both_fast_paths(model):
    assert forward_support(model) == ForwardSupport(fused_head=None, packing=None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("path", PATHS, ids=["fused", "packed"])
def test_token_logprobs_fast_paths_equal_the_full_logits(model, dtype, temperature, path):
    model = model.to(dtype)
    ids, attention, loss = pair_batch()

    def fn(m, **kw):
        return fwd.token_logprobs(m, ids, attention, loss, temperature=temperature, with_entropy=True, **kw)

    naive, naive_grads = run(model, fn, fused_head=False)
    fast, fast_grads = run(model, fn, **path)
    assert fast.logprobs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_same(naive, naive_grads, fast, fast_grads, dtype=dtype)
    assert (
        float(naive.logprobs[6].detach().abs().sum()) == 0
    )  # the row without response tokens scores nothing
    model.float()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("path", PATHS, ids=["fused", "packed"])
def test_response_token_logprobs_fast_paths_equal_the_full_logits(model, dtype, path):
    model = model.to(dtype)
    batch = rollout_batch()

    def fn(m, **kw):
        return fwd.response_token_logprobs(m, *batch, temperature=1.3, with_entropy=True, **kw)

    naive, naive_grads = run(model, fn, fused_head=False)
    fast, fast_grads = run(model, fn, **path)
    assert_same(naive, naive_grads, fast, fast_grads, dtype=dtype)
    model.float()


def test_entropy_grad_false_detaches_only_the_entropy(model):
    ids, attention, loss = pair_batch()
    out = fwd.token_logprobs(model, ids, attention, loss, with_entropy=True, entropy_grad=False)
    assert out.logprobs.requires_grad and not out.entropy.requires_grad


def test_packing_layout_by_hand():
    """Rows a = [1 2 | 3 4], b = [1 2 | 5], c = [7 | 8] (prompt | response): a and b share the prompt
    [1 2]. The sequence is group ab = [1 2 3 4 5] then group c = [7 8]; positions: the prompt 0 1, a's
    tokens 2 3, b's token 2 (after the same prompt), c's 0 1. In group ab, token 5 (b) attends to the
    prompt and itself, not to a's 3 4; group c is padded to the longest group (5 tokens), its padding
    slots repeating its last token (index 6) and seeing only themselves."""
    ids, attention, loss = right_padded([[1, 2, 3, 4], [1, 2, 5], [7, 8]], [2, 2, 1])
    packed = packing.pack(ids, attention, packing.prompt_lengths(attention, loss))
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1]]
    assert packed.index.tolist() == [[0, 1, 2, 3], [0, 1, 4, -1], [5, 6, -1, -1]]
    assert packed.group_index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 6, 6, 6]]
    assert packed.positions.tolist() == [0, 1, 2, 3, 4, 5, 6]  # group c starts at 5 = 1 * W
    mask = packed.group_mask[:, 0].int()
    assert mask[0].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    assert mask[1].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]


def test_gradient_checkpointing_turns_packing_off(tokenizer):
    model = make_tiny_llama(tokenizer, seed=0, **TINY)
    model.gradient_checkpointing_enable()
    assert "gradient checkpointing" in plan_forward(model, packing=True).reason
    ids, attention, loss = pair_batch()
    model.train()
    naive = fwd.token_logprobs(model, ids, attention, loss, fused_head=False).logprobs
    torch.testing.assert_close(fwd.token_logprobs(model, ids, attention, loss).logprobs, naive)


def test_grouped_attention_refuses_to_run_outside_a_packed_forward():
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="only inside alignlit's packed forwards"):
        packing.grouped_attention(None, q, q, q, None)


def test_values_and_scores_packed_equal_the_scalar_models_own(tmp_path, tokenizer):
    export_pretrained(make_tiny_llama(tokenizer, seed=1, **TINY), tokenizer, tmp_path / "lm", stage="init")
    torch.manual_seed(0)
    critic, _ = load_scalar_model(tmp_path / "lm")
    batch = rollout_batch()
    critic.zero_grad()
    padded = fwd.response_values(critic, *batch, packing=False)
    padded.pow(2).sum().backward()
    padded_grads = grads(critic)
    critic.zero_grad()
    packed = fwd.response_values(critic, *batch, packing=True)
    packed.pow(2).sum().backward()
    torch.testing.assert_close(packed, padded, atol=1e-6, rtol=1e-5)
    assert float(packed[3].detach().abs().sum()) == 0  # the empty response
    for name, g in grads(critic).items():
        torch.testing.assert_close(g, padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)

    ids, attention, loss = pair_batch()
    own = critic(ids, attention)
    torch.testing.assert_close(fwd.sequence_scores(critic, ids, attention, loss), own, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fwd.sequence_scores(critic, ids, attention), own, atol=1e-6, rtol=1e-5)


def test_settings_switch_and_restore(model):
    assert forward_settings() == ForwardSettings()
    with use_forward_settings(packing=False) as settings:
        assert settings.packing is False and forward_settings().fused_head is True
    assert forward_settings() == ForwardSettings()


class Wrapped(nn.Module):
    """A causal LM behind a wrapper with no Hugging Face accessors."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_models_without_the_standard_parts_use_their_full_logits(model, tokenizer, monkeypatch):
    ids, attention, loss = pair_batch()
    naive = fwd.token_logprobs(model, ids, attention, loss, fused_head=False).logprobs

    wrapped = Wrapped(model)
    support = forward_support(wrapped)
    assert "not a Hugging Face causal LM" in support.fused_head and support.packing == support.fused_head
    torch.testing.assert_close(fwd.token_logprobs(wrapped, ids, attention, loss).logprobs, naive)

    scaled = make_tiny_llama(tokenizer, seed=0, **TINY)
    scaled.config.logits_scaling = 2.0
    assert "rescales its logits (logits_scaling)" in forward_support(scaled).fused_head

    wrapped_head = make_tiny_llama(tokenizer, seed=0, **TINY)
    wrapped_head.lm_head = Wrapped(wrapped_head.lm_head)
    wrapped_head.lm_head.weight = wrapped_head.lm_head.inner.weight
    assert "the LM head is a Wrapped, not a plain nn.Linear" in forward_support(wrapped_head).fused_head

    sharded = make_tiny_llama(tokenizer, seed=0, **TINY)
    monkeypatch.setattr("alignlit.models.support._is_dtensor", lambda t: t is sharded.lm_head.weight)
    assert "DTensor" in forward_support(sharded).fused_head
    torch.testing.assert_close(fwd.token_logprobs(sharded, ids, attention, loss).logprobs, naive)


def test_sliding_window_and_flash_attention_models_do_not_pack(tokenizer):
    windowed = make_tiny_llama(tokenizer, seed=0, **TINY)
    windowed.config.sliding_window = 4
    support = forward_support(windowed)
    assert support.fused_head is None and "sliding-window" in support.packing

    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert "packing replaces 'sdpa' or 'eager' attention only" in probe_packing(flash, backbone=None)


def test_a_model_whose_logits_are_not_its_head_of_its_decoder_is_detected(tokenizer):
    model = make_tiny_llama(tokenizer, seed=0, **TINY)
    original = model.forward

    def shifted(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits + 1.0 * torch.arange(out.logits.shape[-1])
        return out

    model.forward = shifted
    assert "not its LM head applied" in forward_support(model).fused_head


def test_token_nll_is_the_masked_nll_of_the_full_logits(model):
    from alignlit.losses.lm import masked_nll, shift_for_next_token

    ids, attention, loss = pair_batch()
    logits = model(input_ids=ids, attention_mask=attention).logits
    expected, expected_metrics = masked_nll(*shift_for_next_token(logits, ids, loss))
    got, metrics = fwd.token_nll(model, ids, attention, loss)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert int(metrics["tokens"]) == int(expected_metrics["tokens"]) == 11  # 2+1+3 chosen, 1+3+1 rejected
    torch.testing.assert_close(metrics["ppl"], expected_metrics["ppl"], atol=1e-5, rtol=1e-6)
    assert not metrics["nll"].requires_grad


def test_one_dispatcher_chooses_fused_head_and_packing_and_says_why(model):
    plan = plan_forward(model)
    assert (plan.direct, plan.packed, plan.reason) == (True, True, None)
    assert plan.backbone is model.get_decoder() and plan.head is model.get_output_embeddings()
    plan = plan_forward(model, fused_head=False)
    assert (plan.direct, plan.packed, plan.reason) == (False, False, "the fused head is off")
    with use_forward_settings(packing=False):
        plan = plan_forward(model)
    assert (plan.direct, plan.packed, plan.reason) == (True, False, "packing is off")
    plan = plan_forward(model, layout=lambda: "the rows are not right-padded")
    assert (plan.direct, plan.packed, plan.reason) == (True, False, "the rows are not right-padded")
    looked = []
    plan_forward(model, packing=False, layout=lambda: looked.append(True))
    assert not looked  # the batch is looked at only when everything else allows packing
    plan = plan_forward(Wrapped(model))
    assert not plan.direct and "not a Hugging Face causal LM" in plan.reason


def test_the_dispatcher_runs_a_scalar_model_directly_only_when_it_packs(tmp_path, tokenizer):
    export_pretrained(make_tiny_llama(tokenizer, seed=1, **TINY), tokenizer, tmp_path / "lm", stage="init")
    critic, _ = load_scalar_model(tmp_path / "lm")
    plan = plan_forward(critic, scalar=True, fused_head=False)  # no vocabulary to fuse: fused_head ignored
    assert (plan.direct, plan.packed, plan.reason) == (True, True, None)
    assert plan.head is critic.hf_model.score
    assert plan_forward(critic, scalar=True, packing=False).reason == "packing is off"
    critic.hf_model.gradient_checkpointing_enable()
    plan = plan_forward(critic, scalar=True)
    assert (plan.direct, plan.reason) == (False, CHECKPOINTING)
    assert "not a scalar-head decoder" in plan_forward(Wrapped(critic), scalar=True).reason


def test_response_rows_with_a_gap_are_not_packed(model):
    prompt_ids, prompt_mask, response_ids, response_mask = rollout_batch()
    response_mask[0] = torch.tensor([1, 0, 1])  # token 2 would be predicted from a padding column
    _, attention = batch_layout.concat_response(prompt_ids, prompt_mask, response_ids, response_mask)
    predictor = batch_layout.response_predictor(prompt_ids.shape[1], response_ids)
    reason = batch_layout.response_reason(attention, predictor, response_mask.bool())
    assert reason == "a response token follows a padding token"
    batch = (prompt_ids, prompt_mask, response_ids, response_mask)
    naive = fwd.response_token_logprobs(model, *batch, fused_head=False).logprobs
    torch.testing.assert_close(
        fwd.response_token_logprobs(model, *batch).logprobs, naive, atol=1e-6, rtol=1e-6
    )
