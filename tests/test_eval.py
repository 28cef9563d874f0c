import math

import pytest
import torch

from alignlit.eval.gold import best_of_n, evaluate_policy, format_table, kl_to_reference, sample_responses
from alignlit.models import load_policy
from alignlit.rollout import SamplingParams

PROMPTS = [
    "\n\nHuman: sort c a\n\nAssistant:",
    "\n\nHuman: copy b d\n\nAssistant:",
    "\n\nHuman: reverse a b\n\nAssistant:",
]


def n_chars(prompts, responses):
    return [float(len(r)) for r in responses]


def minus_chars(prompts, responses):
    return [-float(len(r)) for r in responses]


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    model, tok = load_policy(tiny_policy_dir)
    return model.eval(), tok


def test_evaluate_policy_numbers_equal_direct_computation(policy):
    model, tok = policy
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    res = evaluate_policy(model, tok, PROMPTS, n_chars, sampling=sampling, n=2, reference=model, name="p")
    rollout = sample_responses(model, tok, PROMPTS, n=2, sampling=sampling)
    gold = torch.tensor(n_chars(None, rollout.texts), dtype=torch.float64)
    assert res.samples == 6
    assert res.gold == pytest.approx(gold.mean().item())
    assert res.gold_stderr == pytest.approx(gold.std().item() / math.sqrt(6))
    assert res.length == pytest.approx(rollout.response_lengths.float().mean().item())
    # KL of a policy to itself is 0 up to float error
    assert abs(res.kl_to_reference) < 1e-4
    assert kl_to_reference(rollout, model, temperature=1.0).abs().max() < 1e-4
    assert "| p | T=1 |" in format_table([res])


def test_best_of_n_keeps_the_selected_response(policy):
    model, tok = policy
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    rollout = sample_responses(model, tok, PROMPTS, n=4, sampling=sampling)
    lengths = torch.tensor([float(len(t)) for t in rollout.texts]).view(3, 4)
    assert (lengths.max(-1).values > lengths.min(-1).values).any()  # the selection matters
    oracle = best_of_n(model, tok, PROMPTS, n_chars, n=4, sampling=sampling)
    assert oracle.gold == pytest.approx(lengths.max(-1).values.mean().item())
    # a selector that prefers short responses: the gold of what it kept is the per-prompt minimum
    picked = best_of_n(model, tok, PROMPTS, n_chars, n=4, sampling=sampling, select_fn=minus_chars)
    assert picked.gold == pytest.approx(lengths.min(-1).values.mean().item())
    assert picked.mode == "best-of-4 (RM)" and oracle.mode == "best-of-4"
    assert oracle.kl_to_reference == pytest.approx(math.log(4) - 3 / 4)
