"""Multi-turn episodes, token in / token out: an engine's turns and an environment's replies in one rollout.

:func:`run_episodes` plays ``n`` episodes per prompt with an :class:`~alignlit.rollout.environment.Environment`:

1. ``reset(prompt, seed)`` gives the first observation, tokenised once (with the tokenizer's special
   tokens, as a prompt is) into the episode's context;
2. the engine samples a turn from the context's token ids (``generate_from_ids``: the history is never
   re-tokenised or re-rendered through a chat template); the turn's own ids (EOS included when sampled)
   and log-probs are appended;
3. ``step(turn text)`` gives a reward and a reply; unless ``done``, the reply is tokenised once
   (no special tokens added) and appended; repeat.

The returned :class:`~alignlit.rollout.base.Rollout` holds, for each episode, the first observation as its
prompt and every later token as its response side: ``response_mask`` covers the model's and the
environment's tokens (the context of every forward), ``action_mask`` only the model's (the tokens trained
on), ``logprobs`` are the engine's at model tokens and 0 at environment tokens, and ``turn_rewards`` holds
each step's reward on the last model token of the turn it answered (its sum over a row is the episode's
return, :class:`EpisodeReturn`). ``texts`` are the decoded transcripts (model and environment turns).

Limits: ``max_turns`` model turns and ``max_episode_tokens`` response-side tokens (model + environment)
per episode. A turn is cut at the budget; an episode that ends at a limit without ``done`` is truncated
(finish reason ``"length"``; ``episode/truncated``). A finished episode has finish reason ``"stop"``, or
``"length"`` when its last turn was cut at ``max_new_tokens`` (as a single-turn response would).

Seeding: turn ``t`` is sampled with seed ``base + t·TURN_SEED_STRIDE`` and episode ``j`` is reset with
seed ``(base·RESET_SEED_STRIDE + j) mod 2^31``, ``base`` the sampling seed (a training rollout's
``seed + rollouts``): a resumed run replays the same episodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.environment import Environment, as_step, spawn
from alignlit.rollout.postprocess import check_prompts, pad_prompt_ids, require_pad_token
from alignlit.rollout.reward_protocol import resolve_reward, score_rollout

TURN_SEED_STRIDE = 104_729
"""Turn ``t`` of an episode batch is sampled with seed ``base + t * TURN_SEED_STRIDE``."""
RESET_SEED_STRIDE = 1_000_033
"""Episode ``j`` is reset with seed ``(base * RESET_SEED_STRIDE + j) mod 2**31``."""


@dataclass
class EpisodeStats:
    """Per-episode counts of :func:`run_episodes`, (N,) lists in rollout order."""

    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_errors: list[int] = field(default_factory=list)
    tool_timeouts: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    env_tokens: list[int] = field(default_factory=list)
    model_tokens: list[int] = field(default_factory=list)
    turn_texts: list[list[str]] = field(default_factory=list)
    """Each episode's model turns as the environment saw them."""

    def metrics(self) -> dict[str, float]:
        """Means per episode: ``episode/turns``, ``episode/tool_calls``, ``episode/tool_errors``,
        ``episode/tool_timeouts`` (tool calls past ``tool_timeout_s``, also among the errors), ``episode/return``, ``episode/env_tokens``, ``episode/model_tokens``; ``episode/truncated``: the fraction cut at a limit."""
        count = max(len(self.turns), 1)
        return {
            "episode/turns": sum(self.turns) / count,
            "episode/tool_calls": sum(self.tool_calls) / count,
            "episode/tool_errors": sum(self.tool_errors) / count,
            "episode/tool_timeouts": sum(self.tool_timeouts) / count,
            "episode/truncated": sum(self.truncated) / count,
            "episode/return": sum(self.returns) / count,
            "episode/env_tokens": sum(self.env_tokens) / count,
            "episode/model_tokens": sum(self.model_tokens) / count,
        }


@dataclass
class _Episode:
    env: Environment
    context: list[int]
    ids: list[int] = field(default_factory=list)
    actions: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)
    pending: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_tokens: int = 0
    done: bool = False
    truncated: bool = False
    cut: bool = False
    texts: list[str] = field(default_factory=list)

    def add_reward(self, reward: float) -> None:
        """On the last model token so far (a turn without a token: kept for the next one)."""
        last = max((i for i, a in enumerate(self.actions) if a), default=None)
        if last is None:
            self.pending += reward
        else:
            self.rewards[last] = self.rewards.get(last, 0.0) + reward + self.pending
            self.pending = 0.0


def _reset_seed(base: int, j: int) -> int:
    return (base * RESET_SEED_STRIDE + j) % 2**31


def engine_positions(engine) -> int | None:
    """The positions of the model an engine samples from (``max_position_embeddings`` of its ``model``'s
    config, or its own ``max_positions``); None when it does not say."""
    limit = getattr(engine, "max_positions", None)
    if limit is None:
        config = getattr(getattr(engine, "model", None), "config", None)
        limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) else None


def run_episodes(
    engine,
    tokenizer,
    environment: Environment,
    prompts: Sequence[str],
    n: int,
    sampling: SamplingParams,
    *,
    max_turns: int,
    max_episode_tokens: int,
    max_positions: int | None = None,
) -> tuple[Rollout, EpisodeStats]:
    """Play ``n`` episodes per prompt (see the module docstring); returns the rollout and its counts.

    Args:
        engine: an engine with ``generate_from_ids(prompt_ids, n, sampling)`` (HF, vLLM).
        tokenizer: the policy's tokenizer.
        environment: the configured environment (each episode steps its own shallow copy).
        prompts: (B,) prompts; episode ``j`` is sample ``j % n`` of prompt ``j // n``.
        n: episodes per prompt.
        sampling: how turns are sampled; ``max_new_tokens`` caps each turn.
        max_turns: most model turns per episode.
        max_episode_tokens: most response-side tokens (model + environment) per episode.
        max_positions: the policy's positions (default: the engine's, :func:`engine_positions`): a first
            observation that leaves fewer than ``max_episode_tokens`` of them is refused, naming the
            episode and its prompt, before anything is generated.
    """
    prompts = check_prompts(prompts, n)
    if max_turns < 1 or max_episode_tokens < 1:
        raise ValueError(
            f"max_turns and max_episode_tokens must be >= 1, got {max_turns}, {max_episode_tokens}"
        )
    generate = getattr(engine, "generate_from_ids", None)
    if not callable(generate):
        raise TypeError(
            f"{type(engine).__name__} has no generate_from_ids: it cannot run multi-turn episodes"
        )
    pad_id = require_pad_token(tokenizer)
    base = sampling.seed if sampling.seed is not None else int(torch.randint(2**31 - 1, (1,)))
    limit = max_positions if max_positions is not None else engine_positions(engine)
    source = type(environment).__name__
    episodes: list[_Episode] = []
    for j, prompt in enumerate(p for p in prompts for _ in range(n)):
        env = spawn(environment)
        first = env.reset(prompt, seed=_reset_seed(base, j))
        if not isinstance(first, str):
            raise ValueError(
                f"{source} reset returned {type(first).__name__}, expected the first observation (str)"
            )
        ids = tokenizer(first)["input_ids"]
        if not ids:
            raise ValueError(f"the first observation of prompt {prompt!r} encodes to no tokens")
        if limit is not None and len(ids) + max_episode_tokens > limit:
            raise ValueError(
                f"{source}: the first observation of episode {j} (prompt {j // n}, {prompt[:40]!r}...) has "
                f"{len(ids)} tokens: with max_episode_tokens {max_episode_tokens} the episode needs "
                f"{len(ids) + max_episode_tokens} positions, but the policy has {limit} "
                "(max_position_embeddings). Shorten the prompt or the environment's first observation, or "
                f"lower rollout.max_episode_tokens to at most {limit - len(ids)}"
                if len(ids) < limit
                else f"{source}: the first observation of episode {j} (prompt {j // n}, {prompt[:40]!r}...) has "
                f"{len(ids)} tokens, more than the policy's {limit} positions (max_position_embeddings): "
                "shorten the prompt or the environment's first observation"
            )
        episodes.append(_Episode(env, list(ids)))
    first_contexts = [list(e.context) for e in episodes]

    for turn in range(max_turns):
        active = [e for e in episodes if not (e.done or e.truncated)]
        if not active:
            break
        room = max(max_episode_tokens - len(e.ids) for e in active)
        turn_sampling = dataclasses.replace(
            sampling, seed=base + turn * TURN_SEED_STRIDE, max_new_tokens=min(sampling.max_new_tokens, room)
        )
        out = generate([e.context for e in active], 1, turn_sampling)
        for k, e in enumerate(active):
            length = int(out.response_mask[k].sum())
            ids = out.response_ids[k, :length].tolist()
            logps = out.logprobs[k, :length].tolist()
            budget = max_episode_tokens - len(e.ids)
            cut = len(ids) > budget
            ids, logps = ids[:budget], logps[:budget]
            text = tokenizer.decode(ids, skip_special_tokens=True) if cut else out.texts[k]
            e.ids += ids
            e.actions += [True] * len(ids)
            e.logprobs += logps
            e.context += ids
            e.turns += 1
            e.cut = cut or out.finish_reasons[k] == "length"
            e.texts.append(text)
            step = as_step(e.env.step(text), source)
            e.add_reward(step.reward)
            e.tool_calls += int(step.info.get("tool_calls", 0))
            e.tool_errors += int(step.info.get("tool_errors", 0))
            e.tool_timeouts += int(step.info.get("tool_timeouts", 0))
            if step.done:
                e.done = True
                continue
            reply = (
                tokenizer(step.observation, add_special_tokens=False)["input_ids"] if step.observation else []
            )
            if cut or turn + 1 == max_turns or len(e.ids) + len(reply) >= max_episode_tokens:
                e.truncated = True  # no room for the reply and a turn after it
                continue
            e.ids += reply
            e.actions += [False] * len(reply)
            e.logprobs += [0.0] * len(reply)
            e.context += reply
            e.env_tokens += len(reply)

    _texts, prompt_ids, prompt_mask = pad_prompt_ids(tokenizer, first_contexts)
    num, width = len(episodes), max(max(len(e.ids) for e in episodes), 1)
    response_ids = torch.full((num, width), pad_id, dtype=torch.long)  # (N, T)
    response_mask = torch.zeros((num, width), dtype=torch.bool)  # (N, T)
    action_mask = torch.zeros((num, width), dtype=torch.bool)  # (N, T)
    logprobs = torch.zeros((num, width), dtype=torch.float32)  # (N, T)
    turn_rewards = torch.zeros((num, width), dtype=torch.float32)  # (N, T)
    stats = EpisodeStats()
    for j, e in enumerate(episodes):
        size = len(e.ids)
        response_ids[j, :size] = torch.tensor(e.ids, dtype=torch.long)
        response_mask[j, :size] = True
        action_mask[j, :size] = torch.tensor(e.actions, dtype=torch.bool)
        logprobs[j, :size] = torch.tensor(e.logprobs, dtype=torch.float32)
        for position, reward in e.rewards.items():
            turn_rewards[j, position] = reward
        stats.turns.append(e.turns)
        stats.tool_calls.append(e.tool_calls)
        stats.tool_errors.append(e.tool_errors)
        stats.tool_timeouts.append(e.tool_timeouts)
        stats.truncated.append(e.truncated and not e.done)
        stats.returns.append(float(turn_rewards[j].sum()))
        stats.env_tokens.append(e.env_tokens)
        stats.model_tokens.append(sum(e.actions))
        stats.turn_texts.append(list(e.texts))
    rollout = Rollout(
        prompts=[p for p in prompts for _ in range(n)],
        prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        logprobs=logprobs,
        texts=tokenizer.batch_decode([e.ids for e in episodes], skip_special_tokens=True),
        finish_reasons=["stop" if e.done and not e.cut else "length" for e in episodes],
        n=n,
        action_mask=action_mask,
        turn_rewards=turn_rewards,
    )
    return rollout, stats


class EpisodeReturn:
    """The reward of environment episodes: each episode's return, the sum of its step rewards
    (``rollout.turn_rewards``), plus ``coef ·`` ``reward(prompts, transcripts)`` when a ``reward`` is
    given (e.g. a reward model scoring the transcript on top of a verifiable environment).

    With ``rollout.environment`` set, the stage's ``reward`` must be an ``EpisodeReturn``
    (:class:`~alignlit.rollout.RolloutLoop` refuses another reward, which would ignore the environment).

    Args:
        reward: an extra reward of the transcript (any :data:`~alignlit.rollout.reward_protocol.Reward`); None: none.
        coef: its weight.
    """

    def __init__(self, reward=None, coef: float = 1.0):
        self.reward = resolve_reward(reward) if isinstance(reward, str) else reward
        self.coef = coef

    def score_rollout(self, rollout: Rollout) -> torch.Tensor:
        if rollout.turn_rewards is None:
            raise ValueError(
                "EpisodeReturn scores environment episodes (rollout.turn_rewards), but this rollout has none: "
                "set rollout.environment, or use another reward"
            )
        returns = rollout.turn_rewards.sum(-1).float()  # (N,)
        if self.reward is None:
            return returns
        extra = score_rollout(self.reward, dataclasses.replace(rollout, turn_rewards=None))
        return returns + self.coef * extra
