"""RolloutLoop on a tiny model with HFEngine: experience shapes, scoring, seeding, sync by version, parity,
sampling from a frozen model, prompt filtering."""

from __future__ import annotations

import copy

import pytest
import torch

from alignlit.models import make_tiny_llama
from alignlit.rollout import (
    Experience,
    ParityError,
    PromptFilter,
    RolloutLoop,
    SamplingParams,
    reward_variance,
    score_rollout,
)
from alignlit.rollout.hf_engine import HFEngine
from tests.conftest import TINY

PROMPTS = [
    "\n\nHuman: sort c a b\n\nAssistant:",
    "\n\nHuman: copy d\n\nAssistant:",
    "\n\nHuman: reverse h g f e\n\nAssistant:",
]


def char_count(prompts, responses):
    """Reward = number of characters of the response (easy to recompute by hand)."""
    return [float(len(r)) for r in responses]


@pytest.fixture(scope="module")
def policy(tokenizer):
    return make_tiny_llama(tokenizer, seed=0, **TINY)


def make_loop(policy, tokenizer, **kwargs):
    kwargs.setdefault("sampling", SamplingParams(max_new_tokens=6))
    loop = RolloutLoop(**kwargs)
    loop.setup(policy, tokenizer)
    return loop


def test_collect_shapes_and_scores(policy, tokenizer):
    loop = make_loop(policy, tokenizer, samples_per_prompt=2)
    exp = loop.collect(PROMPTS, char_count)
    assert isinstance(exp, Experience)
    n_samples = len(PROMPTS) * 2
    r = exp.rollout
    assert len(exp) == n_samples
    assert r.prompt_ids.shape[0] == r.response_ids.shape[0] == n_samples
    assert r.response_ids.shape[1] <= 6
    assert r.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert r.prompts == [p for p in PROMPTS for _ in range(2)]
    assert exp.rewards.dtype == torch.float32
    assert exp.rewards.tolist() == [float(len(t)) for t in r.texts]
    assert exp.versions.tolist() == [0] * n_samples  # the policy version that generated them
    assert loop.rollouts == 1
    for key in ("rollout/sync_s", "rollout/generate_s", "rollout/tokens_per_s", "rollout/score_s"):
        assert key in exp.metrics
    tokens = int(r.response_mask.sum())
    assert exp.metrics["rollout/tokens_per_s"] == pytest.approx(tokens / exp.metrics["rollout/generate_s"])


def test_rollouts_are_seeded_and_state_resumes(policy, tokenizer):
    """Rollout i uses seed + i: a fresh loop loaded with the state after rollout 1 reproduces rollout 2."""
    loop = make_loop(policy, tokenizer, seed=5)
    first = loop.collect(PROMPTS, char_count)
    state = copy.deepcopy(loop.state_dict())
    second = loop.collect(PROMPTS, char_count)
    assert first.rollout.texts != second.rollout.texts or not torch.equal(
        first.rollout.response_ids, second.rollout.response_ids
    )

    resumed = make_loop(policy, tokenizer, seed=5)
    resumed.load_state_dict(state)
    again = resumed.collect(PROMPTS, char_count)
    assert torch.equal(again.rollout.response_ids, second.rollout.response_ids)
    # a same-seed loop from scratch reproduces the first rollout
    assert torch.equal(
        make_loop(policy, tokenizer, seed=5).collect(PROMPTS, char_count).rollout.response_ids,
        first.rollout.response_ids,
    )


def test_sync_when_the_version_changes(policy, tokenizer):
    """The engine is synced before the first generation, again only when another policy version is asked
    for, and after a resume (its weights are unknown then); every sample records its version."""
    loop = make_loop(policy, tokenizer)
    calls = []
    sync = loop.engine.sync
    loop.engine.sync = lambda p: (calls.append(p), sync(p))
    loop.collect(PROMPTS, char_count, version=0)
    exp = loop.collect(PROMPTS, char_count, version=0)
    assert len(calls) == 1 and loop.syncs == 1 and loop.engine_version == 0
    assert "rollout/sync_s" not in exp.metrics
    exp = loop.collect(PROMPTS, char_count, version=3)
    assert len(calls) == 2 and "rollout/sync_s" in exp.metrics and loop.engine_version == 3
    assert exp.versions.tolist() == [3] * len(exp)
    loop.load_state_dict(loop.state_dict())
    loop.collect(PROMPTS, char_count, version=3)
    assert len(calls) == 3 and loop.syncs == 3


def test_generate_from_a_frozen_model(policy, tokenizer):
    """``model=`` samples from another model (e.g. the reference) with HF generate, never syncs it into the
    engine and counts no rollout: the same samples as an HFEngine on that model."""
    loop = make_loop(policy, tokenizer)
    other = copy.deepcopy(policy)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sampling = SamplingParams(max_new_tokens=5, seed=3)
    got = loop.generate(PROMPTS, n=2, sampling=sampling, model=other)
    expected = HFEngine(tokenizer, other).generate(PROMPTS, 2, sampling)
    assert torch.equal(got.response_ids, expected.response_ids) and got.texts == expected.texts
    assert loop.rollouts == 0 and loop.syncs == 0


def test_parity_check_after_sync(policy, tokenizer):
    loop = make_loop(policy, tokenizer, parity_every=1)
    exp = loop.collect(PROMPTS, char_count)
    assert exp.metrics["rollout/parity_max_abs_diff"] < 1e-4

    # an engine left on old weights: the loop's policy moved, the engine still generates with the original
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale = make_loop(moved, tokenizer, parity_every=1)
    stale.engine = HFEngine(tokenizer, policy)
    stale.engine.sync = lambda p: None
    with pytest.raises(ParityError, match="differ from the policy"):
        stale.collect(PROMPTS, char_count)


def test_evaluation_generate_does_not_count(policy, tokenizer):
    loop = make_loop(policy, tokenizer)
    rollout = loop.generate(PROMPTS, n=1, sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
    assert len(rollout) == 3 and loop.rollouts == 0


def test_score_rollout_dispatch_and_errors(policy, tokenizer):
    loop = make_loop(policy, tokenizer)
    rollout = loop.generate(PROMPTS)

    class TextModel:
        def score(self, prompts, responses):
            return torch.ones(len(responses)) * 2

    class TokenModel:
        def score_rollout(self, rollout):
            return rollout.response_lengths.float()

    assert score_rollout(TextModel(), rollout).tolist() == [2.0, 2.0, 2.0]
    assert torch.equal(score_rollout(TokenModel(), rollout), rollout.response_lengths.float())
    with pytest.raises(ValueError, match=r"shape \(2,\) for 3 responses"):
        score_rollout(lambda p, r: [0.0, 1.0], rollout)
    with pytest.raises(ValueError, match="non-finite scores at rows \\[1\\]"):
        score_rollout(lambda p, r: [0.0, float("nan"), 1.0], rollout)
    with pytest.raises(TypeError, match="reward must have"):
        score_rollout(3, rollout)


def test_bad_loop_arguments():
    with pytest.raises(ValueError, match="'hf', 'vllm' or 'vllm_server', got 'tgi'"):
        RolloutLoop(engine="tgi")
    with pytest.raises(ValueError, match=r"sampling\.seed must be None"):
        RolloutLoop(sampling=SamplingParams(seed=3))
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 1"):
        RolloutLoop(samples_per_prompt=0)
    with pytest.raises(RuntimeError, match="setup"):
        RolloutLoop().generate(PROMPTS)


def test_vllm_engine_needs_policy_dir(policy, tokenizer):
    with pytest.raises(ValueError, match="policy's Hugging Face directory"):
        RolloutLoop(engine="vllm").setup(policy, tokenizer, policy_dir=None)


def test_reward_variance_and_prompt_filter(policy, tokenizer):
    """Variance of k=3 samples per prompt equals torch.var of the same seeded samples' rewards; a
    reward that is constant on 'copy' prompts drops exactly those."""
    engine = HFEngine(tokenizer, policy)
    sampling = SamplingParams(max_new_tokens=6, seed=11)

    def reward(prompts, responses):
        return [1.0 if "copy" in p else float(len(r)) for p, r in zip(prompts, responses)]

    variances = reward_variance(engine.generate, reward, PROMPTS, k=3, sampling=sampling, batch_size=8)
    same = engine.generate(PROMPTS, 3, sampling)
    expected = torch.tensor(reward(same.prompts, same.texts), dtype=torch.float64).view(3, 3).var(-1)
    torch.testing.assert_close(variances, expected)
    assert variances[1] == 0.0

    kept, report = PromptFilter(k=3, epsilon=1e-9, sampling=sampling, batch_size=8)(
        engine.generate, reward, PROMPTS
    )
    expected_kept = [p for p, v in zip(PROMPTS, expected.tolist()) if v >= 1e-9]
    assert kept == expected_kept and PROMPTS[1] not in kept
    assert report["dropped"] == 3 - len(kept)
    with pytest.raises(ValueError, match="k >= 2"):
        reward_variance(engine.generate, reward, PROMPTS, k=1, sampling=sampling)


def test_truncated_training_sampling_is_refused_and_why(policy, tokenizer):
    """With top_k the engine samples from the renormalised top-k distribution, whose log-prob of a kept token
    is the full-softmax one minus log(kept mass): the log-probs a rollout reports (and the trainer recomputes)
    are off by exactly that, so a training rollout refuses top_k/top_p."""
    with pytest.raises(ValueError, match=r"top_k=5, top_p=1\.0: training samples must come from"):
        RolloutLoop(sampling=SamplingParams(top_k=5))
    with pytest.raises(ValueError, match=r"top_p=0\.9"):
        RolloutLoop(sampling=SamplingParams(top_p=0.9))
    sampling = SamplingParams(top_k=5, max_new_tokens=1, seed=0)
    rollout = HFEngine(tokenizer, policy).generate(PROMPTS[:1], 1, sampling)
    ids = (rollout.prompt_ids, rollout.prompt_mask)
    with torch.no_grad():
        logits = policy(input_ids=ids[0], attention_mask=ids[1].long()).logits[0, -1]
    full = torch.log_softmax(logits, -1)
    kept_mass = full.topk(5).values.exp().sum()
    token = int(rollout.response_ids[0, 0])
    assert rollout.logprobs[0, 0].item() == pytest.approx(full[token].item(), abs=1e-5)  # what is reported
    truncated = full[token] - kept_mass.log()  # what the token was sampled with
    assert abs(truncated.item() - rollout.logprobs[0, 0].item()) == pytest.approx(
        -kept_mass.log().item(), abs=1e-5
    )
    assert -kept_mass.log().item() > 0.01
