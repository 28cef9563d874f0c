"""GKD's generalised Jensen-Shannon divergence between a student and a teacher over the full vocabulary
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes").

At each scored position, with the teacher's next-token distribution ``P = softmax(z_T / τ)``, the student's
``Q = softmax(z_S / τ)`` and the mixture ``M = β·P + (1 − β)·Q``::

    JSD_β(P ‖ Q) = β·KL(P ‖ M) + (1 − β)·KL(Q ‖ M)        0 < β < 1
    JSD_0(P ‖ Q) = KL(P ‖ Q)                               forward KL (the teacher's mass the student misses)
    JSD_1(P ‖ Q) = KL(Q ‖ P)                               reverse KL (mode seeking)

The end points are the limits of ``JSD_β / β`` and ``JSD_β / (1 − β)``, the convention GKD states (and TRL's
``generalized_jsd_loss`` implements). Gradients flow to the student only; the teacher is constant.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from alignlit.losses.policy_gradient import LOSS_AGGREGATIONS, _lookup

__all__ = ["generalized_jsd", "generalized_jsd_loss"]


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)`` over the last dim, 0·log 0 taken as 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float = 0.5, temperature: float = 1.0
) -> torch.Tensor:
    """(…,) ``JSD_β(P_teacher ‖ Q_student)`` at each position of (…, V) logits (see the module docstring).

    Args:
        student_logits: (…, V) the student's logits (gradients flow).
        teacher_logits: (…, V) the teacher's logits at the same positions (detached here).
        beta: ``β`` in [0, 1]: 0 the forward KL, 1 the reverse KL, 0.5 the symmetric JSD.
        temperature: ``τ > 0`` dividing both sets of logits.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ: both must be (..., V) over one vocabulary"
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_q = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)  # student
    log_p = torch.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)  # teacher
    if beta == 0.0:
        return _kl(log_p, log_q)
    if beta == 1.0:
        return _kl(log_q, log_p)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    aggregation: str | Callable[..., torch.Tensor] = "token_mean",
    max_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GKD's loss: :func:`generalized_jsd` at each scored token, reduced over ``mask``.

    Args:
        student_logits: (N, T, V) the student's logits at the positions predicting tokens ``t``.
        teacher_logits: (N, T, V) the teacher's at the same positions.
        mask: (N, T) bool, True on scored tokens.
        beta: ``β`` of :func:`generalized_jsd`.
        temperature: ``τ`` of :func:`generalized_jsd`.
        aggregation: a name in :data:`~alignlit.losses.LOSS_AGGREGATIONS` or a function
            ``fn(values, mask, *, max_length) -> scalar``; default the token mean.
        max_length: passed to the aggregation (``"seq_mean_token_sum_norm"`` needs it).

    Returns:
        ``(loss, {"jsd": token-mean JSD (detached)})``.
    """
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"mask {tuple(mask.shape)} must be the logits' (N, T) {tuple(student_logits.shape[:-1])}"
        )
    mask = mask.bool()
    if not mask.any():
        raise ValueError("mask has no scored token")
    per_token = generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature)  # (N, T)
    per_token = per_token * mask
    aggregate = _lookup(aggregation, LOSS_AGGREGATIONS, "loss aggregation", "register_aggregation")
    loss = aggregate(per_token, mask, max_length=max_length)
    return loss, {"jsd": (per_token.detach().sum() / mask.sum())}
