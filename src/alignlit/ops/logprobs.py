"""Token log-probabilities and entropies from logits, without materialising a full ``log_softmax``.

Logits are ``(..., V)``; results are ``(...)``. Work is done in float32 (float64 for float64 logits)
on chunks of rows, so peak extra memory is one chunk, not a float32 copy of all logits.
"""

from __future__ import annotations

import torch

from alignlit.ops.stats import check_same_shape, masked_mean, masked_sum

CHUNK_ELEMENTS = 1 << 24
"""Upper bound on ``rows * V`` processed at once (64 MiB of float32 temporaries)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _blocks(outer: int, rows: int, vocab: int) -> list[tuple[slice, slice]]:
    """Split an ``(outer, rows, vocab)`` tensor into blocks of at most ~``CHUNK_ELEMENTS`` elements."""
    per_row = max(vocab, 1)
    if rows * per_row <= CHUNK_ELEMENTS:
        step = max(1, CHUNK_ELEMENTS // (rows * per_row))
        return [(slice(a, min(a + step, outer)), slice(0, rows)) for a in range(0, outer, step)]
    step = max(1, CHUNK_ELEMENTS // per_row)
    return [
        (slice(a, a + 1), slice(r, min(r + step, rows))) for a in range(outer) for r in range(0, rows, step)
    ]


class _GatherLogprobs(torch.autograd.Function):
    """``log_softmax(logits)[label]`` with a blockwise forward and backward.

    Saves only the logits (already alive in the caller's graph), the labels and the ``(A, R)``
    log-normalisers. Backward: ``∂/∂logits = g·(onehot(label) - softmax(logits))``.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (A, R, V), (A, R)
        dtype = _compute_dtype(logits.dtype)
        logsumexp = torch.empty(labels.shape, dtype=dtype, device=logits.device)  # (A, R)
        picked = torch.empty(labels.shape, dtype=dtype, device=logits.device)  # (A, R)
        for outer, rows in _blocks(*logits.shape):
            block = logits[outer, rows].to(dtype)  # (a, r, V)
            logsumexp[outer, rows] = torch.logsumexp(block, dim=-1)
            picked[outer, rows] = block.gather(-1, labels[outer, rows, None]).squeeze(-1)
        ctx.save_for_backward(logits, labels, logsumexp)
        return picked - logsumexp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, labels, logsumexp = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (A, R, V)
        for outer, rows in _blocks(*logits.shape):
            g = grad_out[outer, rows, None].to(logsumexp.dtype)  # (a, r, 1)
            probs = torch.exp(logits[outer, rows].to(logsumexp.dtype) - logsumexp[outer, rows, None])
            block_grad = -g * probs  # (a, r, V)
            block_grad.scatter_add_(-1, labels[outer, rows, None], g)
            grad[outer, rows] = block_grad.to(logits.dtype)
        return grad, None


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits, -1)[..., label]``: the log-probability of each label token.

    Computed as ``logits[label] - logsumexp(logits)`` in float32 (float64 for float64 logits) on
    row chunks, with a matching chunked backward. Logits ``(..., V)`` must already be aligned with
    ``labels`` ``(...)`` (shifted by the caller). Labels must be valid ids in ``[0, V)``: replace
    ignore indices such as ``-100`` by any valid id and mask those positions out downstream.

    Returns:
        ``(...)`` log-probs in float32 (float64 for float64 logits).
    """
    if logits.dim() == 1:
        raise ValueError(
            f"logits must have shape (..., V) with at least one leading dim, got {tuple(logits.shape)}"
        )
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"shape mismatch: logits has shape {tuple(logits.shape)} but labels has shape "
            f"{tuple(labels.shape)}; expected labels to equal logits.shape[:-1]"
        )
    vocab = logits.shape[-1]
    if labels.numel() and (labels.min().item() < 0 or labels.max().item() >= vocab):
        raise ValueError(
            f"labels must be token ids in [0, {vocab}), got values in [{labels.min().item()}, "
            f"{labels.max().item()}]; replace ignore indices (e.g. -100) with a valid id and mask them"
        )
    # (A, R, V): a (B, T, V) input, even a non-contiguous slice such as logits[:, :-1], is used as is.
    logits3 = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits.unsqueeze(0)
    out = _GatherLogprobs.apply(logits3, labels.reshape(logits3.shape[:-1]).long())  # (A, R)
    return out.reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = logsumexp(l) - Σ_v softmax(l)_v·l_v`` of the categorical distribution at each position.

    Computed in float32 (float64 for float64 logits) on row chunks; differentiable.

    Returns:
        ``logits.shape[:-1]`` entropies in nats.
    """
    if logits.dim() == 1:
        raise ValueError(
            f"logits must have shape (..., V) with at least one leading dim, got {tuple(logits.shape)}"
        )
    logits3 = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits.unsqueeze(0)  # (A, R, V)
    dtype = _compute_dtype(logits.dtype)
    by_outer: dict[int, list[torch.Tensor]] = {}
    for outer, row_slice in _blocks(*logits3.shape):
        block = logits3[outer, row_slice].to(dtype)  # (a, r, V)
        probs = torch.softmax(block, dim=-1)
        by_outer.setdefault(outer.start, []).append(torch.logsumexp(block, dim=-1) - (probs * block).sum(-1))
    if not by_outer:
        return torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)
    out = torch.cat([torch.cat(parts, dim=1) for parts in by_outer.values()], dim=0)  # (A, R)
    return out.reshape(logits.shape[:-1])


def sequence_logprobs(
    token_logps: torch.Tensor, mask: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Per-sequence log-probability: sum (``average=False``) or mean over valid tokens.

    Args:
        token_logps: (B, T) token log-probs.
        mask: (B, T) 1 on response tokens, 0 on prompt and padding.
        average: length-normalise (divide by the number of valid tokens); raises ``ValueError`` for
            a sequence with no valid token.

    Returns:
        (B,) log-probs.
    """
    check_same_shape(token_logps=token_logps, mask=mask)
    if average:
        return masked_mean(token_logps, mask, dim=-1)
    return masked_sum(token_logps, mask, dim=-1)
