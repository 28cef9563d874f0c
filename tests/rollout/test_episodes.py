"""Multi-turn episodes token in / token out: hand-built cases with a scripted engine (the trajectory's ids
are the engine's ids plus the once-tokenised environment replies; the action mask covers exactly the
engine's tokens), and the real HF engine (generate_from_ids = generate; the engine's log-probs at its
own tokens equal the policy's teacher-forced log-probs of the whole transcript)."""

from __future__ import annotations

import pytest
import torch

from alignlit.models import load_policy
from alignlit.models.forward import response_logprobs
from alignlit.rollout import EpisodeReturn, HFEngine, SamplingParams, Step, run_episodes
from alignlit.rollout.episodes import RESET_SEED_STRIDE, TURN_SEED_STRIDE
from alignlit.rollout.postprocess import RawSample, assemble_rollout, pad_prompt_ids

PROMPT = "\n\nHuman: sort c a d\n\nAssistant:"


class ScriptedEngine:
    """Answers the k-th call's i-th context with ``script[k][i]`` (token ids, log-prob -0.5·(t+1)), and
    records the contexts and sampling it was given."""

    def __init__(self, tokenizer, script: list[list[list[int]]], eos: int | None = None):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate_from_ids(self, prompt_ids, n, sampling):
        assert n == 1
        self.calls.append(([list(c) for c in prompt_ids], sampling))
        answers = self.script[len(self.calls) - 1]
        texts, ids, mask = pad_prompt_ids(self.tokenizer, prompt_ids)
        samples = [
            RawSample(
                a[: sampling.max_new_tokens],
                [-0.5 * (t + 1) for t in range(len(a))][: sampling.max_new_tokens],
                ended_early=len(a) <= sampling.max_new_tokens,
            )
            for a in answers
        ]
        return assemble_rollout(
            self.tokenizer, texts, 1, ids, mask, samples, stop=sampling.stop, eos_ids=set()
        )


class HintEnv:
    """Two-turn environment: the first answer gets ``reply`` and reward -0.25; the second ends it with 1.0."""

    reply = "\n\nHuman: copy a c d\n\nAssistant:"

    def reset(self, prompt, *, seed):
        self.turn, self.seed, self.prompt = 0, seed, prompt
        self.seen = []
        return prompt

    def step(self, response):
        self.turn += 1
        self.seen.append(response)
        if self.turn == 1:
            return Step(self.reply, -0.25, False)
        return Step("", 1.0, True)


def words(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_token_in_token_out_hand_built(tokenizer):
    """Two prompts, one episode each; turn 1: A1 / B1, both get the reply; turn 2: A2 / B2. Each row is
    [turn 1, reply, turn 2], the actions exactly the engine's tokens, log-probs the engine's there and 0 on
    the reply, turn rewards -0.25 and 1.0 on the turn ends."""
    a1, b1 = words(tokenizer, " a d c"), words(tokenizer, " ok")
    a2, b2 = words(tokenizer, " a c d"), words(tokenizer, " c")
    reply = words(tokenizer, HintEnv.reply)
    engine = ScriptedEngine(tokenizer, [[a1, b1], [a2, b2]])
    prompts = [PROMPT, "\n\nHuman: copy b\n\nAssistant:"]
    sampling = SamplingParams(max_new_tokens=8, seed=7)
    rollout, stats = run_episodes(
        engine, tokenizer, HintEnv(), prompts, 1, sampling, max_turns=3, max_episode_tokens=64
    )

    first = [tokenizer(p)["input_ids"] for p in prompts]
    # the engine got the first observation's ids, then exactly those + its own ids + the reply's ids
    assert engine.calls[0][0] == first
    assert engine.calls[1][0] == [first[0] + a1 + reply, first[1] + b1 + reply]
    assert [c[1].seed for c in engine.calls] == [7, 7 + TURN_SEED_STRIDE]
    for j, (t1, t2) in enumerate([(a1, a2), (b1, b2)]):
        expected = t1 + reply + t2
        size = len(expected)
        assert rollout.response_ids[j, :size].tolist() == expected
        assert rollout.response_mask[j].tolist() == [True] * size + [False] * (
            rollout.response_ids.shape[1] - size
        )
        actions = [True] * len(t1) + [False] * len(reply) + [True] * len(t2)
        assert rollout.action_mask[j, :size].tolist() == actions
        assert not rollout.action_mask[j, size:].any()
        logps = (
            [-0.5 * (t + 1) for t in range(len(t1))]
            + [0.0] * len(reply)
            + [-0.5 * (t + 1) for t in range(len(t2))]
        )
        assert rollout.logprobs[j, :size].tolist() == logps
        rewards = torch.zeros(rollout.response_ids.shape[1])
        rewards[len(t1) - 1] = -0.25
        rewards[size - 1] = 1.0
        assert torch.equal(rollout.turn_rewards[j], rewards)
        assert rollout.prompt_ids[j, rollout.prompt_mask[j]].tolist() == first[j]
    assert rollout.finish_reasons == ["stop", "stop"]
    assert stats.turns == [2, 2] and stats.truncated == [False, False] and stats.returns == [0.75, 0.75]
    assert stats.env_tokens == [len(reply)] * 2 and stats.model_tokens == [
        len(a1) + len(a2),
        len(b1) + len(b2),
    ]
    assert rollout.texts[0] == tokenizer.decode(a1 + reply + a2, skip_special_tokens=True)
    torch.testing.assert_close(EpisodeReturn().score_rollout(rollout), torch.tensor([0.75, 0.75]))


def test_limits_truncate_and_are_counted(tokenizer):
    """max_turns 1: the episode ends after the first turn, no reply appended, truncated ("length").
    A token budget below the first turn cuts it; a reply that does not fit ends the episode."""
    a1, a2 = words(tokenizer, " a d c"), words(tokenizer, " a c d")
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    rollout, stats = run_episodes(
        ScriptedEngine(tokenizer, [[a1]]),
        tokenizer,
        HintEnv(),
        [PROMPT],
        1,
        sampling,
        max_turns=1,
        max_episode_tokens=64,
    )
    assert rollout.response_ids[0].tolist() == a1 and rollout.action_mask[0].all()
    assert stats.truncated == [True] and rollout.finish_reasons == ["length"] and stats.returns == [-0.25]

    engine = ScriptedEngine(tokenizer, [[a1 + a2]])
    rollout, stats = run_episodes(
        engine, tokenizer, HintEnv(), [PROMPT], 1, sampling, max_turns=3, max_episode_tokens=2
    )
    assert engine.calls[0][1].max_new_tokens == 2  # the turn asks for no more than the budget
    assert rollout.response_ids[0].tolist() == (a1 + a2)[:2] and stats.truncated == [True]

    reply = words(tokenizer, HintEnv.reply)
    budget = len(a1) + len(reply)  # the reply fits, but leaves no room for a turn after it
    rollout, stats = run_episodes(
        ScriptedEngine(tokenizer, [[a1]]),
        tokenizer,
        HintEnv(),
        [PROMPT],
        1,
        sampling,
        max_turns=3,
        max_episode_tokens=budget,
    )
    assert rollout.response_ids[0].tolist() == a1 and stats.truncated == [True] and stats.turns == [1]


def test_environment_seeds_and_samples_per_prompt(tokenizer):
    """n episodes per prompt, consecutive; episode j is reset with seed (base·stride + j) mod 2^31."""
    seeds = []

    class Recorder(HintEnv):
        def reset(self, prompt, *, seed):
            seeds.append(seed)
            return super().reset(prompt, seed=seed)

    tok = words(tokenizer, " a")
    engine = ScriptedEngine(tokenizer, [[tok] * 4, [tok] * 4])
    rollout, _ = run_episodes(
        engine,
        tokenizer,
        Recorder(),
        [PROMPT, PROMPT.replace("sort", "copy")],
        2,
        SamplingParams(max_new_tokens=4, seed=3),
        max_turns=2,
        max_episode_tokens=64,
    )
    assert seeds == [(3 * RESET_SEED_STRIDE + j) % 2**31 for j in range(4)]
    assert rollout.prompt_index.tolist() == [0, 0, 1, 1] and rollout.n == 2


def test_bad_environment_output_is_refused(tokenizer):
    class Bad(HintEnv):
        def step(self, response):
            return "reply", "1.0", False

    with pytest.raises(ValueError, match=r"reward '1\.0'"):
        run_episodes(
            ScriptedEngine(tokenizer, [[[5]]]),
            tokenizer,
            Bad(),
            [PROMPT],
            1,
            SamplingParams(seed=0),
            max_turns=2,
            max_episode_tokens=16,
        )
    with pytest.raises(TypeError, match="generate_from_ids"):
        run_episodes(
            object(),
            tokenizer,
            HintEnv(),
            [PROMPT],
            1,
            SamplingParams(seed=0),
            max_turns=2,
            max_episode_tokens=16,
        )


# ---------------------------------------------------------------------- the HF engine
@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    model, _ = load_policy(tiny_policy_dir)
    return model.eval()


def test_hf_generate_from_ids_equals_generate(tokenizer, policy):
    engine = HFEngine(tokenizer, policy)
    prompts = [PROMPT, "\n\nHuman: copy a b\n\nAssistant:"]
    sampling = SamplingParams(max_new_tokens=6, seed=11)
    a = engine.generate(prompts, 2, sampling)
    b = engine.generate_from_ids([tokenizer(p)["input_ids"] for p in prompts], 2, sampling)
    for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.texts == b.texts and a.finish_reasons == b.finish_reasons


def test_hf_episode_logprobs_are_the_policys_on_the_transcript(tokenizer, policy):
    """The engine sampled each turn from the true history: teacher-forcing the whole transcript (prompt,
    turns, replies) gives the engine's log-probs at every model token."""
    engine = HFEngine(tokenizer, policy)
    prompts = [PROMPT, "\n\nHuman: reverse a b c\n\nAssistant:"]
    rollout, stats = run_episodes(
        engine,
        tokenizer,
        HintEnv(),
        prompts,
        2,
        SamplingParams(max_new_tokens=5, seed=2),
        max_turns=2,
        max_episode_tokens=40,
    )
    assert all(t == 2 for t in stats.turns)
    assert (rollout.response_mask & ~rollout.action_mask).any()  # environment tokens in the context
    teacher = response_logprobs(
        policy,
        rollout.prompt_ids,
        rollout.prompt_mask,
        rollout.response_ids,
        rollout.response_mask,
        temperature=1.0,
    )
    actions = rollout.action_mask
    torch.testing.assert_close(teacher[actions], rollout.logprobs[actions], atol=2e-5, rtol=0)
    assert (rollout.logprobs[rollout.response_mask & ~actions] == 0).all()


def test_hf_episodes_are_seeded(tokenizer, policy):
    engine = HFEngine(tokenizer, policy)

    def run(seed):
        return run_episodes(
            engine,
            tokenizer,
            HintEnv(),
            [PROMPT],
            3,
            SamplingParams(max_new_tokens=5, seed=seed),
            max_turns=2,
            max_episode_tokens=40,
        )[0]

    a, b, c = run(4), run(4), run(5)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
