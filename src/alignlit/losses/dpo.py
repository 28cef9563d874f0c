"""DPO-family losses on per-sequence log-probs (algorithms.md §5).

All log-probs are sums over response tokens, shape (B,). With
``h = β[(log π_θ(y_w|x) - log π_0(y_w|x)) - (log π_θ(y_l|x) - log π_0(y_l|x))]``, the implicit rewards
are ``β(log π_θ(y|x) - log π_0(y|x))`` for the chosen and the rejected response.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignlit.ops.stats import check_ndim, check_same_shape


def _check_beta(beta: float) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def implicit_rewards(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards ``(β(log π_θ(y_w|x) - log π_0(y_w|x)), β(log π_θ(y_l|x) - log π_0(y_l|x)))``,
    each (B,), after validating that the four (B,) inputs have one shape; their difference is ``h``."""
    check_ndim("policy_chosen_logps", policy_chosen_logps, 1, "(B,)")
    check_same_shape(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    return chosen_rewards, rejected_rewards


def reward_metrics(
    loss: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The metrics every preference loss reports, detached: ``loss``; ``rewards/chosen`` and
    ``rewards/rejected`` (mean rewards, (B,) inputs); ``rewards/accuracy`` (fraction of pairs whose
    chosen reward is higher); ``rewards/margin`` (mean difference); ``logps/chosen`` and
    ``logps/rejected`` (mean policy sequence log-probs, (B,) inputs)."""
    chosen_rewards = chosen_rewards.detach()
    rejected_rewards = rejected_rewards.detach()
    margins = chosen_rewards - rejected_rewards  # (B,); DPO's h
    return {
        "loss": loss.detach(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracy": (margins > 0).to(margins.dtype).mean(),
        "rewards/margin": margins.mean(),
        "logps/chosen": policy_chosen_logps.detach().mean(),
        "logps/rejected": policy_rejected_logps.detach().mean(),
    }


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO ``-log σ(h)`` (ChatGLM-RLHF eq. 7), or conservative DPO ``-(1-ε)·log σ(h) - ε·log σ(-h)``.

    Args:
        policy_chosen_logps, policy_rejected_logps: (B,) ``log π_θ(y_w|x)``, ``log π_θ(y_l|x)``.
        ref_chosen_logps, ref_rejected_logps: (B,) the same under the reference ``π_0``.
        beta: ``β > 0``.
        label_smoothing: ``ε ∈ [0, 0.5]``, the assumed probability that a preference label is flipped.

    Returns:
        ``(loss, metrics)``: loss averaged over the batch; metrics ``loss``, ``rewards/chosen``,
        ``rewards/rejected`` (mean implicit rewards), ``rewards/accuracy`` (fraction with ``h > 0``),
        ``rewards/margin`` (mean ``h``), ``logps/chosen``, ``logps/rejected`` (mean policy log-probs).
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    chosen_rewards, rejected_rewards = implicit_rewards(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta
    )
    logits = chosen_rewards - rejected_rewards  # h, (B,)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    loss = losses.mean()
    return loss, reward_metrics(
        loss, chosen_rewards, rejected_rewards, policy_chosen_logps, policy_rejected_logps
    )


def ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IPO ``(h/β - 1/(2β))²`` (Azar et al. 2023, eq. 17 with ``τ = β``), averaged over the batch.

    ``h/β`` is the difference of the two policy/reference log-ratios, regressed onto ``1/(2β)``.
    Arguments and metrics as in :func:`dpo_loss`.
    """
    _check_beta(beta)
    chosen_rewards, rejected_rewards = implicit_rewards(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta
    )
    logits = chosen_rewards - rejected_rewards  # h, (B,)
    loss = ((logits / beta - 1.0 / (2.0 * beta)) ** 2).mean()
    return loss, reward_metrics(
        loss, chosen_rewards, rejected_rewards, policy_chosen_logps, policy_rejected_logps
    )


def rpo_sft_term(
    chosen_nll_sum: torch.Tensor, chosen_lengths: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Length-normalised NLL of the chosen responses, ``mean_b NLL(y_w)/|y_w|`` (RPO SFT term).

    The caller weights it by ``α`` and adds it to the DPO/IPO loss.

    Args:
        chosen_nll_sum: (B,) ``-log π_θ(y_w|x)`` summed over response tokens.
        chosen_lengths: (B,) ``|y_w|``, number of response tokens, all > 0.

    Returns:
        ``(loss, {"sft_loss": loss})``.
    """
    check_ndim("chosen_nll_sum", chosen_nll_sum, 1, "(B,)")
    check_same_shape(chosen_nll_sum=chosen_nll_sum, chosen_lengths=chosen_lengths)
    if (chosen_lengths <= 0).any():
        bad = torch.nonzero(chosen_lengths <= 0).flatten().tolist()
        raise ValueError(f"chosen_lengths must be > 0, got non-positive lengths at batch indices {bad}")
    loss = (chosen_nll_sum / chosen_lengths.to(chosen_nll_sum.dtype)).mean()
    return loss, {"sft_loss": loss.detach()}
