"""KTO: learning from unpaired desirable / undesirable examples (Ethayarajh et al. 2024).

With the implicit reward ``r(x, y) = log π_θ(y|x) - log π_ref(y|x)`` (sequence log-probs) and the reference
point ``z_ref = max(0, KL̂)``, where ``KL̂`` is the batch mean of ``r`` on *mismatched* pairs (each prompt
with another example's completion), detached::

    desirable:   λ_D · (1 - σ(β (r - z_ref)))
    undesirable: λ_U · (1 - σ(β (z_ref - r)))

and the loss is the mean over the batch of these per-example terms.
"""

from __future__ import annotations

import torch


def kto_reference_point(policy_mismatched: torch.Tensor, reference_mismatched: torch.Tensor) -> torch.Tensor:
    """``z_ref = max(0, mean_i(log π_θ(y_j|x_i) - log π_ref(y_j|x_i)))`` over mismatched pairs, detached."""
    if policy_mismatched.shape != reference_mismatched.shape or policy_mismatched.dim() != 1:
        raise ValueError(
            f"mismatched log-probs must be two (B,) tensors, got {tuple(policy_mismatched.shape)} and "
            f"{tuple(reference_mismatched.shape)}"
        )
    return (policy_mismatched - reference_mismatched).mean().detach().clamp(min=0)


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KTO loss of a batch (see the module docstring) and detached metrics.

    Args:
        policy_logps: (B,) ``log π_θ(y|x)`` of each example's completion.
        reference_logps: (B,) ``log π_ref(y|x)``.
        desirable: (B,) bool, the example's label.
        reference_point: scalar ``z_ref`` (:func:`kto_reference_point`).
        beta: ``β > 0``.
        desirable_weight, undesirable_weight: ``λ_D, λ_U >= 0`` (the paper balances them so that
            ``λ_D n_D / (λ_U n_U)`` lies in ``[1, 4/3]``).

    Returns:
        ``(loss, metrics)``: ``loss``, ``kl`` (``z_ref``), ``rewards/chosen`` and ``rewards/rejected`` (mean
        ``β r`` of the desirable / undesirable examples, absent when the batch has none),
        ``rewards/margin``, ``desirable_frac``.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"desirable/undesirable weights must be >= 0, got {desirable_weight}, {undesirable_weight}"
        )
    if desirable.dtype != torch.bool or desirable.shape != policy_logps.shape:
        raise ValueError("desirable must be a (B,) bool tensor matching the log-probs")
    r = policy_logps - reference_logps  # (B,)
    z = reference_point.to(r.dtype)
    loss_d = desirable_weight * (1 - torch.sigmoid(beta * (r - z)))
    loss_u = undesirable_weight * (1 - torch.sigmoid(beta * (z - r)))
    loss = torch.where(desirable, loss_d, loss_u).mean()
    rewards = (beta * r).detach()
    metrics = {"loss": loss.detach(), "kl": z.detach(), "desirable_frac": desirable.float().mean()}
    if desirable.any():
        metrics["rewards/chosen"] = rewards[desirable].mean()
    if (~desirable).any():
        metrics["rewards/rejected"] = rewards[~desirable].mean()
    if desirable.any() and (~desirable).any():
        metrics["rewards/margin"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss, metrics
