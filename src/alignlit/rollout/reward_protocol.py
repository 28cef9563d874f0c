"""The reward protocol: the one type every online stage, sampler and evaluation scores responses with.

A reward is any of

- a callable ``(prompts, responses) -> (N,) rewards`` (a list of floats or a tensor), e.g.
  :class:`alignlit.sim.SimGoldReward` or a plain function;
- an object with ``score(prompts, responses)`` (a trained reward model,
  :func:`alignlit.models.load_reward_model`);
- an object with ``score_rollout(rollout)`` (scores from token ids, for rewards that need them).

:func:`score_rollout` scores a :class:`~alignlit.rollout.base.Rollout` with any of them and checks the
result; :func:`resolve_reward` turns a config value (a reward-model directory or the dotted path of a
function) into one. The rewards alignlit ships (verifiers, the LLM judge,
:class:`~alignlit.rewards.PreferenceRanking`) are in :mod:`alignlit.rewards`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from alignlit.checks import import_object
from alignlit.data.chat import prompt_columns
from alignlit.rollout.base import Rollout


@runtime_checkable
class TextScorer(Protocol):
    """Anything that scores texts, ``score(prompts, responses) -> (N,) rewards``: a trained reward model
    (:class:`alignlit.models.RewardModel`) or an ensemble of them (:class:`alignlit.models.RewardEnsemble`)."""

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor: ...


@runtime_checkable
class RolloutScorer(Protocol):
    """Anything that scores a rollout from its token ids, ``score_rollout(rollout) -> (N,) rewards``."""

    def score_rollout(self, rollout: Rollout) -> torch.Tensor: ...


RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
"""A reward callable ``(prompts, responses) -> (N,) rewards`` (a list of floats or a (N,) tensor), e.g.
``SimTask.gold_rewards``. In a config: the ``class_path`` of a callable class such as
:class:`alignlit.sim.SimGoldReward`, or the dotted path of a function (``mypkg.rewards.length_reward``)."""

Reward = RolloutScorer | TextScorer | RewardFn
"""Any of the three reward kinds (see the module docstring)."""


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _reward_name(reward) -> str:
    name = getattr(reward, "__qualname__", None) or type(reward).__qualname__
    module = getattr(reward, "__module__", None) or type(reward).__module__
    return f"{module}.{name}" if module and module != "builtins" else name


def _number(value, row: int, where: str) -> float:
    """One score as a float32-representable float, or a ValueError saying what it is instead."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(
                f"{where} returned a tensor of shape {tuple(value.shape)} at row {row}; expected one number"
            )
        value = value.item()
    elif hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        value = value.item()  # a NumPy scalar
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if value is None:
            what = "None"
        else:
            kind = "a complex number" if isinstance(value, complex) else type(value).__name__
            what = f"{kind} ({value!r:.60})"
        raise ValueError(f"{where} returned {what} at row {row}; expected a real number")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(
            f"{where} returned an integer of {len(str(abs(value)))} digits at row {row}, too large for a float "
            f"(float32 holds at most {FLOAT32_MAX:.3g})"
        ) from None
    if math.isfinite(number) and abs(number) > FLOAT32_MAX:
        raise ValueError(
            f"{where} returned {number:.6g} at row {row}, which overflows float32 (the largest float32 is "
            f"{FLOAT32_MAX:.3g}); scale the reward down"
        )
    return number


def _checked(out, n: int, prompts: Sequence[str], texts: Sequence[str], reward=None) -> torch.Tensor:
    """``out`` as a (n,) float32 CPU tensor, or a ``ValueError`` that starts with "reward ... returned"
    and says what came back instead of one finite real number per response."""
    where = "reward" if reward is None else f"reward {_reward_name(reward)}"
    if torch.is_tensor(out):
        if out.is_complex():
            raise ValueError(f"{where} returned a complex tensor ({out.dtype}); expected real scores")
        if not (
            out.is_floating_point()
            or out.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
        ):
            raise ValueError(f"{where} returned a tensor of dtype {out.dtype}; expected real scores")
        values = out.detach().to("cpu", torch.float64)
        if values.shape != (n,):
            raise ValueError(
                f"{where} returned shape {tuple(values.shape)} for {n} responses; expected ({n},), one score "
                "per response"
            )
        big = (values.abs() > FLOAT32_MAX) & torch.isfinite(values)
        if big.any():
            row = int(big.nonzero()[0])
            _number(float(values[row]), row, where)
        rewards = values.float()
    else:
        if out is None or isinstance(out, (str, bytes, dict, set, frozenset)) or not hasattr(out, "__len__"):
            kind = "None" if out is None else type(out).__name__
            raise ValueError(
                f"{where} returned {kind}"
                + ("" if out is None else f" ({out!r:.60})")
                + f"; expected one number per response: a list of {n} floats or a ({n},) tensor"
            )
        if getattr(out, "ndim", 1) != 1 or len(out) != n:
            shape = tuple(getattr(out, "shape", (len(out),)))
            raise ValueError(
                f"{where} returned shape {shape} for {n} responses; expected ({n},), one score per response"
            )
        rewards = torch.tensor([_number(v, i, where) for i, v in enumerate(out)], dtype=torch.float32)
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten()[:3].tolist()
        raise ValueError(
            f"{where} returned non-finite scores at rows {bad} ({float(rewards[bad[0]])} at row {bad[0]}), "
            f"e.g. prompt {prompts[bad[0]]!r} / response {texts[bad[0]]!r}"
        )
    return rewards


def column_kwargs(fn: Callable, prompts: Sequence[str]) -> dict[str, list]:
    """The prompts' record columns (:func:`alignlit.data.chat.prompt_columns`) that ``fn`` takes as keyword
    arguments: those its signature names, or all of them when it has ``**kwargs`` (TRL's convention:
    ``reward(prompts, completions, answer=[...])``)."""
    columns = prompt_columns(prompts)
    if not columns:
        return {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return columns
    positional = list(params)[:2]  # (prompts, responses)
    return {
        k: v
        for k, v in columns.items()
        if k in params and k not in positional and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY
    }


def score_texts(reward: Reward, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
    """Score ``(prompt, response)`` texts as a (N,) float32 CPU tensor (``reward.score`` or ``reward(...)``).

    Columns the prompts carry (:class:`~alignlit.data.Prompt` fields, e.g. a reference ``answer``) are
    passed as keyword lists to a reward whose signature names them (:func:`column_kwargs`).
    Raises ``ValueError`` when the reward does not return one finite number per response.
    """
    prompts, responses = list(prompts), list(responses)
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if isinstance(reward, TextScorer):
        out = reward.score(prompts, responses, **column_kwargs(reward.score, prompts))
    elif callable(reward):
        out = reward(prompts, responses, **column_kwargs(reward, prompts))
    else:
        raise TypeError(
            "reward must have .score(prompts, responses) or be callable (prompts, responses) -> rewards; "
            f"got {type(reward).__name__}"
        )
    return _checked(out, len(prompts), prompts, responses, reward)


def score_rollout(reward: Reward, rollout: Rollout) -> torch.Tensor:
    """Score every sample of ``rollout`` as a (N,) float32 CPU tensor.

    ``reward`` is tried as ``reward.score_rollout(rollout)`` (token ids), then
    ``reward.score(prompts, texts)``, then ``reward(prompts, texts)``. Raises ``ValueError`` when it
    does not return one finite number per sample.
    """
    if isinstance(reward, RolloutScorer):
        return _checked(reward.score_rollout(rollout), len(rollout), rollout.prompts, rollout.texts, reward)
    return score_texts(reward, rollout.prompts, rollout.texts)


def reward_counters(reward) -> dict[str, float]:
    """A reward's own counters to log with each rollout: its ``metrics()`` (e.g. ``math_verify/timeouts``
    of :class:`~alignlit.rewards.math.MathVerifyReward`, ``judge/failed_default_score`` of
    :class:`~alignlit.rewards.judge.JudgeReward`), or nothing for a reward without one."""
    fn = getattr(reward, "metrics", None)
    if not callable(fn) or isinstance(reward, torch.nn.Module):
        return {}
    out = fn()
    return {str(k): float(v) for k, v in out.items()} if isinstance(out, dict) else {}


def resolve_reward(spec: str | Reward, *, batch_size: int = 64, dtype: str = "float32") -> Reward:
    """A reward from a config value.

    - a reward object or callable is returned as it is;
    - a directory is loaded as a trained reward model (:func:`alignlit.models.load_reward_model`,
      frozen, scoring texts encoded as in its training, ``batch_size`` sequences per forward);
    - any other string is the dotted path of a reward function or object
      (``mypkg.rewards.length_reward`` or ``mypkg.rewards:length_reward``).
    """
    if not isinstance(spec, str):
        if not (isinstance(spec, (TextScorer, RolloutScorer)) or callable(spec)):
            raise TypeError(f"not a reward: {type(spec).__name__} (see alignlit.rollout.reward_protocol)")
        return spec
    path = Path(spec)
    if path.is_dir() or "/" in spec or spec.startswith("package:"):
        from alignlit.models.reward_model import load_reward_model

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
