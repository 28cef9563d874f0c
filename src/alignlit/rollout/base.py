"""The rollout contract every engine implements.

A :class:`Rollout` is what one ``generate`` call returns: ``N = len(prompts) * n`` samples, prompt
``i`` repeated ``n`` times consecutively (``prompt_index[j] == j // n``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@dataclass
class SamplingParams:
    """How responses are sampled.

    Args:
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass (1.0 disables it).
        top_k: keep the k most likely tokens (0 disables it).
        max_new_tokens: hard limit on response tokens; a response cut here has finish reason ``"length"``.
        stop: strings that end a response (e.g. ``"\\n\\nHuman:"``); the stop string is not part of the response.
        seed: seed for this call's sampling (None: the engine's own generator state).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Rollout:
    """Sampled responses, right-padded, with the engine's log-probs.

    Shapes use ``N`` samples, ``P`` prompt tokens (left-padded), ``T`` response tokens (right-padded).

    Attributes:
        prompts: (N,) prompt strings, each repeated ``n`` times.
        prompt_index: (N,) long, index of the prompt in the ``generate`` call.
        prompt_ids: (N, P) long, left-padded prompt token ids.
        prompt_mask: (N, P) bool, True on real prompt tokens.
        response_ids: (N, T) long, right-padded response token ids (EOS included when produced).
        response_mask: (N, T) bool, True on real response tokens.
        logprobs: (N, T) float, log-prob of each sampled token under ``log_softmax(logits / temperature)``
            (no top-k/top-p truncation); 0 on padding.
        texts: (N,) decoded responses (special tokens and stop strings removed).
        finish_reasons: (N,) ``"stop"`` (EOS or a stop string) or ``"length"``.
        n: samples per prompt.
        action_mask: (N, T) bool, True on the tokens the engine sampled, for episodes whose response side
            also holds environment tokens (:mod:`alignlit.rollout.episodes`); None: every response token.
        turn_rewards: (N, T) float, each environment step's reward on the last sampled token of the turn
            it answered, 0 elsewhere (episodes only; None otherwise).
        token_versions: (N, T) long, the policy version each response token was sampled under, 0 on padding
            (partial rollouts, ``rollout.partial``: :mod:`alignlit.rollout.partial`; None otherwise: every
            token of a sample comes from its :attr:`Experience.versions`).
    """

    prompts: list[str]
    prompt_index: torch.Tensor
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    texts: list[str]
    finish_reasons: list[str]
    n: int
    action_mask: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def response_lengths(self) -> torch.Tensor:
        """(N,) number of real response tokens."""
        return self.response_mask.sum(-1)


@dataclass
class Experience:
    """A scored rollout: what the rollout side hands to the online base.

    Attributes:
        rollout: ``N = B * n`` samples (prompt ``i`` repeated ``n`` times consecutively), see
            :class:`~alignlit.rollout.base.Rollout`.
        rewards: (N,) float32, the reward function's score of each sample.
        versions: (N,) long, the policy version that generated each sample (with partial rollouts the
            version of its first segment, the oldest of its tokens' :attr:`Rollout.token_versions`).
        metrics: how it was made: the generation's timings and throughput, the engine sync, the episodes'
            and the reward's counters (:meth:`~alignlit.rollout.RolloutLoop.collect`).
    """

    rollout: Rollout
    rewards: torch.Tensor
    versions: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.versions is None:
            self.versions = torch.zeros(len(self.rollout), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rollout)


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses from the current policy.

    ``sync(policy)`` loads the policy's current weights into the engine (a no-op for engines that
    generate with the training model itself); ``generate`` samples ``n`` responses per prompt.
    """

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> Rollout: ...

    def sync(self, policy: torch.nn.Module) -> None: ...


def select_groups(rollouts: list[Rollout], groups: list[torch.Tensor], pad_id: int) -> Rollout:
    """The groups ``groups[k]`` ((g_k,) prompt indices) of ``rollouts[k]``, concatenated into one
    rollout (prompts re-padded on the left, responses on the right, to the widest of ``rollouts``;
    :func:`~alignlit.rollout.served.take_prompts` takes prompts of one rollout and trims its padding)."""
    n = rollouts[0].n
    rows = [(g[:, None] * n + torch.arange(n)).flatten() for g in groups]  # (g_k * n,)
    width_p = max(r.prompt_ids.shape[1] for r in rollouts)
    width_t = max(r.response_ids.shape[1] for r in rollouts)

    def cat(name: str, width: int, value, left: bool) -> torch.Tensor:
        parts = [getattr(r, name)[i] for r, i in zip(rollouts, rows)]
        return torch.cat(
            [
                F.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)
                for t in parts
            ]
        )

    listed = {
        k: [x for r, i in zip(rollouts, rows) for x in (getattr(r, k)[j] for j in i.tolist())]
        for k in ("prompts", "texts", "finish_reasons")
    }
    return Rollout(
        **listed,
        prompt_index=torch.arange(sum(len(i) for i in rows)) // n,
        prompt_ids=cat("prompt_ids", width_p, pad_id, True),  # (N, P)
        prompt_mask=cat("prompt_mask", width_p, False, True),
        response_ids=cat("response_ids", width_t, pad_id, False),  # (N, T)
        response_mask=cat("response_mask", width_t, False, False),
        logprobs=cat("logprobs", width_t, 0.0, False),
        n=n,
        action_mask=cat("action_mask", width_t, False, False)
        if rollouts[0].action_mask is not None
        else None,
        turn_rewards=cat("turn_rewards", width_t, 0.0, False)
        if rollouts[0].turn_rewards is not None
        else None,
        token_versions=cat("token_versions", width_t, 0, False)
        if rollouts[0].token_versions is not None
        else None,
    )
