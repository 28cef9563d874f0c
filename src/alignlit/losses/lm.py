"""Masked next-token negative log-likelihood (SFT, PPO-ptx, RM LM-imitation, RPO)."""

from __future__ import annotations

from typing import Literal

import torch

from alignlit.ops.logprobs import gather_logprobs
from alignlit.ops.stats import check_ndim, check_same_shape, masked_mean, masked_sum

Reduction = Literal["token_mean", "sequence_sum", "sequence_mean"]
_REDUCTIONS = ("token_mean", "sequence_sum", "sequence_mean")


def shift_for_next_token(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align causal-LM outputs with their targets: position ``t`` predicts token ``t + 1``.

    Args:
        logits: (B, T, V) model outputs.
        input_ids: (B, T) token ids fed to the model.
        loss_mask: (B, T) 1 on the tokens to be predicted (e.g. response tokens).

    Returns:
        ``(logits[:, :-1], input_ids[:, 1:], loss_mask[:, 1:])`` of shapes (B, T-1, V), (B, T-1), (B, T-1).
    """
    check_ndim("logits", logits, 3, "(B, T, V)")
    check_same_shape(**{"logits.shape[:-1]": logits[..., 0], "input_ids": input_ids, "loss_mask": loss_mask})
    return logits[:, :-1], input_ids[:, 1:], loss_mask[:, 1:]


def masked_nll(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    reduction: Reduction = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of ``labels`` under ``logits`` over the valid (mask 1) tokens.

    Args:
        logits: (B, T, V), already aligned with ``labels`` (see :func:`shift_for_next_token`).
        labels: (B, T) target ids; values at masked positions are ignored (``-100`` is fine there).
        mask: (B, T) 1 on tokens that count.
        reduction: ``"token_mean"`` (mean over all valid tokens of the batch), ``"sequence_sum"``
            (sum per sequence, then mean over sequences) or ``"sequence_mean"`` (mean per sequence,
            then mean over sequences; every sequence needs a valid token).

    Returns:
        ``(loss, metrics)`` with metrics ``nll`` (token-mean NLL), ``ppl`` (``exp(nll)``) and
        ``tokens`` (number of valid tokens), whatever the reduction.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {list(_REDUCTIONS)}")
    check_ndim("logits", logits, 3, "(B, T, V)")
    check_same_shape(**{"logits.shape[:-1]": logits[..., 0], "labels": labels, "mask": mask})
    valid = mask.bool()
    safe_labels = labels.masked_fill(~valid, 0)  # ids at masked positions are never used
    token_nll = -gather_logprobs(logits, safe_labels)  # (B, T)
    token_mean = masked_mean(token_nll, valid)
    if reduction == "token_mean":
        loss = token_mean
    elif reduction == "sequence_sum":
        loss = masked_sum(token_nll, valid, dim=-1).mean()
    else:
        loss = masked_mean(token_nll, valid, dim=-1).mean()
    nll = token_mean.detach()
    metrics = {"nll": nll, "ppl": torch.exp(nll), "tokens": valid.sum().detach()}
    return loss, metrics
