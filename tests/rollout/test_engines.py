"""HFEngine, stop strings, teacher-forced log-probs and the parity check, on a tiny random Llama (CPU)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from alignlit.models import make_tiny_llama
from alignlit.models.forward import response_logprobs
from alignlit.rollout import (
    HFEngine,
    ParityError,
    SamplingParams,
    VLLMEngine,
    check_parity,
    logprob_parity,
)
from alignlit.rollout.postprocess import stop_cut
from tests.conftest import TINY
from tests.helpers import ENGINE_PROMPTS as PROMPTS


@pytest.fixture(scope="module")
def policy(tokenizer):
    return make_tiny_llama(tokenizer, seed=0, **TINY)


@pytest.fixture(scope="module")
def engine(tokenizer, policy):
    return HFEngine(tokenizer, policy)


def naive_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Reference: one unpadded forward over prompt + response, log_softmax(logits / T) per response token."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # (L, V)
    scale = temperature if temperature > 0 else 1.0
    logps = torch.log_softmax(logits[len(prompt) - 1 : -1] / scale, dim=-1)  # (T, V)
    return logps.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def naive_greedy(model, prompt: list[int], steps: int, eos: int) -> list[int]:
    """Reference: argmax continuation by full forward passes (no cache, no padding)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == eos:
                break
    return ids[len(prompt) :]


def real(rollout, j: int) -> tuple[list[int], list[int]]:
    """Sample j's unpadded prompt and response token ids."""
    prompt = rollout.prompt_ids[j][rollout.prompt_mask[j]].tolist()
    response = rollout.response_ids[j][rollout.response_mask[j]].tolist()
    return prompt, response


def test_shapes_masks_padding_and_ordering(tokenizer, engine):
    n, max_new = 3, 7
    r = engine.generate(PROMPTS, n, SamplingParams(max_new_tokens=max_new, seed=0))
    encoded = [tokenizer(p)["input_ids"] for p in PROMPTS]
    width = max(len(e) for e in encoded)
    assert len(r) == 9 and r.n == n
    assert r.prompts == [p for p in PROMPTS for _ in range(n)]
    assert r.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert r.prompt_ids.shape == (9, width) and r.prompt_mask.dtype == torch.bool
    for j in range(9):
        ids = encoded[j // n]
        # Left padding: pad ids then the prompt, mask False then True.
        assert r.prompt_ids[j, width - len(ids) :].tolist() == ids
        assert r.prompt_mask[j].tolist() == [False] * (width - len(ids)) + [True] * len(ids)
        assert (r.prompt_ids[j, : width - len(ids)] == tokenizer.pad_token_id).all()
    lengths = r.response_lengths
    assert r.response_ids.shape == r.response_mask.shape == r.logprobs.shape == (9, int(lengths.max()))
    for j in range(9):
        k = int(lengths[j])
        # Right padding: the mask is a prefix, padding has the pad id and log-prob 0.
        assert r.response_mask[j].tolist() == [True] * k + [False] * (r.response_ids.shape[1] - k)
        assert (r.response_ids[j, k:] == tokenizer.pad_token_id).all()
        assert (r.logprobs[j, k:] == 0).all() and (r.logprobs[j, :k] < 0).all()
        ends_with_eos = k > 0 and int(r.response_ids[j, k - 1]) == tokenizer.eos_token_id
        assert r.finish_reasons[j] == ("stop" if ends_with_eos else "length")
        if r.finish_reasons[j] == "length":
            assert k == max_new
        assert r.texts[j] == tokenizer.decode(r.response_ids[j, :k].tolist(), skip_special_tokens=True)
    # The samples of one prompt are distinct draws, not copies.
    assert len({tuple(r.response_ids[j].tolist()) for j in range(3)}) > 1


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, max_new_tokens=8, seed=1),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=8, seed=2),
        SamplingParams(temperature=0.0, max_new_tokens=8),
    ],
    ids=["T1", "T0.7-topk-topp", "greedy"],
)
def test_logprobs_equal_naive_and_teacher_forced(policy, engine, sampling):
    """Engine log-probs = log_softmax(raw logits / T) of the sampled token (T=1 for greedy), untruncated.

    The reference is an unpadded float64 forward per sample, independent of padding and positions.
    """
    r = engine.generate(PROMPTS, 2, sampling)
    teacher = response_logprobs(
        policy, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, temperature=sampling.temperature
    )
    for j in range(len(r)):
        prompt, response = real(r, j)
        ref = naive_logprobs(policy, prompt, response, sampling.temperature).float()
        k = len(response)
        torch.testing.assert_close(r.logprobs[j, :k], ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(teacher[j, :k].detach(), ref, atol=1e-5, rtol=0)
        if sampling.top_k:
            # Truncation acted on sampling (each token is in the top-k) but not on the reported log-probs.
            with torch.no_grad():
                logits = policy(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            rank = (logits > logits.gather(-1, torch.tensor(response)[:, None])).sum(-1)
            assert (rank < sampling.top_k).all()
    metrics = logprob_parity(policy, r, temperature=sampling.temperature, max_samples=4)
    assert metrics["max_abs_diff"] < 1e-5 and metrics["num_tokens"] > 0


def test_greedy_equals_argmax_and_micro_batching(tokenizer, policy):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    whole = HFEngine(tokenizer, policy).generate(PROMPTS, 1, sampling)
    one_by_one = HFEngine(tokenizer, policy, micro_batch_size=1).generate(PROMPTS, 1, sampling)
    for j, prompt in enumerate(PROMPTS):
        expected = naive_greedy(policy, tokenizer(prompt)["input_ids"], 6, tokenizer.eos_token_id)
        assert real(whole, j)[1] == expected
    assert torch.equal(whole.response_ids, one_by_one.response_ids)
    torch.testing.assert_close(whole.logprobs, one_by_one.logprobs, atol=1e-5, rtol=0)


def test_stored_generation_defaults_do_not_apply(tokenizer, policy):
    """Only SamplingParams shape sampling: no global top_k=50, no penalties stored with the model.

    The random tiny model is close to uniform over ~300 tokens (entropy ≈ ln 300), so untruncated
    T=1 sampling picks tokens ranked 50th or lower most of the time; under HF's default top_k=50
    the rank would never reach 50. A copy carrying other stored defaults samples the same tokens.
    """
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    r = HFEngine(tokenizer, policy).generate(PROMPTS, 8, sampling)
    ranks = []
    for j in range(len(r)):
        prompt, response = real(r, j)
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        ranks += (logits > logits.gather(-1, torch.tensor(response)[:, None])).sum(-1).tolist()
    assert max(ranks) >= 50
    configured = make_tiny_llama(tokenizer, seed=0, **TINY)
    configured.generation_config.update(top_k=3, top_p=0.5, temperature=0.1, repetition_penalty=5.0)
    same = HFEngine(tokenizer, configured).generate(PROMPTS, 8, sampling)
    assert torch.equal(r.response_ids, same.response_ids)
    assert configured.generation_config.top_k == 3  # restored after the call


def test_eos_is_kept_and_ends_the_response(tokenizer):
    """Declare the greedy response's 3rd token an extra EOS id: the response must end right after it."""
    model = make_tiny_llama(tokenizer, seed=0, **TINY)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10)
    free = HFEngine(tokenizer, model).generate(PROMPTS[:1], 1, sampling)
    tokens = real(free, 0)[1]
    marker = tokens[2]
    assert marker not in tokens[:2] and tokenizer.eos_token_id not in tokens[:3]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, marker]
    r = HFEngine(tokenizer, model).generate(PROMPTS[:1], 1, sampling)
    assert real(r, 0)[1] == tokens[:3]
    assert r.finish_reasons == ["stop"]
    torch.testing.assert_close(r.logprobs[0, :3], free.logprobs[0, :3], atol=1e-6, rtol=0)


def test_stop_cut_on_token_boundaries_and_inside_tokens(tokenizer):
    """Tokens of "sort a b\\n\\nHuman: copy" are ['sor', 't', ' a', ' b', '\\n', '\\n', 'Human', ':', ' copy'].

    Character offsets: 'sor' 0-2, 't' 3, ' a' 4-5, ' b' 6-7, '\\n\\n' 8-9.
    - "\\n\\nHuman:" starts at 8 = end of ' b': keep 4 tokens, text "sort a b".
    - "t a" starts at 3 = start of 't': keep 1, text "sor".
    - "b\\n" starts at 7, inside ' b' (6-7): that token straddles and is dropped: keep 3, "sort a".
    - "ort" starts at 1, inside 'sor': keep 0, text "".
    - the earliest of several stop strings wins; no occurrence gives None.
    """
    ids = tokenizer("sort a b\n\nHuman: copy")["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == ["sor", "t", " a", " b", "\n", "\n", "Human", ":", " copy"]
    assert stop_cut(tokenizer, ids, ["\n\nHuman:"]) == 4
    assert stop_cut(tokenizer, ids, ["t a"]) == 1
    assert stop_cut(tokenizer, ids, ["b\n"]) == 3
    assert stop_cut(tokenizer, ids, ["ort"]) == 0
    assert stop_cut(tokenizer, ids, ["Human", "t a"]) == 1
    assert stop_cut(tokenizer, ids, ["xyz"]) is None
    assert stop_cut(tokenizer, ids, []) is None


def test_engine_cuts_at_stop_string(tokenizer, policy, engine):
    """Greedy response g; pick stop = text of tokens g[k:k+2] whose first occurrence starts at token k.

    With that stop string the response must be exactly g[:k] (text, ids, mask and log-probs), finish
    "stop", and generation must end right there (response width k, not max_new_tokens).
    """
    free = engine.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=24))
    choice = None
    for j in range(len(PROMPTS)):
        tokens = real(free, j)[1]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        for k in range(1, len(tokens) - 2):
            stop = tokenizer.decode(tokens[k : k + 2])
            prefix = tokenizer.decode(tokens[:k])
            usable = stop.strip() and "\ufffd" not in stop and text.startswith(prefix)
            if usable and text.find(stop) == len(prefix):
                choice = (j, k, stop, prefix, tokens)
                break
        if choice:
            break
    assert choice is not None, f"no usable stop string in the greedy responses {free.texts!r}"
    j, k, stop, prefix, tokens = choice
    r = engine.generate(
        PROMPTS[j : j + 1], 1, SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop])
    )
    assert real(r, 0)[1] == tokens[:k]
    assert r.texts == [prefix] and stop not in r.texts[0]
    assert r.finish_reasons == ["stop"]
    assert r.response_ids.shape[1] == k
    torch.testing.assert_close(r.logprobs[0, :k], free.logprobs[j, :k], atol=1e-6, rtol=0)


def test_seeded_calls_are_reproducible_and_leave_global_rng_alone(policy, engine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=123)
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    a = engine.generate(PROMPTS, 2, sampling)
    b = engine.generate(PROMPTS, 2, sampling)
    assert torch.equal(torch_state, torch.get_rng_state()) and py_state == random.getstate()
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    c = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=124))
    assert not torch.equal(a.response_ids, c.response_ids)


def test_train_mode_restored_and_no_graph(policy, engine):
    policy.train()
    r = engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=3, seed=0))
    assert policy.training and not r.logprobs.requires_grad
    policy.eval()
    engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=3, seed=0))
    assert not policy.training


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_response_logprobs_left_padding_matches_unpadded(tokenizer, policy, arch):
    """Two prompts of different lengths batched with left padding = each one scored alone.

    GPT-2 has absolute position embeddings, so it also checks that positions skip the left padding
    (Llama's rotary embeddings are shift-invariant and would not notice).
    """
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = GPT2LMHeadModel(config).eval()
    else:
        model = policy
    short, long = tokenizer("ab")["input_ids"], tokenizer("sort a b c d")["input_ids"]
    responses = [[67, 68, 261], [70, 201]]
    pad = tokenizer.pad_token_id
    width = len(long)
    prompt_ids = torch.tensor([[pad] * (width - len(short)) + short, long])
    prompt_mask = torch.tensor([[False] * (width - len(short)) + [True] * len(short), [True] * width])
    response_ids = torch.tensor([responses[0], [*responses[1], pad]])
    response_mask = torch.tensor([[True, True, True], [True, True, False]])
    out = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=0.5)
    for j, prompt in enumerate([short, long]):
        ref = naive_logprobs(model, prompt, responses[j], 0.5).float()
        torch.testing.assert_close(out[j, : len(responses[j])].detach(), ref, atol=1e-5, rtol=0)
    assert out[1, 2] == 0
    with pytest.raises(ValueError, match="response_mask shape"):
        response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask[:, :2])


def test_check_parity_flags_a_stale_engine(tokenizer, policy, engine):
    """Rollout from the policy passes; the same rollout judged against changed weights raises."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    r = engine.generate(PROMPTS, 2, sampling)
    metrics = check_parity(policy, r, temperature=1.0, tol=1e-4)
    assert metrics["max_abs_diff"] < 1e-5
    moved = make_tiny_llama(tokenizer, seed=0, **TINY)
    with torch.no_grad():
        moved.lm_head.weight.mul_(1.5)  # every token's logit scaled: log-probs must move
    stale = logprob_parity(moved, r, temperature=1.0)
    assert stale["max_abs_diff"] > 1e-2
    with pytest.raises(ParityError, match="off-policy"):
        check_parity(moved, r, temperature=1.0, tol=1e-3)
    # The temperature must match the one sampled with.
    with pytest.raises(ParityError):
        check_parity(policy, r, temperature=0.5, tol=1e-3)


@pytest.mark.parametrize(
    "options",
    [
        {"kv_cache": "static"},
        {"kv_cache": "dynamic", "share_prompt": True},
        {"kv_cache": "static", "share_prompt": True},
        pytest.param({"kv_cache": "static", "compile": True}, marks=pytest.mark.slow),
    ],
    ids=["static", "share-prompt", "static-share-prompt", "static-compile"],
)
def test_engine_variants_sample_the_same_distribution(tokenizer, policy, options):
    """Every way of running generate keeps the engine's contract: log-probs equal the unpadded float64
    reference (the engine parity bound), the same prompt layout, the greedy continuations of the default
    engine, and a seeded call repeats."""
    engine, default = HFEngine(tokenizer, policy, **options), HFEngine(tokenizer, policy)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    r = engine.generate(PROMPTS, 3, sampling)
    for j in range(len(r)):
        prompt, response = real(r, j)
        ref = naive_logprobs(policy, prompt, response, 1.0).float()
        torch.testing.assert_close(r.logprobs[j, : len(response)], ref, atol=1e-5, rtol=0)
    assert logprob_parity(policy, r, temperature=1.0, max_samples=9)["max_abs_diff"] < 1e-5
    base = default.generate(PROMPTS, 3, sampling)
    assert torch.equal(r.prompt_ids, base.prompt_ids) and torch.equal(r.prompt_mask, base.prompt_mask)
    assert torch.equal(engine.generate(PROMPTS, 3, sampling).response_ids, r.response_ids)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert torch.equal(
        engine.generate(PROMPTS, 2, greedy).response_ids, default.generate(PROMPTS, 2, greedy).response_ids
    )


def test_engine_variant_options_are_checked(tokenizer):
    with pytest.raises(ValueError, match="kv_cache must be"):
        HFEngine(tokenizer, kv_cache="paged")
    with pytest.raises(ValueError, match="static KV cache"):
        HFEngine(tokenizer, compile=True)
    with pytest.raises(ValueError, match="share_prompt"):
        HFEngine(tokenizer, kv_cache="static", compile=True, share_prompt=True)


def test_bad_inputs_raise(tokenizer, policy, engine):
    with pytest.raises(RuntimeError, match="sync"):
        HFEngine(tokenizer).generate(PROMPTS, 1, SamplingParams())
    with pytest.raises(ValueError, match="n \\(samples per prompt\\)"):
        engine.generate(PROMPTS, 0, SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(PROMPTS, 1, SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, 1, SamplingParams(top_p=0))
    with pytest.raises(ValueError, match=r"sampling\.stop"):
        engine.generate(PROMPTS, 1, SamplingParams(stop="\n"))
    with pytest.raises(ValueError, match="single string"):
        engine.generate("a prompt", 1, SamplingParams())
    with pytest.raises(TypeError, match="generate"):
        engine.sync(torch.nn.Linear(2, 2))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_says_how_to_install(tokenizer, tiny_policy_dir):
    with pytest.raises(ImportError, match=r"pip install 'alignlit\[vllm\]'"):
        VLLMEngine(tiny_policy_dir, tokenizer)
