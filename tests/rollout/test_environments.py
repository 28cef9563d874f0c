"""Tools (JSON and chat-template parsers, results and errors as environment turns), a Gymnasium environment
run unchanged through the adapter (FrozenLake), the simulated hint environment and its gold, and the
turn-reward ops on masks with environment gaps against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from alignlit.ops import kl_penalized_rewards, token_advantages
from alignlit.rollout import (
    ChatTemplateToolParser,
    GymEnvironment,
    JSONToolParser,
    SamplingParams,
    ToolCall,
    ToolCallError,
    ToolEnvironment,
    run_episodes,
)
from alignlit.sim import SimEpisodeGold, SimHintEnvironment
from tests.rollout.test_episodes import PROMPT, ScriptedEngine, words


# ---------------------------------------------------------------------- tools
def test_json_tool_parser():
    parser = JSONToolParser()
    assert parser.parse(" a c d") is None
    text = 'let me check {"name": "check", "arguments": {"answer": "a c d"}} then'
    assert parser.parse(text) == ToolCall("check", {"answer": "a c d"})
    wire = '{"name": "add", "arguments": "{\\"x\\": 1, \\"y\\": 2}"}'  # OpenAI's string-encoded arguments
    assert parser.parse(wire) == ToolCall("add", {"x": 1, "y": 2})
    with pytest.raises(ToolCallError, match="not valid JSON"):
        parser.parse('{"name": "check", "arguments": {"answer": ')
    with pytest.raises(ToolCallError, match="must be an object"):
        parser.parse('{"name": "check", "arguments": [1]}')
    assert parser.format_result("check", "right") == "\n\nTool (check): right\n\nAssistant:"


HERMES = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_tool_parser(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path) if tokenizer.name_or_path else tokenizer
    tok.chat_template = HERMES
    parser = ChatTemplateToolParser(tok)
    call = parser.parse('ok <tool_call>\n{"name": "check", "arguments": {"answer": "b"}}\n</tool_call>')
    assert call == ToolCall("check", {"answer": "b"})
    assert parser.parse("no call") is None
    with pytest.raises(ToolCallError):
        parser.parse("<tool_call>{oops</tool_call>")
    # the reply is the template's rendering of the tool message and the generation prompt, nothing before it
    assert parser.format_result("check", "right") == (
        "<|im_start|>user\n<tool_response>\nright\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        ChatTemplateToolParser(tok)


def add(x: int, y: int) -> int:
    return x + y


def test_tool_results_and_errors_are_environment_turns(tokenizer):
    """A tool call's result is a reply (done False, the tool's cost as reward); a malformed call, an unknown
    tool, bad arguments and a raising tool are `error: ...` replies, never exceptions; an answer is stepped
    by the wrapped environment (its own `check` tool knows the episode's answer)."""

    def boom():
        raise RuntimeError("disk on fire")

    env = ToolEnvironment(
        SimHintEnvironment(tool=True),
        tools={"add": "tests.rollout.test_environments.add", "boom": boom},
        tool_cost=0.05,
    )
    env.reset(PROMPT, seed=0)
    step = env.step('{"name": "check", "arguments": {"answer": " a d c"}}')
    assert (
        step.observation == "\n\nTool (check): wrong\n\nAssistant:" and step.reward == -0.05 and not step.done
    )
    assert step.info == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    assert "right" in env.step('{"name": "check", "arguments": {"answer": "a c d"}}').observation
    assert "3" in env.step('{"name": "add", "arguments": {"x": 1, "y": 2}}').observation
    for text, expected in [
        ('{"name": "add", "arguments": {"x": 1}}', "error: TypeError"),
        ('{"name": "boom", "arguments": {}}', "error: RuntimeError: disk on fire"),
        ('{"name": "nope", "arguments": {}}', "error: unknown tool 'nope'"),
        ('{"name": "add", "arguments": {"x": 1,', "error: the tool call is not valid JSON"),
    ]:
        step = env.step(text)
        assert expected in step.observation and step.info["tool_errors"] == 1 and not step.done, text
    final = env.step(" a c d")
    assert final.done and final.reward == 1.0

    limited = ToolEnvironment(SimHintEnvironment(tool=True), max_tool_calls=1)
    limited.reset(PROMPT, seed=0)
    assert not limited.step('{"name": "check", "arguments": {"answer": "x"}}').done
    assert limited.step('{"name": "check", "arguments": {"answer": "x"}}').info == {}  # an answer now


def test_tool_episode_through_the_runner(tokenizer):
    """check → reply → answer: the tool call, its result and the answer in one episode, counted."""
    call = words(tokenizer, '{"name": "check", "arguments": {"answer": "a c d"}}')
    answer = words(tokenizer, " a c d")
    env = ToolEnvironment(SimHintEnvironment(tool=True), tool_cost=0.1)
    rollout, stats = run_episodes(
        ScriptedEngine(tokenizer, [[call], [answer]]),
        tokenizer,
        env,
        [PROMPT],
        1,
        SamplingParams(max_new_tokens=64, seed=0),
        max_turns=3,
        max_episode_tokens=128,
    )
    assert stats.tool_calls == [1] and stats.tool_errors == [0] and stats.turns == [2]
    assert stats.returns == [pytest.approx(0.9)]
    assert "Tool (check): right" in rollout.texts[0]


# ---------------------------------------------------------------------- gymnasium, unchanged
def test_gymnasium_frozen_lake_runs_unchanged(tokenizer):
    """Gymnasium's own FrozenLake-v1 (deterministic 4x4): right, right, down, down, down, right reaches the
    goal (reward 1, done) in 6 turns; an unparseable turn is answered with the valid actions, no step."""
    names = ["left", "down", "right", "up"]
    env = GymEnvironment("FrozenLake-v1", env_kwargs={"is_slippery": False}, action_names=names)
    moves = ["right", "right", "jump", "down", "down", "down", "right"]
    script = [[words(tokenizer, " " + m)] for m in moves]
    rollout, stats = run_episodes(
        ScriptedEngine(tokenizer, script),
        tokenizer,
        env,
        ["\n\nHuman: walk to G"],
        1,
        SamplingParams(max_new_tokens=16, seed=0),
        max_turns=10,
        max_episode_tokens=400,
    )
    assert stats.turns == [7] and stats.returns == [1.0] and rollout.finish_reasons == ["stop"]
    assert "invalid action; choose one of left, down, right, up" in rollout.texts[0]
    assert "Human: 2" in rollout.texts[0] and "Human: 14" in rollout.texts[0]  # the states it walked through
    first = rollout.prompt_ids[0, rollout.prompt_mask[0]].tolist()
    assert first == tokenizer("\n\nHuman: walk to G0\n\nAssistant:")["input_ids"]  # prompt + initial state 0


# ---------------------------------------------------------------------- the simulated hint task
def test_sim_hint_environment_and_gold():
    env = SimHintEnvironment(attempts=2, turn_cost=0.2)
    assert env.reset(PROMPT, seed=0) == PROMPT
    observation, reward, done = env.step(" a d c ok")
    assert (observation, reward, done) == ("\n\nHuman: copy a c d\n\nAssistant:", -0.2, False)
    assert env.step(" a c d ok") == ("", pytest.approx(0.9), True)  # last attempt: gold of the answer
    env.reset(PROMPT, seed=0)
    assert env.step(" a c d") == ("", 1.0, True)  # right at once: no hint
    length = SimHintEnvironment(hint="length")
    length.reset(PROMPT, seed=0)
    assert length.step(" b")[0] == "\n\nHuman: wrong, the answer has 3 symbols\n\nAssistant:"
    single = SimHintEnvironment(attempts=1)
    single.reset(PROMPT, seed=0)
    assert single.step(" a d c")[2]
    gold = SimEpisodeGold(turn_cost=0.2)
    transcripts = [" a d c ok\n\nHuman: copy a c d\n\nAssistant: a c d", " a c d", " c"]
    torch.testing.assert_close(gold([PROMPT] * 3, transcripts), torch.tensor([0.8, 1.0, 1 / 3]))


def test_sim_hint_environment_exact_correctness():
    """correctness="exact": the final answer's symbols right or nothing, verbosity and harm as in gold.
    sort c a d (answer a c d): " a d c ok" (a swap, one extra word) scores 0 - 0.1 (partial: 1/3 - 0.1);
    " a c d ok done" 1 - 0.2; " damn a c d" 1 - 0.1 - 1; after a hint (cost 0.3) " a c" scores 0 - 0.3."""
    exact = SimHintEnvironment(attempts=1, correctness="exact")
    partial = SimHintEnvironment(attempts=1)
    for response, want_exact, want_partial in [
        (" a d c ok", -0.1, 1 / 3 - 0.1),
        (" a c d ok done", 0.8, 0.8),
        (" damn a c d", -0.1, -0.1),
        (" c", 0.0, 1 / 3),
    ]:
        exact.reset(PROMPT, seed=0), partial.reset(PROMPT, seed=0)
        assert exact.step(response)[1] == pytest.approx(want_exact), response
        assert partial.step(response)[1] == pytest.approx(want_partial), response
    two = SimHintEnvironment(attempts=2, turn_cost=0.3, correctness="exact")
    two.reset(PROMPT, seed=0)
    assert two.step(" a d c") == ("\n\nHuman: copy a c d\n\nAssistant:", -0.3, False)
    assert two.step(" a c") == ("", 0.0, True)
    transcripts = [
        " a d c\n\nHuman: copy a c d\n\nAssistant: a c",
        " a d c\n\nHuman: copy a c d\n\nAssistant: a c d",
    ]
    got = SimEpisodeGold(turn_cost=0.3, correctness="exact")([PROMPT] * 2, transcripts)
    torch.testing.assert_close(got, torch.tensor([-0.3, 0.7]))
    with pytest.raises(ValueError, match="correctness"):
        SimHintEnvironment(correctness="binary")
    with pytest.raises(ValueError, match="correctness"):
        SimEpisodeGold(correctness="binary")


# ---------------------------------------------------------------------- ops on masks with gaps
def test_kl_penalized_rewards_with_turns_and_gaps():
    """Row [m m e e m . ]: turn rewards -0.25 (position 1) and 1.0 (position 4) of a return 0.75 plus 0.5 of
    shaping; the rest R̃ - Σ turn lands on the last model token; environment tokens get nothing."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    kl = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 9.0]])
    turns = torch.tensor([[0.0, -0.25, 0.0, 0.0, 1.0, 0.0]])
    out = kl_penalized_rewards(torch.tensor([1.25]), kl, mask, kl_coef=0.5, turn_rewards=turns)
    expected = torch.tensor([[-0.05, -0.1 - 0.25, 0.0, 0.0, -0.15 + 1.0 + 0.5, 0.0]])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out.sum(), torch.tensor(1.25 - 0.5 * 0.6))


def test_token_advantages_skip_environment_gaps():
    """GAE over [m m e e m]: the valid tokens are one sequence (values at gaps ignored), against the
    hand-packed row [m m m]; zeros at the gaps. A left-padded row is still refused."""
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, -0.25, 7.0, 7.0, 1.0], [0.1, 0.2, 0.3, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.3], [0.2, 0.1, 0.0, 0.0, 0.0]])
    adv, ret = token_advantages(rewards, mask, estimator="gae", values=values, gamma=0.9, lam=0.8)
    packed_adv, _packed_ret = token_advantages(
        torch.tensor([[0.0, -0.25, 1.0], [0.1, 0.2, 0.3]]),
        torch.ones(2, 3, dtype=torch.bool),
        estimator="gae",
        values=torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.1, 0.0]]),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(adv[0, [0, 1, 4]], packed_adv[0])
    torch.testing.assert_close(adv[1, :3], packed_adv[1])
    assert (adv[0, 2:4] == 0).all() and (ret[0, 2:4] == 0).all() and (adv[1, 3:] == 0).all()
    # by hand, row 0: δ = [0 + .9·.4 - .5, -.25 + .9·.3 - .4, 1 - .3], A_t = δ_t + .72·A_{t+1}
    d = [0.9 * 0.4 - 0.5, -0.25 + 0.9 * 0.3 - 0.4, 1.0 - 0.3]
    a2 = d[2]
    a1 = d[1] + 0.72 * a2
    a0 = d[0] + 0.72 * a1
    torch.testing.assert_close(adv[0, [0, 1, 4]], torch.tensor([a0, a1, a2]))
    with pytest.raises(ValueError, match="right-padded"):
        token_advantages(rewards, torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]), estimator="returns")
