"""math-verify and reasoning-gym rewards on known answers; a reasoning-gym prompt DataModule (seeded draws)
feeds GRPO; reasoning-gym as a single-turn verifiable environment through the episode runner."""

from __future__ import annotations

import ast
import re

import lightning as L
import pytest
import torch

from alignlit.data.records import DataError
from alignlit.modules import Minibatches, Optim, PolicyGradientModule
from alignlit.rewards.math import MathVerifyReward, gold_answer, math_verify_score
from alignlit.rewards.reasoning_gym import (
    ReasoningGymDataModule,
    ReasoningGymEnvironment,
    ReasoningGymReward,
    ReasoningGymTask,
    extract_answer,
)
from alignlit.rollout import EpisodeReturn, RolloutLoop, SamplingParams, run_episodes
from tests.rollout.test_episodes import ScriptedEngine, words

# (gold, response, right?) — GSM8K and MATH style pairs with known verdicts
MATH_PAIRS = [
    ("Natalia sold 48/2 = 24 clips in May ... #### 72", "She sold 72 clips altogether.", True),
    ("#### 1,234", "The total is \\boxed{1234}.", True),
    ("#### 72", "The answer is 27.", False),
    ("\\frac{1}{2}", "So the probability is $\\boxed{0.5}$", True),
    ("\\frac{1}{2}", "So the probability is $\\boxed{\\frac{1}{3}}$", False),
    ("2\\sqrt{2}", "$x = \\sqrt{8}$", True),
    ("(1, 2)", "the interval is $\\boxed{(1,2)}$", True),
    ("x^2 + 2x + 1", "expanding gives $\\boxed{(x+1)^2}$", True),
    ("5", "I don't know", False),
]


@pytest.mark.parametrize(("gold", "response", "right"), MATH_PAIRS)
def test_math_verify_known_answer_pairs(gold, response, right):
    assert math_verify_score(gold, response) == float(right)


def test_math_verify_reward():
    assert gold_answer("so 3 + 4 = 7\n#### 7") == "7"
    reward = MathVerifyReward(answers={"q1": "#### 72", "q2": "\\frac{1}{2}"})
    got = reward(["q1", "q2", "q1"], ["it is 72", "$\\boxed{0.5}$", "70"])
    assert torch.equal(got, torch.tensor([1.0, 1.0, 0.0]))
    with pytest.raises(DataError, match="no gold answer for prompt row 0"):
        reward(["q3"], ["1"])


def test_reasoning_gym_task_scores_known_answers():
    task = ReasoningGymTask("basic_arithmetic", size=5, val_size=2, seed=3)
    again = ReasoningGymTask("basic_arithmetic", size=5, val_size=2, seed=3)
    other = ReasoningGymTask("basic_arithmetic", size=5, val_size=2, seed=4)
    assert task.prompts() == again.prompts() and task.prompts() != other.prompts()
    assert not set(task.prompts("train")) & set(task.prompts("val"))
    reward = ReasoningGymReward("basic_arithmetic", size=5, val_size=2, seed=3)
    for entry, prompt in zip(task.train, task.prompts()):
        answer = entry["answer"]
        assert prompt == f"\n\nHuman: {entry['question']}\n\nAssistant:"
        wrong = str(int(answer) + 1)
        got = reward(
            [prompt] * 4, [f" {answer}", f" <answer>{answer}</answer>", f" {wrong}", "the answer: " + answer]
        )
        assert got.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert extract_answer("think... <answer>12</answer> then <answer>13</answer>") == "13"


def _evaluate(expression: str) -> int:
    """An arithmetic expression of integers, + - * / and brackets, evaluated by Python's own parser
    (an answer independent of reasoning-gym's); integral results only."""
    tree = ast.parse(expression.replace("−", "-"), mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    allowed += (ast.USub, ast.UAdd)
    assert all(isinstance(node, allowed) for node in ast.walk(tree)), expression
    value = eval(compile(tree, "<question>", "eval"))  # only numbers and operators, checked above
    assert float(value).is_integer(), (expression, value)
    return int(value)


@pytest.mark.parametrize(
    ("dataset", "pattern"),
    [
        ("chain_sum", r"problem: (.*) =$"),
        ("basic_arithmetic", r"^Calculate (.*)\.$"),
    ],
)
def test_reasoning_gym_scores_answers_we_computed(dataset, pattern):
    """The reward of answers computed here from the question text (not the dataset's answer field):
    1 for the value, 1 inside <answer> tags, 0 for value + 1 and for value - 1."""
    config = {"min_terms": 2, "max_terms": 4, "max_digits": 2} if dataset == "basic_arithmetic" else None
    task = ReasoningGymTask(dataset, size=12, val_size=0, seed=11, config=config)
    reward = ReasoningGymReward(dataset, size=12, val_size=0, seed=11, config=config)
    checked = 0
    for prompt, entry in zip(task.prompts(), task.train):
        match = re.search(pattern, entry["question"].strip())
        assert match, entry["question"]
        value = _evaluate(match.group(1))
        responses = [f" {value}", f" so <answer>{value}</answer>", f" {value + 1}", f" {value - 1}"]
        assert reward([prompt] * 4, responses).tolist() == [1.0, 1.0, 0.0, 0.0], entry["question"]
        checked += 1
    assert checked == 12


def test_reasoning_gym_as_a_single_turn_environment(tokenizer):
    env = ReasoningGymEnvironment("chain_sum", size=2, val_size=0, seed=1)
    prompts = env.task.prompts()
    answers = [e["answer"] for e in env.task.train]
    script = [[words(tokenizer, " " + answers[0]), words(tokenizer, " 999")]]
    rollout, stats = run_episodes(
        ScriptedEngine(tokenizer, script),
        tokenizer,
        env,
        prompts,
        1,
        SamplingParams(max_new_tokens=16, seed=0),
        max_turns=4,
        max_episode_tokens=32,
    )
    assert (
        stats.turns == [1, 1]
        and stats.returns == [1.0, 0.0]
        and torch.equal(rollout.action_mask, rollout.response_mask)
    )
    assert EpisodeReturn().score_rollout(rollout).tolist() == [1.0, 0.0]


class Recorded(ReasoningGymReward):
    """The task's reward, recording what it scored."""

    def __call__(self, prompts, responses):
        scores = super().__call__(prompts, responses)
        self.seen = [*getattr(self, "seen", []), *zip(prompts, responses, scores.tolist())]
        return scores


def test_reasoning_gym_datamodule_feeds_grpo(tiny_policy_dir, tmp_path):
    """A seeded draw of basic_arithmetic questions trains GRPO (2 rollouts of 2 prompts x 2 samples) with the
    task's own reward; an entropy bonus gives a gradient even when every answer of a group is wrong."""
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    dm = ReasoningGymDataModule(
        "basic_arithmetic", size=8, val_size=4, task_seed=5, batch_size=2, config=config
    )
    dm.setup("fit")
    assert len(dm.train_prompts) == 8 and len(dm.val_prompts) == 4
    assert dm.train_prompts == ReasoningGymTask("basic_arithmetic", 8, 4, 5, config).prompts()
    assert not set(dm.train_prompts) & set(dm.val_prompts)
    reward = Recorded("basic_arithmetic", 8, 4, 5, config)
    module = PolicyGradientModule(
        policy=str(tiny_policy_dir),
        reward=reward,
        entropy_coef=0.01,
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=4), samples_per_prompt=2),
        minibatches=Minibatches(size=4),
        optim=Optim(lr=1e-3, min_lr_ratio=1.0),
    )
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm)
    assert len([h for h in module.progress.history if "time/train_s" in h]) == 2
    assert len(reward.seen) == 8 and {p for p, _, _ in reward.seen} <= set(dm.train_prompts)
    for prompt, response, score in reward.seen:
        assert score == reward.task.score(prompt, response)
    assert not all(torch.equal(v, before[k]) for k, v in module.policy.state_dict().items())
