"""DAPO's sample-side helpers (Yu et al. 2025; algorithms.md §10): dynamic sampling and overlong shaping.

- :func:`informative_groups`: dynamic sampling keeps only groups whose ``n`` rewards are not all
  equal (with equal rewards every group-relative advantage is 0 and the group adds no gradient).
- :func:`overlong_mask`: overlong filtering, which leaves responses cut at the token limit out of
  the loss (their reward judges an unfinished answer).
- :func:`overlong_penalty`: soft overlong punishment, a length-dependent reward added to the score.
- :class:`DynamicSampling` and :class:`Overlong`: their settings, as a stage takes them from a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

from alignlit.ops.stats import check_ndim

FINISHED = "stop"
TRUNCATED = "length"


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
    """DAPO dynamic sampling (Yu et al. 2025 §3.2; algorithms.md §10): drop the groups whose ``n``
    rewards are all equal (:func:`informative_groups`, on the task reward before any KL shaping) and
    optionally refill the batch with groups of further prompts.

    Args:
        max_tries: extra sampling rounds per rollout, each on as many prompts as groups are missing,
            drawn from the DataModule's ``train_prompts`` by a seeded generator (0: only drop).
        atol: rewards closer than this count as equal.
    """

    max_tries: int = 0
    atol: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tries < 0:
            raise ValueError(f"dynamic_sampling.max_tries must be >= 0, got {self.max_tries}")
        if self.atol < 0:
            raise ValueError(f"dynamic_sampling.atol must be >= 0, got {self.atol}")


@dataclasses.dataclass(frozen=True)
class Overlong:
    """Responses cut at ``max_new_tokens`` (DAPO §3.4; algorithms.md §10).

    Args:
        mode: ``"filter"`` leaves them out of the loss (:func:`overlong_mask`; their rewards still
            enter the group baselines); ``"penalty"`` adds :func:`overlong_penalty` to every reward.
        buffer: ``L_c``, the tokens before the limit over which the penalty grows (``"penalty"``).
        penalty: the penalty at the limit (``"penalty"``).
    """

    mode: Literal["filter", "penalty"] = "filter"
    buffer: int = 4
    penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("filter", "penalty"):
            raise ValueError(f"overlong.mode must be 'filter' or 'penalty', got {self.mode!r}")
        if self.buffer < 1 or self.penalty < 0:
            raise ValueError(
                f"overlong.buffer must be >= 1 and penalty >= 0, got {self.buffer}, {self.penalty}"
            )


# checkpoints keep them in the stage's hyper-parameters
torch.serialization.add_safe_globals([DynamicSampling, Overlong])


def informative_groups(rewards: torch.Tensor, *, atol: float = 0.0) -> torch.Tensor:
    """(B,) bool, True where a group's rewards are not all equal: ``max_j r_ij - min_j r_ij > atol``.

    Args:
        rewards: (B, n) sequence rewards, prompt ``i``'s samples in row ``i``.
        atol: ``≥ 0``; rewards closer than this count as equal.

    A group of one sample (``n = 1``) is never informative.
    """
    check_ndim("rewards", rewards, 2, "(B, n)")
    if rewards.shape[1] == 0:
        raise ValueError(
            f"rewards must hold at least one sample per prompt, got shape {tuple(rewards.shape)}"
        )
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    if rewards.is_floating_point() and not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    spread = rewards.amax(dim=1) - rewards.amin(dim=1)  # (B,)
    return spread > atol


def overlong_mask(truncated: torch.Tensor | Sequence[str]) -> torch.Tensor:
    """(N,) bool, True for the samples overlong filtering keeps: those that finished before the limit.

    Args:
        truncated: (N,) bool tensor, True where the response was cut at the token limit; or the
            rollout's ``finish_reasons``, ``"stop"`` (finished) or ``"length"`` (cut).

    Multiply the response mask by ``keep[:, None]`` to leave the cut responses out of the loss.
    """
    if isinstance(truncated, torch.Tensor):
        check_ndim("truncated", truncated, 1, "(N,)")
        if truncated.dtype != torch.bool:
            raise ValueError(f"truncated must be a bool tensor, got dtype {truncated.dtype}")
        return ~truncated
    reasons = list(truncated)
    for index, reason in enumerate(reasons):
        if reason not in (FINISHED, TRUNCATED):
            raise ValueError(f"finish_reasons[{index}] is {reason!r}; expected {FINISHED!r} or {TRUNCATED!r}")
    return torch.tensor([reason == FINISHED for reason in reasons], dtype=torch.bool)


def overlong_penalty(
    lengths: torch.Tensor, *, max_length: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, §3.4), scaled by ``penalty``, to add to the reward.

    With ``L = max_length`` and ``L_c = buffer``::

        R_len(|y|) = 0                              if |y| ≤ L - L_c
                   = -penalty·(|y| - (L - L_c))/L_c  if L - L_c < |y| ≤ L
                   = -penalty                       if |y| > L

    so the penalty grows linearly from 0 to ``-penalty`` over the last ``buffer`` tokens before the
    limit (DAPO: ``penalty = 1``, ``L = 20480``, ``L_c = 4096``).

    Args:
        lengths: (N,) response lengths in tokens (integer, ≥ 0).
        max_length: ``L > 0``, the generation limit.
        buffer: ``L_c``, ``0 < L_c ≤ L``.
        penalty: ``≥ 0``, the penalty at and beyond ``L``.

    Returns:
        (N,) float penalties (default dtype), ``≤ 0``.
    """
    check_ndim("lengths", lengths, 1, "(N,)")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got minimum {int(lengths.min())}")
    if max_length <= 0:
        raise ValueError(f"max_length must be > 0, got {max_length}")
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be in (0, max_length={max_length}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    expected = max_length - buffer
    excess = (lengths - expected).clamp(min=0).to(torch.get_default_dtype())  # (N,)
    return -penalty * torch.clamp(excess / buffer, max=1.0)
