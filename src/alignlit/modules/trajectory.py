"""The :class:`Trajectory` every online stage trains on, and the :class:`Minibatches` of its update.

One online step walks one path (design.md): prompts → :class:`~alignlit.rollout.RolloutLoop` (sync,
generate, score) → :class:`~alignlit.rollout.Experience` (samples with the engine's behaviour
log-probs, the policy version that made them, their scores) → :meth:`OnlineModule.make_trajectory
<alignlit.modules.online.OnlineModule.make_trajectory>` → a :class:`Trajectory` (old and reference
log-probs, per-token KL, importance weights, loss mask) → the stage's advantages (PPO: values and
GAE; policy gradients: group advantages) or targets (online DPO: pairs; online RRHF: rankings) →
:class:`Minibatches` → the stage's loss → the optimiser. Each arrow is computed in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from alignlit.modules.micro_batches import padding_bounds


@dataclasses.dataclass
class Trajectory:
    """One rollout as the stages train on it: ``N`` samples, ``P`` prompt and ``T`` response tokens,
    the ``n`` samples of a prompt consecutive (a group).

    The response side holds every token after the prompt: the policy's own tokens and, in multi-turn
    episodes, the environment's, which are in the attention mask but not in the loss mask.

    Attributes:
        prompts: (N,) prompt strings.
        texts: (N,) decoded responses.
        finish_reasons: (N,) ``"stop"`` or ``"length"``.
        n: samples per prompt.
        group: (N,) long, the sample's prompt (group) in this rollout.
        version: (N,) long, the policy version (optimiser steps of the policy) that generated it.
        prompt_ids: (N, P) long, left-padded.
        prompt_mask: (N, P) bool.
        response_ids: (N, T) long, right-padded.
        attention_mask: (N, T) bool, every real response-side token (the context of the forward).
        action_mask: (N, T) bool, the tokens the policy sampled (log-prob, KL and length statistics).
        loss_mask: (N, T) bool, the tokens the policy loss trains on: the action tokens of the rows
            kept (e.g. without the responses cut at the length limit under overlong filtering).
        behaviour_logprobs: (N, T) ``log μ``, the engine's log-probs of the sampled tokens.
        scores: (N,) the reward's score of each sample.
        rewards: (N,) the sequence reward the stage learns from (``scores`` plus any shaping, e.g.
            DAPO's overlong penalty).
        old_logprobs: (N, T) ``log π_old`` recomputed by the trainer (None when the stage needs none).
        ref_logprobs: (N, T) ``log π_0`` of the reference (None likewise).
        kl: (N, T) the per-token KL estimate of ``kl.estimator`` between ``π_old`` and ``π_0`` on action
            tokens, 0 elsewhere (None without a ``kl`` penalty).
        is_weights: (N, T) truncated importance weights ``min(π_old/μ, C)`` (None without ``tis_cap``).
        advantages: (N,) or (N, T), set by the stage.
        values: (N, T) critic values at sampling time (PPO).
        returns: (N, T) value targets (PPO).
        token_rewards: (N, T) per-token rewards (PPO: ``-β·kl_t`` plus the sequence reward at the end).
        turn_rewards: (N, T) an environment's step rewards on the last action token of each turn
            (multi-turn episodes; part of ``scores``, whose sum over a row they make up); None otherwise.
        teacher_logprobs: (N, T) ``log π_T`` of a distillation teacher on the sampled tokens (None without one).
    """

    prompts: list[str]
    texts: list[str]
    finish_reasons: list[str]
    n: int
    group: torch.Tensor
    version: torch.Tensor
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    scores: torch.Tensor
    rewards: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def ids(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(prompt_ids, prompt_mask, response_ids, attention_mask)``: the arguments of the response
        forward functions (:func:`~alignlit.models.forward.response_token_logprobs`, ...)."""
        return self.prompt_ids, self.prompt_mask, self.response_ids, self.attention_mask

    def select(self, rows: torch.Tensor) -> Trajectory:
        """The samples ``rows`` ((m,) long) of every per-sample field (a subclass's too)."""
        picked = rows.tolist()
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                value = value[rows.to(value.device)]
            elif isinstance(value, list):
                value = [value[i] for i in picked]
            out[f.name] = value
        return type(self)(**out)

    def trimmed(self) -> Trajectory:
        """The same samples without the columns that are padding in every row (the prompt's leading ones,
        the response side's trailing ones; :func:`~alignlit.modules.micro_batches.padding_bounds`): a
        forward over fewer tokens that gives every row the same values."""
        p0, t1 = padding_bounds(self.prompt_mask, self.attention_mask)
        rows, width = self.response_ids.shape
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("prompt_ids", "prompt_mask"):
                value = value[:, p0:]
            elif torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, width):
                value = value[:, :t1]
            out[f.name] = value
        return type(self)(**out)

    def with_loss_tokens(self) -> Trajectory:
        """The samples with at least one loss token (all of them when every sample has one)."""
        keep = self.loss_mask.any(-1).nonzero().flatten()
        return self if len(keep) == len(self) else self.select(keep)


@dataclasses.dataclass(frozen=True)
class Minibatches:
    """How a stage cuts what it trains on into optimiser steps: shuffled passes of ``size`` rows.

    Args:
        size: rows per minibatch (PPO, policy gradients: samples; online DPO: pairs; online RRHF:
            prompts); the last minibatch of a pass may be smaller.
        epochs: passes over the rows (PPO's ``ppo_epochs``, online DPO's passes over the pairs).
        steps: a fixed number of minibatches instead (passes repeat as needed; online RRHF's
            ``resample_every``); None: ``epochs`` passes.
        shuffle: shuffle the rows of every pass (with the stage's own seeded generator, saved in
            checkpoints).
        token_budget: dynamic batching: the forward/backward passes of each optimiser step run over
            micro-batches of the minibatch's rows holding at most this many padded tokens (``rows ×
            longest row``, prompt and response, :func:`~alignlit.ops.token_budget_microbatches`), each cut
            to its own longest row; their gradients, each scaled by its share of the stage's loss
            aggregation (:func:`~alignlit.losses.aggregation_share`), add up to the minibatch's before the
            one optimiser step (clipping on the sum). The no-grad passes of the trajectory (old and
            reference log-probs, values, a teacher's log-probs) are split by it too. Logged:
            ``perf/microbatches`` per optimiser step, ``perf/padding_share``. Online DPO packs a step's
            pairs (2 × the longer sequence each) and online RRHF its prompts (responses × the longest),
            each micro-batch's loss weighted by its share of the pairs or prompts. None: one pass over
            the whole minibatch padded to its longest row.
    """

    size: int = 16
    epochs: int = 1
    steps: int | None = None
    shuffle: bool = True
    token_budget: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or self.epochs < 1:
            raise ValueError(f"minibatches.size and epochs must be >= 1, got {self.size}, {self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"minibatches.steps must be >= 1 or None, got {self.steps}")
        if self.token_budget is not None and (isinstance(self.token_budget, bool) or self.token_budget < 1):
            raise ValueError(
                f"minibatches.token_budget must be an int >= 1 or None, got {self.token_budget!r}"
            )
        if self.steps is not None and self.epochs != 1:
            raise ValueError(
                f"minibatches: give epochs ({self.epochs}) or steps ({self.steps}), not both: steps fixes "
                "the number of minibatches whatever the number of rows"
            )

    def plan(self, num_rows: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
        """(m,) long row indices of every minibatch, ``m <= size``, drawn with ``generator``."""
        if num_rows < 1:
            raise ValueError(f"cannot make minibatches of {num_rows} rows")

        def passes() -> Iterator[torch.Tensor]:
            while True:
                order = (
                    torch.randperm(num_rows, generator=generator) if self.shuffle else torch.arange(num_rows)
                )
                yield from order.split(self.size)

        count = self.steps if self.steps is not None else self.epochs * -(-num_rows // self.size)
        stream = passes()
        for _ in range(count):
            yield next(stream)


torch.serialization.add_safe_globals([Minibatches])
