"""Rollout corrections: importance weights for the rollout/trainer mismatch, one registry.

The engine sampled ``y_t ~ μ`` and reported ``log μ(y_t)`` (``le``, the *engine* log-probs); the trainer
recomputed ``log π_old(y_t)`` (``lo``). On long generations, MoE models and low precision the two drift
apart, and the policy-gradient loss (which assumes samples from ``π_old``) is corrected token by token
by a detached weight ``w_t`` on each token's loss. Each entry of :data:`ROLLOUT_CORRECTIONS` is a pure
function ``fn(old_logprobs, engine_logprobs, mask, **args) -> (N, T) weights`` (``(N, T)`` float
log-probs, ``(N, T)`` bool mask; weights detached, 0 on padding):

- ``"tis"`` (``cap``): token-level truncated IS, ``w_t = min(exp(lo_t - le_t), cap)``;
- ``"seq_tis"`` (``cap``): sequence-level truncated IS, ``r = exp(Σ_t m_t (lo_t - le_t))``,
  ``w_t = min(r, cap)`` on every token of the sequence;
- ``"geo_mask"`` (``cap``): a sequence mask on the geometric mean ratio
  ``g = exp(Σ_t m_t (lo_t - le_t) / Σ_t m_t)``: ``w_t = 1`` if ``1/cap <= g <= cap`` else 0;
- ``"icepop"`` (``low``, ``high``): IcePop's token mask, ``k_t = exp(lo_t - le_t)``, ``w_t = k_t`` if
  ``low <= k_t <= high`` else 0.

Sequence sums are taken in log space (``min(r, cap)`` as ``exp(min(log r, log cap))``), so a long
response's ratio never overflows. :func:`correction_metrics` gives the logged shares of tokens and
sequences masked or capped. A new correction is a function registered with
:func:`register_rollout_correction` and selected by name in a config
(``rollout_correction: {name: icepop, args: {low: 0.5, high: 5.0}}``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from alignlit.ops.stats import check_ndim, check_same_shape

RolloutCorrection = Callable[..., torch.Tensor]
ROLLOUT_CORRECTIONS: dict[str, RolloutCorrection] = {}


def register_rollout_correction(name: str) -> Callable[[RolloutCorrection], RolloutCorrection]:
    """Register ``fn(old_logprobs, engine_logprobs, mask, **args) -> (N, T) weights`` under ``name``."""

    def add(fn: RolloutCorrection) -> RolloutCorrection:
        if name in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout correction {name!r} is already registered")
        ROLLOUT_CORRECTIONS[name] = fn
        return fn

    return add


def _log_ratio(
    old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) ``lo - le`` (0 on padding) and the bool mask, after checking shapes and finiteness."""
    check_ndim("old_logprobs", old, 2, "(N, T)")
    check_same_shape(old_logprobs=old, engine_logprobs=engine, mask=mask)
    valid = mask.bool()
    for name, t in (("old_logprobs", old), ("engine_logprobs", engine)):
        bad = valid & ~torch.isfinite(t)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} must be finite on valid tokens; found {t[row, col].item()} at ({row}, {col})"
            )
    delta = torch.where(valid, old.detach().double() - engine.detach().double(), 0.0)
    return delta, valid


def _check_cap(cap: float) -> None:
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap >= 1):
        raise ValueError(f"cap must be a finite number >= 1, got {cap!r}")


def _out(weights: torch.Tensor, valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, weights, 0.0).to(like.dtype)


@register_rollout_correction("tis")
def tis(old_logprobs, engine_logprobs, mask, *, cap: float = 2.0) -> torch.Tensor:
    """Token-level truncated IS: ``w_t = min(exp(lo_t - le_t), cap)``."""
    _check_cap(cap)
    delta, valid = _log_ratio(old_logprobs, engine_logprobs, mask)
    return _out(torch.exp(delta.clamp(max=math.log(cap))), valid, old_logprobs)


@register_rollout_correction("seq_tis")
def seq_tis(old_logprobs, engine_logprobs, mask, *, cap: float = 2.0) -> torch.Tensor:
    """Sequence-level truncated IS: ``w_t = min(exp(Σ_t m_t (lo_t - le_t)), cap)`` on every token."""
    _check_cap(cap)
    delta, valid = _log_ratio(old_logprobs, engine_logprobs, mask)
    seq = torch.exp(delta.sum(-1).clamp(max=math.log(cap)))  # (N,)
    return _out(seq[:, None].expand_as(delta), valid, old_logprobs)


@register_rollout_correction("geo_mask")
def geo_mask(old_logprobs, engine_logprobs, mask, *, cap: float = 2.0) -> torch.Tensor:
    """Sequence mask: 1 where the geometric-mean ratio ``g`` of the sequence is in ``[1/cap, cap]``, else 0."""
    _check_cap(cap)
    delta, valid = _log_ratio(old_logprobs, engine_logprobs, mask)
    count = valid.sum(-1).clamp(min=1)  # (N,)
    log_g = delta.sum(-1) / count  # (N,)
    keep = (log_g >= -math.log(cap)) & (log_g <= math.log(cap))
    return _out(keep[:, None].expand_as(delta).double(), valid, old_logprobs)


@register_rollout_correction("icepop")
def icepop(old_logprobs, engine_logprobs, mask, *, low: float = 0.5, high: float = 5.0) -> torch.Tensor:
    """IcePop: ``w_t = k_t = exp(lo_t - le_t)`` where ``low <= k_t <= high``, else 0 (the token is masked)."""
    if not (0 <= low <= 1 <= high and math.isfinite(high)):
        raise ValueError(f"icepop needs 0 <= low <= 1 <= high (finite), got low={low!r}, high={high!r}")
    delta, valid = _log_ratio(old_logprobs, engine_logprobs, mask)
    k = torch.exp(delta)
    return _out(torch.where((k >= low) & (k <= high), k, 0.0), valid, old_logprobs)


def resolve_rollout_correction(name: str, args: dict | None = None) -> Callable[..., torch.Tensor]:
    """The registered correction ``name`` with ``args`` bound (checked now, on a one-token call)."""
    if name not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {name!r}; registered: {sorted(ROLLOUT_CORRECTIONS)}")
    fn, args = ROLLOUT_CORRECTIONS[name], dict(args or {})
    probe = torch.zeros(1, 1)
    try:
        fn(probe, probe, torch.ones(1, 1, dtype=torch.bool), **args)
    except TypeError as e:
        raise ValueError(f"rollout correction {name!r}: bad arguments {args} ({e})") from None

    def bound(old_logprobs, engine_logprobs, mask):
        return fn(old_logprobs, engine_logprobs, mask, **args)

    bound.name, bound.args = name, args
    return bound


@torch.no_grad()
def correction_metrics(
    weights: torch.Tensor, mask: torch.Tensor, *, cap: float | None = None
) -> dict[str, float]:
    """Shares of the valid tokens masked (weight 0) and capped (weight ``cap``), of the sequences masked
    whole, and the mean weight on valid tokens."""
    valid = mask.bool()
    n_tokens = int(valid.sum())
    if n_tokens == 0:
        return {}
    rows = valid.any(-1)
    masked = valid & (weights == 0)
    out = {
        "masked_tokens": float(masked.sum()) / n_tokens,
        "masked_seqs": float((masked.sum(-1) == valid.sum(-1))[rows].double().mean()),
        "weight_mean": float(weights[valid].double().mean()),
    }
    if cap is not None:
        out["capped_tokens"] = (
            float(
                (valid & torch.isclose(weights.double(), torch.tensor(float(cap), dtype=torch.double))).sum()
            )
            / n_tokens
        )
    return out
