"""Log-probs (and entropies) of scored tokens, from full logits or from hidden states through a fused head.

:func:`logits_scored` reads them from a model's full ``(N, L, V)`` logits (the fallback);
:func:`fused_scored` from the final hidden states of the positions that predict the scored
tokens only, with the LM head fused into the log-softmax
(:func:`~alignlit.ops.logprobs.linear_logprobs`), so no ``(N, T, V)`` logits exist. Both return
``(logprobs, entropy)`` of the same shape as the labels, 0 off the mask.
"""

from __future__ import annotations

import torch

from alignlit.models.dispatch import ForwardPlan
from alignlit.models.packing import HiddenStates
from alignlit.ops.logprobs import entropy_from_logits, gather_logprobs, linear_logprobs


def check_temperature(temperature: float) -> float:
    """``temperature`` as scored: 0 (greedy) scores as 1, the convention of :class:`~alignlit.rollout.base.Rollout`."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def logits_scored(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` under ``log_softmax(logits / temperature)`` (and entropies), masked.

    ``logits`` (N, L, V) are already aligned with ``labels`` (N, L); ``mask`` (N, L) bool.
    Returns ``(logprobs, entropy)``, (N, L) each (entropy None unless ``with_entropy``).
    """
    if temperature not in (0.0, 1.0):  # 0 (greedy) scores as T = 1, the Rollout convention
        logits = logits / float(temperature)
    weights = mask.to(torch.promote_types(logits.dtype, torch.float32))
    logprobs = gather_logprobs(logits, labels.masked_fill(~mask, 0)) * weights  # (N, L)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach()) * weights  # (N, L)
    return logprobs, entropy


def fused_scored(
    plan: ForwardPlan,
    states: HiddenStates,
    predictor: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (N, S) at the ``mask``-ed positions (N, S), read from the hidden state
    at input column ``predictor`` (N, S) through the fused head of ``plan``.

    Returns ``(logprobs, entropy)``, (N, S) each (entropy None unless ``with_entropy``).
    """
    head, options = plan.head, plan.head_options
    rows, cols = mask.nonzero(as_tuple=True)  # (M,) each, row-major like masked_scatter
    flat = states.columns[rows, predictor[rows, cols]]  # (M,)
    logprobs, entropy = linear_logprobs(
        states.hidden[flat],
        head.weight,
        labels[rows, cols],
        bias=getattr(head, "bias", None),
        temperature=temperature,
        logit_scale=options["logit_scale"],
        softcap=options["softcap"],
        with_entropy=with_entropy,
        check_labels=False,  # input token ids: the embedding lookup has checked them
    )  # (M,)
    out = torch.zeros(mask.shape, dtype=logprobs.dtype, device=logprobs.device).masked_scatter(mask, logprobs)
    if entropy is not None:
        entropy = entropy if entropy_grad else entropy.detach()
        entropy = torch.zeros_like(out).masked_scatter(mask, entropy)
    return out, entropy
