"""SimVerifier: the simulated task's rule-based answer check (strict / flexible) and how it relates to gold."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from alignlit.rewards import SimVerifier
from alignlit.sim import SimGoldReward, make_data


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sim")
    make_data(d, n_sft=40, n_pairs=10, n_prompts=40, n_val=10, n_test=10)
    return str(d)


SORT = "\n\nHuman: sort c a d\n\nAssistant:"  # answer: a c d
DEDUPE = "\n\nHuman: dedupe b a b\n\nAssistant:"  # answer: b a
# (response, strict, flexible, gold): gold = correctness − 0.1 per extra word − 1 for the harm word
CASES = [
    (SORT, " a c d", 1.0, 1.0, 1.0),
    (SORT, "a c d\n", 1.0, 1.0, 1.0),  # whitespace around the words does not matter
    (SORT, " a c d ok done", 0.0, 1.0, 0.8),  # correct, two filler words
    (SORT, " sure a c d", 0.0, 1.0, 0.9),
    (SORT, " damn a c d", 0.0, 1.0, -0.1),  # the harm word: flexible ignores it, gold does not
    (SORT, " a d c", 0.0, 0.0, 1 / 3),  # one swap: edit distance 2 of 3
    (SORT, " a c", 0.0, 0.0, 2 / 3),  # one symbol dropped
    (SORT, " a c d d", 0.0, 0.0, 0.75 - 0.1),  # one symbol inserted: 1 − 1/4, one word too many
    (SORT, " ac d", 0.0, 0.0, 1 / 3),  # "ac" is not a symbol: only "d" is extracted
    (SORT, "", 0.0, 0.0, 0.0),
    (DEDUPE, " b a", 1.0, 1.0, 1.0),
    (DEDUPE, " b a b", 0.0, 0.0, 2 / 3 - 0.1),
]


def test_verifier_scores_by_hand(sim_dir):
    prompts = [c[0] for c in CASES]
    responses = [c[1] for c in CASES]
    strict = SimVerifier(sim_dir)(prompts, responses)
    flexible = SimVerifier(sim_dir, mode="flexible")(prompts, responses)
    gold = SimGoldReward(sim_dir)(prompts, responses)
    assert strict.dtype == torch.float32 and strict.shape == (len(CASES),)
    assert strict.tolist() == [c[2] for c in CASES]
    assert flexible.tolist() == [c[3] for c in CASES]
    assert gold.tolist() == pytest.approx([c[4] for c in CASES], abs=1e-6)


def test_strict_is_gold_at_its_maximum_and_flexible_is_full_correctness(sim_dir):
    """Over every demonstration kind and random corruptions: strict == 1 exactly when gold == 1, and
    flexible == 1 exactly when gold's correctness term is 1 (gold without the verbosity and harm terms)."""
    verifier, flexible, gold = SimVerifier(sim_dir), SimVerifier(sim_dir, "flexible"), SimGoldReward(sim_dir)
    task = gold.task
    rng = random.Random(0)
    prompts, responses = [], []
    for prompt in task.prompts(60, "train"):
        for kind in ("ideal", "verbose", "flawed", "harm"):
            prompts.append(prompt)
            responses.append(task.demonstration(prompt, rng, kind=kind))
        words = task.ideal(prompt).split() + rng.sample(["ok", "done", "x", "a", "damn"], 2)
        rng.shuffle(words)
        prompts.append(prompt)
        responses.append(" ".join(words))
    g = gold(prompts, responses)
    s, f = verifier(prompts, responses), flexible(prompts, responses)
    assert torch.equal(s == 1, g == 1)
    assert 0 < int(s.sum()) < len(s)
    no_penalty = dataclasses.replace(task, verbosity_penalty=0.0, harm_penalty=0.0)
    correctness = torch.tensor(no_penalty.gold_rewards(prompts, responses))
    assert torch.equal(f == 1, correctness == 1)
    assert int((f > s).sum()) > 0  # verbose and harmful correct answers: flexible 1, strict 0


def test_verifier_rejects_bad_input(sim_dir):
    with pytest.raises(ValueError, match="mode must be one of"):
        SimVerifier(sim_dir, mode="exact")
    verifier = SimVerifier(sim_dir)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        verifier([SORT, SORT], [" a c d"])
    with pytest.raises(ValueError, match="not a task prompt"):
        verifier(["\n\nHuman: hello\n\nAssistant:"], [" a"])
    with pytest.raises(FileNotFoundError, match="make-data"):
        SimVerifier(sim_dir + "-missing")


def test_verifier_reads_only_the_manifest(tmp_path):
    """The verifier computes answers from the prompt: with every data file but the manifest removed
    (test prompts included) it still verifies."""
    make_data(tmp_path, n_sft=4, n_pairs=4, n_prompts=4, n_val=4, n_test=4)
    for path in tmp_path.glob("*.jsonl"):
        path.unlink()
    assert SimVerifier(str(tmp_path))([SORT], [" a c d"]).tolist() == [1.0]


def test_verifier_is_a_reward_of_online_stages(sim_dir):
    """As a config gives it (``reward: {class_path: alignlit.rewards.SimVerifier, ...}``), the reward
    type of every online stage accepts it and checks its output."""
    from alignlit.rollout.reward_protocol import resolve_reward, score_texts

    reward = resolve_reward(SimVerifier(sim_dir))
    assert score_texts(reward, [SORT, SORT], [" a c d", " a c d ok"]).tolist() == [1.0, 0.0]
