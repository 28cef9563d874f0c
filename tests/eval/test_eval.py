import math

import pytest
import torch

from alignlit.eval.gold import best_of_n, evaluate_policy, format_table, kl_to_reference, sample_responses
from alignlit.models import load_policy
from alignlit.rollout import SamplingParams
from tests.helpers import EVAL_PROMPTS as PROMPTS
from tests.helpers import n_chars


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


def test_reward_model_scores_an_empty_sample_as_prompt_then_eos(tmp_path, tiny_policy_dir, tokenizer):
    """A policy sample that ends at once is scored (as prompt + EOS), never an error; the eval selector
    never picks it."""
    from alignlit.eval.score import rm_selector
    from alignlit.models import export_pretrained, load_reward_model, load_scalar_model

    rm, tok = load_scalar_model(tiny_policy_dir)
    export_pretrained(rm, tok, tmp_path / "rm", stage="reward")
    scorer = load_reward_model(tmp_path / "rm")
    prompt = PROMPTS[0]
    scores = scorer.score([prompt, prompt], ["", " a c"])
    ids = [*tokenizer(prompt, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    with torch.no_grad():
        expected = rm(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    assert scores[0].item() == pytest.approx(expected.item(), abs=1e-5)
    select = rm_selector(str(tmp_path / "rm"))
    picked = select([prompt, prompt], ["", " a c"])
    assert picked[0] == float("-inf") and picked[1] == pytest.approx(scores[1].item(), abs=1e-5)


def test_eval_command_line_parses_every_option():
    from alignlit.cli.eval import build_parser

    args = build_parser().parse_args(
        [
            "--sim",
            "d",
            "--policy",
            "a",
            "b",
            "--name",
            "A",
            "B",
            "--best-of",
            "4",
            "16",
            "--select",
            "rm",
            "--greedy",
        ]
    )
    assert args.select == ["rm"] and args.best_of == [4, 16] and args.greedy
    assert build_parser().parse_args(["--sim", "d"]).select == ["gold"]
