"""Gymnasium environments, unchanged, as alignlit environments (the ``env`` extra: ``gymnasium``).

:class:`GymEnvironment` makes one Gymnasium environment per episode (``gymnasium.make(env_id,
**env_kwargs)``), resets it with the episode's seed, shows its observations to the model as text and
reads the model's turn as an action of the environment's action space:

- ``Discrete(n)``: the first whole word of the turn that is an action name (``action_names[i]`` is
  action ``start + i``) or, without names, the first integer;
- ``Text``: the turn itself (stripped);
- anything else: the first JSON value of the turn, as ``action_space.from_jsonable`` reads it.

A turn that is not an action (or one the space does not contain) is answered with ``invalid_reply``
and ``invalid_reward``; the environment is not stepped. Gymnasium's ``terminated or truncated`` is the
episode's ``done``; its rewards are the step rewards.
"""

from __future__ import annotations

import json
import re
from typing import Any

from alignlit.rollout.environment import Step


def _import_gymnasium():
    try:
        import gymnasium
    except ImportError as err:
        raise ImportError(
            f"GymEnvironment needs gymnasium: pip install 'alignlit[env]'. Import failed with: {err}"
        ) from err
    return gymnasium


class GymEnvironment:
    """A Gymnasium environment as an alignlit :class:`~alignlit.rollout.environment.Environment`.

    Args:
        env_id: the registered id (e.g. ``"FrozenLake-v1"``) or ``module:Class`` entry point.
        env_kwargs: keyword arguments of ``gymnasium.make`` (e.g. ``{"is_slippery": false}``).
        action_names: the names of a ``Discrete`` space's actions, in order (e.g. FrozenLake's
            ``[left, down, right, up]``), one for each action (else refused at the first reset); None:
            actions are integers.
        first_template: the first observation, from ``{prompt}`` (the data prompt) and ``{observation}``.
        reply_template: every later observation, from ``{observation}``.
        render: show ``env.render()`` (make the environment with ``render_mode: ansi``) instead of
            ``str(observation)``.
        invalid_reward: the reward of a turn that is not a valid action.
        invalid_reply: the reply to it, from ``{actions}`` (the valid actions).
    """

    def __init__(
        self,
        env_id: str,
        env_kwargs: dict[str, Any] | None = None,
        action_names: list[str] | None = None,
        first_template: str = "{prompt}{observation}\n\nAssistant:",
        reply_template: str = "\n\nHuman: {observation}\n\nAssistant:",
        render: bool = False,
        invalid_reward: float = 0.0,
        invalid_reply: str = "invalid action; choose one of {actions}",
    ):
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs or {})
        self.action_names = list(action_names) if action_names is not None else None
        self.first_template, self.reply_template = first_template, reply_template
        self.render, self.invalid_reward, self.invalid_reply = render, invalid_reward, invalid_reply
        self.env = None

    def _show(self, observation) -> str:
        if self.render:
            shown = self.env.render()
            return shown if isinstance(shown, str) else str(shown)
        return str(observation)

    def _check_action_names(self) -> None:
        """``action_names`` name every action of a ``Discrete`` space, once each (fewer names would leave
        actions the model can never take, silently)."""
        if self.action_names is None:
            return
        space = self.env.action_space
        if type(space).__name__ != "Discrete":
            raise ValueError(
                f"GymEnvironment {self.env_id!r}: action_names are for a Discrete action space, but its action "
                f"space is {space}; remove action_names"
            )
        lowered = [name.lower() for name in self.action_names]
        if len(self.action_names) != int(space.n) or len(set(lowered)) != len(lowered):
            raise ValueError(
                f"GymEnvironment {self.env_id!r}: action_names {self.action_names} must name each of the "
                f"{int(space.n)} actions of its action space {space} once (got {len(self.action_names)} names"
                f"{', with repeats' if len(set(lowered)) != len(lowered) else ''})"
            )

    def reset(self, prompt: str, *, seed: int) -> str:
        self.env = _import_gymnasium().make(self.env_id, **self.env_kwargs)
        self._check_action_names()
        observation, _ = self.env.reset(seed=seed)
        self.env.action_space.seed(seed)
        return self.first_template.format(prompt=prompt, observation=self._show(observation))

    def _valid(self) -> str:
        space = self.env.action_space
        if self.action_names is not None:
            return ", ".join(self.action_names)
        if type(space).__name__ == "Discrete":
            return ", ".join(str(space.start + i) for i in range(space.n))
        return str(space)

    def parse_action(self, text: str):
        """The action the turn names, or None."""
        gym = _import_gymnasium()
        space = self.env.action_space
        if isinstance(space, gym.spaces.Discrete):
            if self.action_names is not None:
                names = {name.lower(): i for i, name in enumerate(self.action_names)}
                word = next((w for w in re.findall(r"[A-Za-z_]+", text.lower()) if w in names), None)
                return None if word is None else space.start + names[word]
            number = re.search(r"-?\d+", text)
            return None if number is None else int(number.group())
        if isinstance(space, gym.spaces.Text):
            return text.strip()
        try:
            value, _ = json.JSONDecoder().raw_decode(text[text.find("[") if "[" in text else 0 :].lstrip())
            return space.from_jsonable([value])[0]
        except (ValueError, TypeError, IndexError, KeyError):
            return None

    def step(self, response: str) -> Step:
        if self.env is None:
            raise RuntimeError("GymEnvironment.step before reset")
        action = self.parse_action(response)
        if action is None or not self.env.action_space.contains(action):
            reply = self.invalid_reply.format(actions=self._valid())
            return Step(self.reply_template.format(observation=reply), self.invalid_reward, False,
                        {"invalid_actions": 1})  # fmt: skip
        observation, reward, terminated, truncated, _ = self.env.step(action)
        done = bool(terminated or truncated)
        if done:
            self.env.close()
        return Step(self.reply_template.format(observation=self._show(observation)), float(reward), done)
