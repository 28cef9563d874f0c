"""Critic-free policy-gradient loss: loss aggregations and the loss itself (algorithms.md §10, §13).

Tensors are (N, T) over response tokens; ``mask`` is 1 on response tokens and 0 on padding. How the
token losses are reduced to a scalar is a registry of small pure functions keyed by the name a config
uses (:data:`LOSS_AGGREGATIONS`, :func:`register_aggregation`); the per-token policy term is the other
(:data:`~alignlit.losses.policy_losses.POLICY_LOSSES`). :func:`policy_gradient_loss` combines them
with the importance weights and the optional KL and entropy terms.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from alignlit.losses.policy_losses import POLICY_LOSSES, PolicyLoss
from alignlit.ops.kl import KLKind, kl_estimate
from alignlit.ops.stats import check_ndim, check_same_shape, masked_mean, masked_sum

LossAggregation = Callable[..., torch.Tensor]
"""``fn(values (N, T), mask (N, T) bool, *, max_length: int | None) -> scalar``; padding values are 0."""

LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}
"""Token-loss reductions by name (the value of ``aggregation`` in :func:`policy_gradient_loss`)."""


AGGREGATION_UNITS: dict[str, str] = {}
"""What each aggregation averages over: ``"tokens"`` (loss tokens), ``"sequences"`` (rows with a loss
token) or ``"rows"`` (every row): how a minibatch split into micro-batches shares its loss
(:func:`aggregation_share`)."""


def register_aggregation(name: str, unit: str | None = None) -> Callable[[LossAggregation], LossAggregation]:
    """Decorator adding ``fn(values, mask, *, max_length) -> scalar`` to :data:`LOSS_AGGREGATIONS`.

    ``unit``: what it averages over (``"tokens"``, ``"sequences"`` or ``"rows"``), needed to split its
    minibatches by a token budget (:func:`aggregation_share`). Raises ``ValueError`` when ``name`` is
    already registered or the unit is unknown.
    """
    if unit is not None and unit not in ("tokens", "sequences", "rows"):
        raise ValueError(f"aggregation unit must be 'tokens', 'sequences' or 'rows', got {unit!r}")

    def decorate(fn: LossAggregation) -> LossAggregation:
        if name in LOSS_AGGREGATIONS:
            raise ValueError(f"loss aggregation {name!r} is already registered")
        LOSS_AGGREGATIONS[name] = fn
        if unit is not None:
            AGGREGATION_UNITS[name] = unit
        return fn

    return decorate


def _nonempty_rows(mask: torch.Tensor) -> torch.Tensor:
    """(N,) bool, True for sequences with at least one valid token; raises when there is none."""
    rows = mask.any(dim=1)  # (N,)
    if not rows.any():
        raise ValueError("mask has no valid token; cannot average over sequences")
    return rows


@register_aggregation("token_mean", unit="tokens")
def token_mean(values: torch.Tensor, mask: torch.Tensor, *, max_length: int | None) -> torch.Tensor:
    """``Σ_{i,t} m_it·l_it / Σ_{i,t} m_it``: every valid token of the batch weighs the same (DAPO)."""
    return masked_mean(values, mask)


@register_aggregation("seq_mean_token_mean", unit="sequences")
def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, *, max_length: int | None) -> torch.Tensor:
    """``mean_i (Σ_t m_it·l_it / Σ_t m_it)``: every sequence weighs the same (GRPO).

    The mean runs over the sequences with at least one valid token.
    """
    rows = _nonempty_rows(mask)
    per_sequence = masked_sum(values, mask, dim=1)[rows] / mask[rows].sum(dim=1)  # (N',)
    return per_sequence.mean()


@register_aggregation("seq_mean_token_sum", unit="sequences")
def seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor, *, max_length: int | None) -> torch.Tensor:
    """``mean_i Σ_t m_it·l_it``: mean over sequences (with at least one valid token) of their token sum."""
    rows = _nonempty_rows(mask)
    return masked_sum(values, mask, dim=1)[rows].mean()


@register_aggregation("seq_mean_token_sum_norm", unit="rows")
def seq_mean_token_sum_norm(
    values: torch.Tensor, mask: torch.Tensor, *, max_length: int | None
) -> torch.Tensor:
    """``Σ_{i,t} m_it·l_it / (N·L_max)`` (Dr. GRPO, Liu et al. 2025): a constant denominator, no length bias.

    ``N`` counts every row, ``L_max`` is ``max_length`` (the generation limit), so neither depends on
    the sampled lengths.
    """
    if max_length is None:
        raise ValueError(
            "aggregation 'seq_mean_token_sum_norm' needs max_length (the generation limit L_max)"
        )
    longest = int(mask.sum(dim=1).max()) if mask.numel() else 0
    if max_length < max(longest, 1):
        raise ValueError(
            f"max_length must be >= 1 and >= the longest response ({longest} valid tokens), got {max_length}"
        )
    return masked_sum(values, mask) / (mask.shape[0] * max_length)


def aggregation_share(
    aggregation: str | LossAggregation, micro_mask: torch.Tensor, full_mask: torch.Tensor
) -> float:
    """The weight ``w_k`` of a micro-batch's aggregated loss, so that ``Σ_k w_k · aggregate(values_k, mask_k)``
    over micro-batches that partition a minibatch's rows equals ``aggregate(values, mask)`` of the whole.

    The share of the aggregation's unit (:data:`AGGREGATION_UNITS`) the micro-batch holds: its loss tokens
    (``"token_mean"``), its rows with a loss token (``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``) or
    its rows (``"seq_mean_token_sum_norm"``, whose ``N · L_max`` counts every row). 0 for a micro-batch
    without a loss token: it adds nothing (skip it).

    Args:
        aggregation: a name in :data:`LOSS_AGGREGATIONS` or a function registered with a ``unit``.
        micro_mask: (n, T) bool loss mask of the micro-batch.
        full_mask: (N, T) bool loss mask of the whole minibatch.
    """
    name = aggregation if isinstance(aggregation, str) else next(
        (k for k, fn in LOSS_AGGREGATIONS.items() if fn is aggregation), getattr(aggregation, "__name__", "?")
    )  # fmt: skip
    unit = AGGREGATION_UNITS.get(name)
    if unit is None:
        raise ValueError(
            f"loss aggregation {name!r} has no unit: register it with register_aggregation(name, unit=...) "
            "('tokens', 'sequences' or 'rows') to split its minibatches by a token budget"
        )
    micro, full = micro_mask.bool(), full_mask.bool()
    if not micro.any():  # nothing to add (under "rows" its rows still count in the others' denominator)
        return 0.0
    if unit == "rows":
        return micro.shape[0] / full.shape[0]
    if unit == "tokens":
        return float(micro.sum()) / max(float(full.sum()), 1.0)
    return float(micro.any(-1).sum()) / max(float(full.any(-1).sum()), 1.0)


def _lookup(value: str | Callable, registry: dict[str, Callable], what: str, register_with: str) -> Callable:
    """The function ``value`` names in ``registry`` (or ``value`` itself when it is one)."""
    if callable(value):
        return value
    if value in registry:
        return registry[value]
    close = difflib.get_close_matches(value, list(registry), n=1) if isinstance(value, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown {what} {value!r}; expected one of {sorted(registry)}{hint} "
        f"(or register one with alignlit.losses.{register_with})"
    )


def _check_options(name: str, fn: PolicyLoss, options: Mapping[str, Any]) -> None:
    """``ValueError`` for a key of ``policy_loss_args`` that the policy loss does not take."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: let the call decide
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = sorted(
        p
        for p, spec in parameters.items()
        if spec.kind is spec.KEYWORD_ONLY and p not in ("clip_low", "clip_high")
    )
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"policy_loss_args: policy loss {name!r} has no option {unknown[0]!r}; it takes {accepted}"
        )


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_finite_on(name: str, tensor: torch.Tensor, valid: torch.Tensor) -> None:
    bad = valid & ~torch.isfinite(tensor)
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must be finite on valid tokens; found {tensor[row, col].item()} at ({row}, {col})"
        )


def policy_gradient_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: str | LossAggregation,
    policy_loss: str | PolicyLoss = "ppo_clip",
    policy_loss_args: Mapping[str, Any] | None = None,
    max_length: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLKind = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A policy loss (clipped surrogate by default), plus optional KL-to-reference and entropy terms.

    Per valid token, with ``ρ_t = exp(log π_θ - log π_old)``::

        l_t = w_t·pg_t                                                    (policy term)
              + c_KL·k(log π_θ, log π_0)_t                                 (GRPO's KL term, optional)
              - c_H·H_t                                                   (entropy bonus, optional)

    where ``pg_t`` is the ``policy_loss`` entry's token loss (algorithms.md §13); the default
    ``"ppo_clip"`` is ``pg_t = -min(ρ_t·A_t, clip(ρ_t, 1 - ε_low, 1 + ε_high)·A_t)`` (PPO, DAPO
    clip-higher). The loss is ``aggregation(l)``; aggregations are linear, so it equals
    ``agg(w·pg) + c_KL·agg(k) - c_H·agg(H)``. ``w_t`` are the importance weights (1 when
    ``is_weights`` is None); they multiply the policy term only (algorithms.md §11). ``old_logprobs``,
    ``advantages``, ``ref_logprobs`` and ``is_weights`` are constants (detached here); the gradient
    flows through ``logprobs`` and ``entropy``.

    Args:
        logprobs: (N, T) ``log π_θ`` of the sampled tokens (with gradient).
        old_logprobs: (N, T) ``log π_old`` at sampling time.
        advantages: (N,) one advantage per sequence, broadcast over its tokens, or (N, T) per token.
        mask: (N, T) 1 on response tokens.
        clip_low: ``ε_low ∈ (0, 1]``, the ratio's lower bound is ``1 - ε_low``.
        clip_high: ``ε_high > 0``, the ratio's upper bound is ``1 + ε_high`` (DAPO: ``ε_high > ε_low``).
        aggregation: a name in :data:`LOSS_AGGREGATIONS` (``"token_mean"``, ``"seq_mean_token_mean"``,
            ``"seq_mean_token_sum"``, ``"seq_mean_token_sum_norm"``, or one registered with
            :func:`register_aggregation`), or such a function.
        policy_loss: the per-token policy term, a name in :data:`POLICY_LOSSES` (``"ppo_clip"``,
            ``"dual_clip"``, ``"gspo"``, ``"cispo"``, or one registered with :func:`register_policy_loss`),
            or such a function.
        policy_loss_args: the policy loss's own options, e.g. ``{"clip_ratio_c": 3.0}`` for
            ``"dual_clip"``; a key it does not take raises ``ValueError``.
        max_length: ``L_max`` for ``"seq_mean_token_sum_norm"`` (the generation limit); passed to
            every aggregation, which may ignore it.
        ref_logprobs: (N, T) ``log π_0`` of the reference; needed when ``kl_coef > 0``.
        kl_coef: ``c_KL ≥ 0``.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (GRPO uses k3), see :mod:`alignlit.ops.kl`.
        entropy: (N, T) per-token entropies ``H_t`` of ``π_θ`` (with gradient); needed when
            ``entropy_coef > 0``.
        entropy_coef: ``c_H ≥ 0``.
        is_weights: (N, T) non-negative per-token importance weights, e.g.
            :func:`alignlit.ops.truncated_is_weights`.

    Returns:
        ``(loss, metrics)``; every metric is detached and, except ``pg_loss``, a mean over all valid
        tokens whatever the aggregation: ``pg_loss`` (the aggregated policy term, weights included);
        the policy loss's metrics, among them ``clip_frac_high`` and ``clip_frac_low`` (for
        ``"ppo_clip"``: the tokens with ``A_t > 0`` and ``ρ_t > 1 + ε_high``, and those with ``A_t < 0``
        and ``ρ_t < 1 - ε_low``, exactly where the clipped term is the smaller one, so the token gives no
        policy gradient); ``ratio_mean``, ``ratio_max`` of the token ratios ``ρ_t``; ``approx_kl``, the
        mean of ``½(log π_θ - log π_old)²`` (k2 estimate of ``KL(π_old ‖ π_θ)``); ``kl`` (the chosen estimator) when ``ref_logprobs`` is given;
        ``entropy`` when ``entropy`` is given; ``is_weight_mean`` when ``is_weights`` is given.
    """
    check_ndim("logprobs", logprobs, 2, "(N, T)")
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    optional = {"ref_logprobs": ref_logprobs, "entropy": entropy, "is_weights": is_weights}
    check_same_shape(logprobs=logprobs, **{name: t for name, t in optional.items() if t is not None})
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)} but logprobs has {logprobs.shape[0]} rows; "
                "advantages must be (N,) or (N, T)"
            )
        advantages = advantages[:, None].expand_as(logprobs)  # (N, T)
    else:
        check_same_shape(logprobs=logprobs, advantages=advantages)
    if not 0 < clip_low <= 1:
        raise ValueError(f"clip_low must be in (0, 1], got {clip_low}")
    _check_positive("clip_high", clip_high)
    _check_nonnegative("kl_coef", kl_coef)
    _check_nonnegative("entropy_coef", entropy_coef)
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logprobs")
    if entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} > 0 needs entropy")
    aggregate = _lookup(aggregation, LOSS_AGGREGATIONS, "loss aggregation", "register_aggregation")
    policy_term = _lookup(policy_loss, POLICY_LOSSES, "policy loss", "register_policy_loss")
    options = dict(policy_loss_args or {})
    _check_options(policy_loss if isinstance(policy_loss, str) else repr(policy_term), policy_term, options)

    valid = mask.bool()  # (N, T)
    if not valid.any():
        raise ValueError("mask has no valid token; the policy-gradient loss is undefined on an empty batch")

    def on_valid(x: torch.Tensor) -> torch.Tensor:
        """``x`` at valid tokens, 0 at padding: nothing at padding (even NaN) reaches loss or gradient."""
        return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))

    _check_finite_on("advantages", advantages, valid)
    advantages = on_valid(advantages.detach())
    logprobs_valid = on_valid(logprobs)  # (N, T), 0 at padding
    old_valid = on_valid(old_logprobs.detach())  # (N, T)
    pg_tokens, policy_metrics = policy_term(
        logprobs_valid, old_valid, advantages, valid, clip_low=clip_low, clip_high=clip_high, **options
    )  # (N, T)
    if pg_tokens.shape != logprobs.shape:
        raise ValueError(
            f"policy loss {policy_loss!r} returned token losses of shape {tuple(pg_tokens.shape)}, "
            f"expected {tuple(logprobs.shape)}"
        )
    if is_weights is not None:
        _check_finite_on("is_weights", is_weights, valid)
        is_weights = on_valid(is_weights.detach())
        if (is_weights < 0).any():
            raise ValueError("is_weights must be >= 0 on valid tokens")
        pg_tokens = pg_tokens * is_weights
    pg_loss = aggregate(pg_tokens, valid, max_length=max_length)
    loss = pg_loss
    metrics: dict[str, torch.Tensor] = {}
    if ref_logprobs is not None:
        kl_tokens = kl_estimate(logprobs_valid, on_valid(ref_logprobs.detach()), kl_estimator)  # (N, T)
        if kl_coef > 0:
            loss = loss + kl_coef * aggregate(kl_tokens, valid, max_length=max_length)
        metrics["kl"] = masked_mean(kl_tokens.detach(), valid)
    if entropy is not None:
        entropy_tokens = on_valid(entropy)  # (N, T)
        if entropy_coef > 0:
            loss = loss - entropy_coef * aggregate(entropy_tokens, valid, max_length=max_length)
        metrics["entropy"] = masked_mean(entropy_tokens.detach(), valid)
    with torch.no_grad():
        log_ratio = logprobs_valid - old_valid  # (N, T), 0 at padding
        ratio = torch.exp(log_ratio)
        metrics["pg_loss"] = pg_loss.detach()
        metrics.update({name: value.detach() for name, value in policy_metrics.items()})
        metrics.update(
            ratio_mean=masked_mean(ratio, valid),
            ratio_max=ratio[valid].max(),
            approx_kl=masked_mean(0.5 * log_ratio**2, valid),
        )
        if is_weights is not None:
            metrics["is_weight_mean"] = masked_mean(is_weights, valid)
    return loss, metrics
