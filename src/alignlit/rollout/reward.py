"""Rewards: the one type every online stage, sampler and evaluation scores responses with.

A reward is any of

- a callable ``(prompts, responses) -> (N,) rewards`` (a list of floats or a tensor), e.g.
  :class:`alignlit.sim.SimGoldReward` or a plain function;
- an object with ``score(prompts, responses)`` (a trained reward model,
  :func:`alignlit.models.load_reward_model`);
- an object with ``score_rollout(rollout)`` (scores from token ids, for rewards that need them).

:func:`score_rollout` scores a :class:`~alignlit.rollout.base.Rollout` with any of them and checks the
result; :func:`resolve_reward` turns a config value (a reward-model directory or the dotted path of a
function) into one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from alignlit.checks import import_object
from alignlit.rollout.base import Rollout


@runtime_checkable
class RewardModel(Protocol):
    """Anything with ``score(prompts, responses) -> (N,) rewards`` (a trained reward model)."""

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor: ...


@runtime_checkable
class RolloutScorer(Protocol):
    """Anything that scores a rollout from its token ids, ``score_rollout(rollout) -> (N,) rewards``."""

    def score_rollout(self, rollout: Rollout) -> torch.Tensor: ...


RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
"""A reward callable ``(prompts, responses) -> (N,) rewards`` (a list of floats or a (N,) tensor), e.g.
``SimTask.gold_rewards``. In a config: the ``class_path`` of a callable class such as
:class:`alignlit.sim.SimGoldReward`, or the dotted path of a function (``mypkg.rewards.length_reward``)."""

Reward = RolloutScorer | RewardModel | RewardFn
"""Any of the three reward kinds (see the module docstring)."""


def _checked(out, n: int, prompts: Sequence[str], texts: Sequence[str]) -> torch.Tensor:
    rewards = torch.as_tensor(out.detach() if torch.is_tensor(out) else out, dtype=torch.float32).cpu()
    if rewards.shape != (n,):
        raise ValueError(
            f"reward returned shape {tuple(rewards.shape)} for {n} responses; expected ({n},), one score "
            "per response"
        )
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten()[:3].tolist()
        raise ValueError(
            f"reward returned non-finite scores at rows {bad}, e.g. prompt {prompts[bad[0]]!r} / "
            f"response {texts[bad[0]]!r}"
        )
    return rewards


def score_texts(reward: Reward, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
    """Score ``(prompt, response)`` texts as a (N,) float32 CPU tensor (``reward.score`` or ``reward(...)``).

    Raises ``ValueError`` when the reward does not return one finite number per response.
    """
    prompts, responses = list(prompts), list(responses)
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if isinstance(reward, RewardModel):
        out = reward.score(prompts, responses)
    elif callable(reward):
        out = reward(prompts, responses)
    else:
        raise TypeError(
            "reward must have .score(prompts, responses) or be callable (prompts, responses) -> rewards; "
            f"got {type(reward).__name__}"
        )
    return _checked(out, len(prompts), prompts, responses)


def score_rollout(reward: Reward, rollout: Rollout) -> torch.Tensor:
    """Score every sample of ``rollout`` as a (N,) float32 CPU tensor.

    ``reward`` is tried as ``reward.score_rollout(rollout)`` (token ids), then
    ``reward.score(prompts, texts)``, then ``reward(prompts, texts)``. Raises ``ValueError`` when it
    does not return one finite number per sample.
    """
    if isinstance(reward, RolloutScorer):
        return _checked(reward.score_rollout(rollout), len(rollout), rollout.prompts, rollout.texts)
    return score_texts(reward, rollout.prompts, rollout.texts)


def resolve_reward(spec: str | Reward, *, batch_size: int = 64, dtype: str = "float32") -> Reward:
    """A reward from a config value.

    - a reward object or callable is returned as it is;
    - a directory is loaded as a trained reward model (:func:`alignlit.models.load_reward_model`,
      frozen, scoring texts encoded as in its training, ``batch_size`` sequences per forward);
    - any other string is the dotted path of a reward function or object
      (``mypkg.rewards.length_reward`` or ``mypkg.rewards:length_reward``).
    """
    if not isinstance(spec, str):
        if not (isinstance(spec, (RewardModel, RolloutScorer)) or callable(spec)):
            raise TypeError(f"not a reward: {type(spec).__name__} (see alignlit.rollout.reward)")
        return spec
    path = Path(spec)
    if path.is_dir() or "/" in spec or spec.startswith("package:"):
        from alignlit.models.reward import load_reward_model

        if not (path.is_dir() or spec.startswith("package:")):
            raise FileNotFoundError(f"reward model directory {spec!r} does not exist")
        return load_reward_model(spec, batch_size=batch_size, dtype=dtype)
    try:
        obj = import_object(spec)
    except ImportError as e:
        raise ValueError(
            f"reward {spec!r} is neither a reward-model directory nor an importable function ({e})"
        ) from e
    if isinstance(obj, type):
        raise ValueError(
            f"reward {spec!r} is a class: give it as `class_path: {spec}` (with `init_args`), not as a string"
        )
    return resolve_reward(obj)
