"""Prompts to the experience a training step learns from: the rollout side of every online stage.

A :class:`Collector` runs one training rollout through the :class:`~alignlit.rollout.RolloutLoop` (sync,
generate, score) and decides what of it to train on: the reward's scores plus DAPO's soft overlong penalty
(:meth:`Collector.task_rewards`), and with DAPO's dynamic sampling the informative groups only, refilled
from further prompts of its pool with its own seeded generator (:meth:`Collector.accept`)::

    experience, metrics = collector.collect(prompts, version=v)   # None: no informative group

It holds no reference to a LightningModule, so the asynchronous producer
(:class:`~alignlit.rollout.ahead.AheadCollector`) runs it in its own thread as it is. Its state (the refill
generator) goes into checkpoints through :meth:`Collector.state_dict`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from alignlit.ops import (
    DynamicSampling,
    Overlong,
    informative_groups,
    length_reward_correlation,
    overlong_penalty,
)
from alignlit.rollout.base import Experience, Rollout, RolloutEngine, select_groups
from alignlit.rollout.loop import RolloutLoop
from alignlit.rollout.reward_protocol import Reward


def sample_metrics(rollout: Rollout, scores: torch.Tensor) -> dict[str, float]:
    """Rewards and lengths of a rollout's samples: mean and spread of the reward, token and character
    lengths, empty and truncated responses, and with ``n >= 2`` samples per prompt the per-prompt
    reward-length correlation (:func:`~alignlit.ops.length_reward_correlation`)."""
    tokens = rollout.response_lengths.float()  # (N,)
    metrics = {
        "reward/raw": float(scores.mean()),
        "reward/std": float(scores.std(unbiased=False)),
        "response/length": float(tokens.mean()),
        "response/chars": sum(map(len, rollout.texts)) / len(rollout),
        "response/empty": float((tokens == 0).sum()),
        "response/truncated": float(sum(r == "length" for r in rollout.finish_reasons)),
    }
    if rollout.n >= 2:
        corr, used, excluded = length_reward_correlation(
            scores.view(-1, rollout.n), tokens.view(-1, rollout.n)
        )
        metrics.update({"length/corr_prompts": float(used), "length/corr_excluded": float(excluded)})
        if used:
            metrics["length/reward_corr"] = corr
    return metrics


def check_collection(
    loop: RolloutLoop, *, overlong: Overlong | None = None, dynamic_sampling: DynamicSampling | None = None
) -> None:
    """Refuse DAPO settings the loop cannot serve: dynamic sampling compares the rewards of a prompt's
    samples (``samples_per_prompt >= 2``) and its refills are not partial rollouts (``rollout.partial``); the
    overlong penalty's buffer lies within ``max_new_tokens``."""
    if dynamic_sampling is not None and loop.samples_per_prompt < 2:
        raise ValueError(
            f"dynamic_sampling compares the rewards of a prompt's samples: rollout.samples_per_prompt must be "
            f">= 2, got {loop.samples_per_prompt}"
        )
    if dynamic_sampling is not None and loop.partial is not None:
        raise ValueError(
            f"dynamic_sampling refills are generated whole, not in segments: unset rollout.partial "
            f"({loop.partial}) or dynamic_sampling"
        )
    limit = loop.sampling.max_new_tokens
    if overlong is not None and overlong.mode == "penalty" and overlong.buffer > limit:
        raise ValueError(
            f"overlong.buffer ({overlong.buffer}) must be <= rollout.sampling.max_new_tokens ({limit})"
        )


class Collector:
    """One training rollout of the prompt batch, scored and accepted (module docstring).

    Args:
        loop: the rollout loop (engine, sampling, samples per prompt, seed).
        reward: what scores the samples (:mod:`alignlit.rollout.reward_protocol`).
        pad_id: the tokenizer's pad id (kept groups of several rollouts are padded to one width).
        overlong: DAPO's filtering of, or penalty on, responses cut at the token limit (the penalty is
            applied here; the filter is the loss mask's, :class:`~alignlit.modules.trajectory_maker.TrajectoryMaker`).
        dynamic_sampling: DAPO's dynamic sampling (None: off).
    """

    def __init__(
        self,
        loop: RolloutLoop,
        reward: Reward,
        *,
        pad_id: int | None,
        overlong: Overlong | None = None,
        dynamic_sampling: DynamicSampling | None = None,
    ):
        check_collection(loop, overlong=overlong, dynamic_sampling=dynamic_sampling)
        self.loop, self.reward, self.pad_id = loop, reward, pad_id
        self.overlong, self.dynamic_sampling = overlong, dynamic_sampling
        self.refill_generator = torch.Generator().manual_seed(loop.seed)
        """Draws the refill prompts and their sampling seeds (saved in checkpoints)."""
        self.pool: list[str] | None = None
        """The prompts refills are drawn from (the training prompts; set at the start of fit)."""

    def check_world(self, world: int) -> None:
        """Refuse dynamic sampling over several ranks: each would keep a different number of groups."""
        if self.dynamic_sampling is not None and world > 1:
            raise ValueError(
                f"dynamic_sampling keeps a different number of groups on each rank, so the {world} ranks "
                "would take different numbers of optimizer steps: run it in a single process"
            )

    def task_rewards(self, rollout: Rollout, scores: torch.Tensor) -> torch.Tensor:
        """(N,) the reward's scores plus DAPO's soft overlong penalty when it is on."""
        if self.overlong is None or self.overlong.mode != "penalty":
            return scores
        penalty = overlong_penalty(
            rollout.response_lengths, max_length=self.loop.sampling.max_new_tokens,
            buffer=self.overlong.buffer, penalty=self.overlong.penalty,
        )  # fmt: skip
        return scores + penalty.to(scores.dtype)

    def collect(
        self,
        prompts: list[str],
        *,
        version: int,
        seed: int | None = None,
        engine: RolloutEngine | None = None,
    ) -> tuple[Experience | None, dict[str, float]]:
        """The training rollout of ``prompts`` from the policy at ``version``, scored and :meth:`accept`-ed:
        the loop's next one (seeded ``loop.seed + loop.rollouts``, counted), or with ``seed`` and ``engine``
        one sampled with that seed on an engine whose weights the caller manages (the asynchronous
        producer's, whose step ``j`` is seeded ``loop.seed + j``)."""
        sampling = dataclasses.replace(self.loop.sampling, seed=seed) if seed is not None else None
        experience = self.loop.collect(
            prompts, self.reward, version=version, sampling=sampling, engine=engine
        )
        return self.accept(experience, engine=engine)

    def refill_prompts(self, count: int) -> list[str]:
        """``count`` prompts drawn from :attr:`pool` with the refill generator."""
        if not self.pool:
            raise ValueError(
                "dynamic_sampling.max_tries > 0 needs a DataModule with `train_prompts` (e.g. PromptDataModule)"
            )
        picks = torch.randint(len(self.pool), (count,), generator=self.refill_generator)
        return [self.pool[i] for i in picks.tolist()]

    def accept(
        self, experience: Experience, *, engine: RolloutEngine | None = None
    ) -> tuple[Experience | None, dict[str, float]]:
        """The samples of a scored rollout to train on: all of them, or with dynamic sampling its
        informative groups, refilled from further prompts (at most ``max_tries`` rounds) and cut to the
        batch's number of groups (None when no group is informative). The metrics describe the rollout's
        samples (:func:`sample_metrics`) and its generation."""
        loop = self.loop
        rollout, n = experience.rollout, experience.rollout.n
        metrics = {**experience.metrics, **sample_metrics(rollout, experience.rewards)}
        rewards = self.task_rewards(rollout, experience.rewards)
        if self.overlong is not None and self.overlong.mode == "penalty":
            metrics["reward/overlong_penalty"] = float((rewards - experience.rewards).mean())
        ds, groups = self.dynamic_sampling, len(rollout) // n
        grouped = [rewards.view(groups, n)]  # (B, n) rewards per part
        keep = [informative_groups(grouped[0], atol=ds.atol if ds else 0.0).nonzero().flatten()]
        if n >= 2:  # the groups whose rewards differ (every other one has advantages 0)
            metrics["dynamic/informative_frac"] = len(keep[0]) / groups
        if ds is None:
            return experience, metrics
        parts = [experience]
        tries = extra = 0
        while sum(len(k) for k in keep) < groups and tries < ds.max_tries:
            seed = int(torch.randint(2**31 - 1, (1,), generator=self.refill_generator))
            more = loop.collect(
                self.refill_prompts(groups - sum(len(k) for k in keep)), self.reward,
                version=int(experience.versions[0]), sampling=dataclasses.replace(loop.sampling, seed=seed),
                engine=engine,
            )  # fmt: skip
            parts.append(more)
            grouped.append(self.task_rewards(more.rollout, more.rewards).view(-1, n))
            keep.append(informative_groups(grouped[-1], atol=ds.atol).nonzero().flatten())
            tries, extra = tries + 1, extra + len(more.rollout) // n
        room, cut = groups, []
        for k in keep:  # the first `groups` informative groups
            cut.append(k[:room])
            room -= len(cut[-1])
        metrics.update(
            {"dynamic/tries": float(tries), "dynamic/extra_prompts": float(extra)}
            | {"dynamic/groups": float(groups - room), "dynamic/full": float(room == 0)}
        )
        if room == groups:
            return None, metrics
        if tries == 0 and room == 0:  # every group informative
            return experience, metrics
        rows = [(c[:, None] * n + torch.arange(n)).flatten() for c in cut]  # (g_k * n,)
        kept = Experience(
            select_groups([p.rollout for p in parts], cut, self.pad_id),
            torch.cat([p.rewards[r] for p, r in zip(parts, rows)]),
            torch.cat([p.versions[r] for p, r in zip(parts, rows)]),
        )
        return kept, metrics

    def state_dict(self) -> dict[str, Any]:
        """The refill generator's state, for checkpoints."""
        return {"refill_generator": self.refill_generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.refill_generator.set_state(state["refill_generator"])
