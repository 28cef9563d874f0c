"""Environment values (issue 36): each case failed on main before the fix.

- ``done`` was not type-checked: ``"False"`` ended the episode; a numpy bool is still accepted;
- a ``numpy.float32`` reward was refused as "expected a real number"; a reward of 1e39 failed later with
  "value cannot be converted to type float without overflow"; a bad ``info`` gave raw ``dict()`` /
  ``int()`` errors — each is now accepted or refused naming the environment, the field and the value;
- a first observation longer than the model's positions generated anyway;
- a Gymnasium adapter with fewer ``action_names`` than the action space was accepted;
- an environment class without annotations was refused by the config parser ("does not implement protocol
  Environment"), and a class missing a method was refused without saying which;
- ``rollout.max_episode_tokens 400`` on a 128-position model was reported as ``max_new_tokens`` with the
  advice "max_prompt_length to at most -272".
"""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
from jsonargparse import ArgumentParser

from alignlit.cli.config_errors import explain
from alignlit.models import export_pretrained, make_tiny_llama
from alignlit.modules import Minibatches, PolicyGradientModule
from alignlit.rollout import (
    EpisodeReturn,
    GymEnvironment,
    HFEngine,
    RolloutLoop,
    SamplingParams,
    run_episodes,
)
from alignlit.rollout.environment import Environment, as_step
from tests.conftest import TINY
from tests.rollout.test_episodes import PROMPT, ScriptedEngine, words


class Plain:
    """An environment written without a single annotation."""

    def reset(self, prompt, *, seed):
        self.prompt = prompt
        return prompt

    def step(self, response):
        return "", 1.0, True


class NoStep:
    def reset(self, prompt, *, seed):
        return prompt


class NoSeed:
    def reset(self, prompt):
        return prompt

    def step(self, response):
        return "", 1.0, True


class Returns:
    """Steps return ``value`` (a fixed step tuple) once."""

    def __init__(self, value):
        self.value = value

    def reset(self, prompt, *, seed):
        return prompt

    def step(self, response):
        return self.value


def episode(tokenizer, env):
    engine = ScriptedEngine(tokenizer, [[words(tokenizer, " a c d")], [words(tokenizer, " a")]])
    return run_episodes(engine, tokenizer, env, [PROMPT], 1, SamplingParams(max_new_tokens=8, seed=0),
                        max_turns=2, max_episode_tokens=64)  # fmt: skip


def test_done_must_be_a_bool_not_a_string(tokenizer):
    with pytest.raises(ValueError, match=r"Returns step returned done 'False' of type str; expected a bool"):
        episode(tokenizer, Returns(("reply", 0.0, "False")))
    with pytest.raises(ValueError, match="done 0 of type int"):
        as_step(("", 0.0, 0))
    assert as_step(("", 1.0, np.True_)).done is True and as_step(("", 1.0, np.False_)).done is False


def test_numpy_rewards_are_real_numbers(tokenizer):
    rollout, stats = episode(tokenizer, Returns(("", np.float32(0.5), True)))
    assert stats.returns == [0.5] and float(rollout.turn_rewards.sum()) == 0.5
    assert as_step(("", np.int64(2), True)).reward == 2.0


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (("", 1e39, True), r"Returns step returned reward 1e\+39; expected a finite number within float32"),
        (("", float("inf"), True), r"Returns step returned reward inf"),
        (("", "1", True), r"Returns step returned reward '1' of type str; expected a real number"),
        (("", 1.0, True, "oops"), r"Returns step returned info 'oops' of type str; expected a dict or None"),
        (("", 1.0, True, [1, 2]), r"Returns step returned info \[1, 2\] of type list"),
        (("", 1.0, True, {"tool_calls": "two"}), r"Returns step returned info\['tool_calls'\] = 'two'"),
        (
            ("", 1.0, True, {"tool_errors": -1}),
            r"info\['tool_errors'\] = -1; expected a non-negative integer",
        ),
    ],
)
def test_bad_step_values_name_the_environment_the_field_and_the_value(tokenizer, value, match):
    with pytest.raises(ValueError, match=match):
        episode(tokenizer, Returns(value))


def test_a_first_observation_longer_than_the_positions_is_refused(tokenizer):
    model = make_tiny_llama(tokenizer, seed=0, max_position_embeddings=64, **TINY)

    class Long(Plain):
        def reset(self, prompt, *, seed):
            return prompt + " a b c" * (40 if seed % 2 else 15)  # episode 0: 15, episode 1: 40

    with pytest.raises(
        ValueError,
        match=r"Long: the first observation of episode 0 \(prompt 0, .*\) has \d+ tokens: with max_episode_tokens "
        r"8 the episode needs \d+ positions, but the policy has 64 .* lower rollout.max_episode_tokens to at most",
    ):
        run_episodes(HFEngine(tokenizer, model), tokenizer, Long(), [PROMPT], 2,
                     SamplingParams(max_new_tokens=4, seed=0), max_turns=1, max_episode_tokens=8)  # fmt: skip
    # a first observation that fits runs
    rollout, _ = run_episodes(HFEngine(tokenizer, model), tokenizer, Plain(), [PROMPT], 1,
                              SamplingParams(max_new_tokens=4, seed=0), max_turns=1, max_episode_tokens=8)  # fmt: skip
    assert len(rollout) == 1


def test_a_gym_adapter_must_name_every_action():
    pytest.importorskip("gymnasium")
    env = GymEnvironment(
        "FrozenLake-v1", env_kwargs={"is_slippery": False}, action_names=["left", "down", "right"]
    )
    with pytest.raises(
        ValueError, match=r"action_names \['left', 'down', 'right'\] must name each of the 4 actions"
    ):
        env.reset("", seed=0)
    twice = GymEnvironment("FrozenLake-v1", action_names=["left", "down", "Left", "up"])
    with pytest.raises(ValueError, match="with repeats"):
        twice.reset("", seed=0)
    GymEnvironment("FrozenLake-v1", action_names=["left", "down", "right", "up"]).reset("", seed=0)


def parse_environment(class_path: str):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--environment", type=Environment | None)
    return parser, parser.parse_args([f'--environment={{"class_path": "{class_path}"}}'])


def test_an_environment_class_without_annotations_is_accepted_by_the_config_parser():
    parser, config = parse_environment("tests.hostile.test_environments.Plain")
    assert isinstance(parser.instantiate(config).environment, Plain)


def test_an_environment_class_missing_a_method_is_refused_naming_it():
    with pytest.raises(Exception) as caught:
        parse_environment("tests.hostile.test_environments.NoStep")
    text = explain(str(caught.value), None, [])
    assert (
        "Import path tests.hostile.test_environments.NoStep does not implement protocol Environment" in text
    )
    assert "it has no method step (needs reset, step)" in text


def test_max_episode_tokens_beyond_the_positions_names_the_field_and_valid_advice(tokenizer, tmp_path):
    policy_dir = tmp_path / "short"
    export_pretrained(make_tiny_llama(tokenizer, seed=0, max_position_embeddings=128, **TINY), tokenizer,
                      policy_dir, stage="init")  # fmt: skip
    module = PolicyGradientModule(
        policy=str(policy_dir), reward=EpisodeReturn(), minibatches=Minibatches(size=2),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=8), samples_per_prompt=2, environment=Plain(),
                            max_episode_tokens=400),
    )  # fmt: skip
    from alignlit.data import PromptDataModule

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path, max_epochs=1, limit_train_batches=1)  # fmt: skip
    prompts = [{"prompt": PROMPT}, {"prompt": "\n\nHuman: copy b\n\nAssistant:"}]
    with pytest.raises(ValueError) as caught:
        trainer.fit(module, PromptDataModule(records=prompts, batch_size=2))
    message = str(caught.value)
    length = len(tokenizer(PROMPT)["input_ids"])
    assert (
        f"with max_episode_tokens 400 (rollout.max_episode_tokens) a sample needs {length + 400} positions"
        in message
    )
    assert "rollout.max_episode_tokens 400 alone needs every position the policy has" in message
    assert f"Lower rollout.max_episode_tokens to at most {128 - length}" in message
    assert "max_prompt_length" not in message and "-" not in message.split("(max_position_embeddings)")[1]


def test_an_environment_class_with_other_arguments_is_refused_with_the_signatures():
    with pytest.raises(Exception) as caught:
        parse_environment("tests.hostile.test_environments.NoSeed")
    text = explain(str(caught.value), None, [])
    assert (
        "its methods must accept the protocol's arguments: reset(self, prompt, *, seed); step(self, response)"
        in text
    )
