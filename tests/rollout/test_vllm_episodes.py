"""Multi-turn episodes on the vLLM engine (the ``vllm`` mark: `nox -s vllm`): generate_from_ids equals
generate, and the engine's log-probs at its own tokens equal the HF policy's teacher-forced log-probs of
the whole transcript (environment replies in the context, never re-tokenised)."""

from __future__ import annotations

import torch

from alignlit.models.forward import response_logprobs
from alignlit.rollout import SamplingParams, run_episodes
from tests.rollout.test_episodes import PROMPT, HintEnv
from tests.rollout.test_vllm import (  # noqa: F401 - fixtures
    engine,
    policy,
    policy_dir,
    pytestmark,
)


def test_vllm_generate_from_ids_equals_generate(tokenizer, engine):  # noqa: F811
    prompts = [PROMPT, "\n\nHuman: copy a b\n\nAssistant:"]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    a = engine.generate(prompts, 2, sampling)
    b = engine.generate_from_ids([tokenizer(p)["input_ids"] for p in prompts], 2, sampling)
    for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_vllm_episode_logprobs_are_the_policys_on_the_transcript(tokenizer, engine, policy):  # noqa: F811
    rollout, stats = run_episodes(
        engine,
        tokenizer,
        HintEnv(),
        [PROMPT],
        3,
        SamplingParams(max_new_tokens=5, seed=1),
        max_turns=2,
        max_episode_tokens=40,
    )
    assert all(t == 2 for t in stats.turns)
    teacher = response_logprobs(
        policy.eval(),
        rollout.prompt_ids,
        rollout.prompt_mask,
        rollout.response_ids,
        rollout.response_mask,
        temperature=1.0,
    )
    actions = rollout.action_mask
    torch.testing.assert_close(teacher[actions], rollout.logprobs[actions], atol=1e-3, rtol=0)
