"""Multi-turn SFT demonstrations of the hint task: the context a demonstration trains on is, token for token,
the context run_episodes builds for the same first answer (token in / token out: the first turn's ids, its
EOS, the hint tokenised once); the first answer is always wrong, the hint is the environment's reply; the
files hold every single-turn row plus the multi-turn ones, deterministically."""

from __future__ import annotations

import json
import random
import re

import pytest

from alignlit.data.encoding import Truncation
from alignlit.rollout import SamplingParams, run_episodes
from alignlit.sim import SimHintEnvironment, SimTask, make_data
from alignlit.sim.multiturn import hint_text, multiturn_demonstration, write_multiturn_sft
from tests.rollout.test_episodes import ScriptedEngine, words


def test_demonstration_context_is_the_episode_context(tokenizer):
    """The SFT encoding of a demonstration's prompt equals the ids the engine is given for turn 2 when its
    turn 1 was the demonstration's first answer followed by EOS; the hint is the environment's reply."""
    task = SimTask()
    prompt = "\n\nHuman: sort c a d\n\nAssistant:"
    rng = random.Random(3)
    demo = multiturn_demonstration(task, prompt, rng, hint="answer", eos=tokenizer.eos_token)
    first = demo["prompt"][len(prompt) : demo["prompt"].index(tokenizer.eos_token)]
    assert demo["prompt"] == prompt + first + tokenizer.eos_token + "\n\nHuman: copy a c d\n\nAssistant:"
    env = SimHintEnvironment(attempts=2, hint="answer")
    env.reset(prompt, seed=0)
    assert not env.right(first)

    turn1 = [*words(tokenizer, first), tokenizer.eos_token_id]
    engine = ScriptedEngine(tokenizer, [[turn1], [words(tokenizer, " a c d")]])
    run_episodes(engine, tokenizer, env, [prompt], 1, SamplingParams(max_new_tokens=24, seed=0),
                 max_turns=2, max_episode_tokens=64)  # fmt: skip
    second_context = engine.calls[1][0][0]
    encoded = Truncation(tokenizer, max_length=64, max_prompt_length=48).encode(
        demo["prompt"], demo["response"], "demo"
    )
    assert encoded.input_ids[: encoded.prompt_length] == second_context
    assert second_context[-len(words(tokenizer, hint_text("answer", " a c d"))) :] == words(
        tokenizer, "\n\nHuman: copy a c d\n\nAssistant:"
    )


@pytest.mark.parametrize("hint", ["answer", "length", "none"])
def test_first_answers_are_wrong_and_revisions_are_demonstrations(hint):
    """200 demonstrations: every first answer is wrong (a hint would follow it), the reply is the hint of the
    right answer, and the revisions are drawn like single-turn demonstrations (mostly right)."""
    task = SimTask()
    rng = random.Random(0)
    env = SimHintEnvironment(attempts=2, hint=hint)
    right = 0
    for prompt in task.prompts(200, "train"):
        demo = multiturn_demonstration(task, prompt, rng, hint=hint, eos="<E>")
        first, reply = demo["prompt"][len(prompt) :].split("<E>")
        env.reset(prompt, seed=0)
        observation, reward, done = env.step(first)
        assert (observation, reward, done) == (reply, -env.turn_cost, False)
        right += env.right(demo["response"])
    # the default mix: ideal, verbose and harm demonstrations have the right symbols (70%), flawed do not
    assert 0.6 < right / 200 < 0.8


def test_write_multiturn_sft(tmp_path):
    make_data(tmp_path, n_sft=30, n_pairs=4, n_prompts=4, n_val=6, n_test=2)
    rows = write_multiturn_sft(tmp_path, n_train=10, n_val=2, eos="<E>")
    assert rows == {"sft_multiturn_train.jsonl": 40, "sft_multiturn_val.jsonl": 8}
    text = (tmp_path / "sft_multiturn_train.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    single = [json.loads(line) for line in (tmp_path / "sft_train.jsonl").read_text().splitlines()]
    assert sorted(map(json.dumps, single)) == sorted(
        json.dumps(r) for r in records if "<E>" not in r["prompt"]
    )
    multi = [r for r in records if "<E>" in r["prompt"]]
    assert len(multi) == 10 and {r["prompt"].split(" ", 1)[0] for r in multi} == {"\n\nHuman:"}
    assert {r["prompt"][: r["prompt"].index("Assistant:") + 10] for r in multi} == {
        r["prompt"] for r in single[:10]
    }
    write_multiturn_sft(tmp_path, n_train=10, n_val=2, eos="<E>")
    assert (tmp_path / "sft_multiturn_train.jsonl").read_text() == text  # deterministic
    with pytest.raises(ValueError, match=r"n_train=31: sft_train\.jsonl has 30 prompts"):
        write_multiturn_sft(tmp_path, n_train=31, eos="<E>")
    with pytest.raises(ValueError, match="hint must be one of"):
        write_multiturn_sft(tmp_path, hint="loud", eos="<E>")


def test_cli_make_multiturn_data(tmp_path, capsys):
    """`alignlit sim make-multiturn-data` after make-data: the EOS between the turns is the written
    tokenizer's, the reply the chosen hint."""
    from alignlit.cli.sim import main
    from alignlit.models import load_tokenizer

    sim = tmp_path / "sim"
    assert main(["make-data", "--out", str(sim), "--n-sft", "20", "--n-pairs", "4", "--n-prompts", "4",
                 "--n-val", "4", "--n-test", "2", "--tokenizer-vocab", "300"]) == 0  # fmt: skip
    assert (
        main(["make-multiturn-data", "--sim", str(sim), "--hint", "length", "--n-train", "8", "--n-val", "2"])
        == 0
    )
    assert re.search(r"sft_multiturn_train\.jsonl +28 rows", capsys.readouterr().out)
    eos = load_tokenizer(sim / "tokenizer").eos_token
    records = [json.loads(line) for line in (sim / "sft_multiturn_train.jsonl").read_text().splitlines()]
    multi = [r for r in records if eos in r["prompt"]]
    assert len(multi) == 8 and all("Human: wrong, the answer has" in r["prompt"] for r in multi)
