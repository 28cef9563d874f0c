"""Token log-probabilities and entropies without materialising a full ``log_softmax``.

- :func:`gather_logprobs` / :func:`entropy_from_logits`: from logits ``(..., V)`` that already exist,
  in float32 (float64 for float64 logits) on chunks of rows, so peak extra memory is one chunk, not
  a float32 copy of all logits.
- :func:`linear_logprobs`: from the final hidden states and the LM head, fused: the logits of a tile
  of rows x vocabulary entries are computed, reduced to log-probs (and entropies) with an online
  log-sum-exp and dropped, and recomputed in the backward pass, so no ``(N, V)`` tensor ever exists
  (the chunked linear cross-entropy of Liger Kernel, Hsu et al. 2024, §3.2, tiled over the vocabulary
  too, on any device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


LINEAR_CHUNK_ELEMENTS = 1 << 21
"""Upper bound on ``rows * tile`` of one tile of :func:`linear_logprobs` (8 MiB of float32 logits)."""

LINEAR_CHUNK_ROWS = 1024
"""Default rows per chunk of :func:`linear_logprobs` when the vocabulary does not fit one tile: the head
is read once per chunk in each pass, so at a large vocabulary many rows share each read."""

LINEAR_MIN_ROWS = 32
"""Fewest rows per chunk of :func:`linear_logprobs` by default (a matmul on fewer rows is inefficient)."""


def _head_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    scale: float,
    softcap: float | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``z = softcap(scale · (h Wᵀ + b)) / temperature`` in ``dtype``, and ``tanh`` of the softcap (or None).

    The projection runs in the weights' dtype, like the model's own LM head; the rest in ``dtype``.
    """
    logits = F.linear(hidden, weight, bias).to(dtype)  # (r, t)
    if scale != 1.0:
        logits = logits * scale
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(logits / softcap)
        logits = softcap * tanh
    if temperature != 1.0:
        logits = logits / temperature
    return logits, tanh


def _tiles(vocab: int, tile: int) -> list[tuple[int, int]]:
    return [(v, min(v + tile, vocab)) for v in range(0, vocab, tile)]


class _LinearLogprobs(torch.autograd.Function):
    """``log_softmax(z)[label]`` and ``H(softmax(z))`` of ``z = head(h)``, in tiles of rows x vocabulary.

    Forward, per chunk of rows: each vocabulary tile's log-normaliser ``lse_t`` and entropy ``H_t``
    are merged into running ones (``lse = logaddexp(lse_a, lse_b)``; with the tiles' shares
    ``w = exp(lse_t - lse)``, ``H = Σ w_t·H_t - Σ w_t·log w_t``), and the label's logit is read from
    its tile. Saves the inputs (hidden rows, head, labels) and the ``(M,)`` log-normalisers and
    entropies; the backward pass recomputes each tile's logits. With ``p = softmax(z)``:
    ``∂ log p_y / ∂z = onehot(y) - p`` and ``∂H/∂z = -p ⊙ (log p + H)``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, scale, softcap, temperature, with_entropy, rows, tile):
        dtype = torch.promote_types(weight.dtype, torch.float32)
        m = hidden.shape[0]
        logsumexp = torch.empty(m, dtype=dtype, device=hidden.device)
        logprobs = torch.empty(m, dtype=dtype, device=hidden.device)
        entropy = torch.empty(m, dtype=dtype, device=hidden.device) if with_entropy else None
        tiles = _tiles(weight.shape[0], tile)
        for a in range(0, m, rows):
            h, y = hidden[a : a + rows], labels[a : a + rows]
            lse = ent = picked = None
            for v, w in tiles:
                z, _ = _head_logits(
                    h, weight[v:w], None if bias is None else bias[v:w], dtype=dtype, scale=scale,
                    softcap=softcap, temperature=temperature,
                )  # fmt: skip
                lse_t = torch.logsumexp(z, dim=-1)  # (r,)
                ent_t = lse_t - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
                inside = (y >= v) & (y < w)  # (r,) the label's logit is in this tile
                z_y = z.gather(-1, (y - v).clamp(0, w - v - 1)[:, None]).squeeze(-1)
                if lse is None:
                    lse, ent, picked = lse_t, ent_t, z_y
                    continue
                picked = torch.where(inside, z_y, picked)
                merged = torch.logaddexp(lse, lse_t)
                if with_entropy:
                    share, share_t = torch.exp(lse - merged), torch.exp(lse_t - merged)
                    ent = share * (ent - (lse - merged)) + share_t * (ent_t - (lse_t - merged))
                lse = merged
            logsumexp[a : a + rows] = lse
            logprobs[a : a + rows] = picked - lse
            if entropy is not None:
                entropy[a : a + rows] = ent
        ctx.save_for_backward(hidden, weight, bias, labels, logsumexp, entropy)
        ctx.options = (dtype, scale, softcap, temperature, rows, tile)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, logsumexp, entropy = ctx.saved_tensors
        dtype, scale, softcap, temperature, rows, tile = ctx.options
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 10
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_bias else None
        tiles = _tiles(weight.shape[0], tile)
        same = weight.dtype == dtype  # accumulate in place, without an (r, H) or (t, H) temporary
        for a in range(0, hidden.shape[0], rows):
            h, y = hidden[a : a + rows], labels[a : a + rows]
            h_head = h.to(weight.dtype)
            lse = logsumexp[a : a + rows, None]  # (r, 1)
            g = None if grad_logprobs is None else grad_logprobs[a : a + rows, None].to(dtype)  # (r, 1)
            g_ent = None if grad_entropy is None else grad_entropy[a : a + rows, None].to(dtype)  # (r, 1)
            chunk_grad = None if grad_hidden is None else torch.zeros(h.shape, dtype=dtype, device=h.device)
            for v, w in tiles:
                z, tanh = _head_logits(
                    h, weight[v:w], None if bias is None else bias[v:w], dtype=dtype, scale=scale,
                    softcap=softcap, temperature=temperature,
                )  # fmt: skip
                logp = z - lse  # (r, t) log p
                probs = torch.exp(logp)
                grad_z = torch.zeros_like(z) if g is None else -g * probs
                if g is not None:
                    inside = ((y >= v) & (y < w))[:, None]  # (r, 1)
                    grad_z.scatter_add_(-1, (y - v).clamp(0, w - v - 1)[:, None], torch.where(inside, g, 0.0))
                if g_ent is not None:
                    grad_z -= g_ent * probs * (logp + entropy[a : a + rows, None])
                if temperature != 1.0:
                    grad_z.div_(temperature)
                if tanh is not None:
                    grad_z.mul_(1 - tanh * tanh)
                if scale != 1.0:
                    grad_z.mul_(scale)
                grad_z = grad_z.to(weight.dtype)  # (r, t), back through the projection in the weights' dtype
                if chunk_grad is not None:  # (r, H) ∂/∂h of this chunk, summed over the tiles in ``dtype``
                    if same:
                        chunk_grad.addmm_(grad_z, weight[v:w])
                    else:
                        chunk_grad += (grad_z @ weight[v:w]).to(dtype)
                if grad_weight is not None:
                    if same:
                        grad_weight[v:w].addmm_(grad_z.t(), h_head)
                    else:
                        grad_weight[v:w] += (grad_z.t() @ h_head).to(dtype)
                if grad_bias is not None:
                    grad_bias[v:w] += grad_z.sum(0).to(dtype)
            if chunk_grad is not None:
                grad_hidden[a : a + rows] = chunk_grad.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _tiling(m: int, vocab: int, chunk_rows: int | None, tile: int | None) -> tuple[int, int]:
    """``(rows per chunk, vocabulary entries per tile)`` with ``rows * tile <= LINEAR_CHUNK_ELEMENTS``
    unless both are given (a vocabulary that fits one tile keeps the whole row, as before tiling)."""
    for name, value in (("chunk_rows", chunk_rows), ("tile", tile)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {value}")
    vocab = max(vocab, 1)
    if chunk_rows is None:
        if tile is None:
            chunk_rows = max(LINEAR_CHUNK_ROWS, LINEAR_CHUNK_ELEMENTS // vocab)
        else:
            chunk_rows = max(LINEAR_MIN_ROWS, LINEAR_CHUNK_ELEMENTS // tile)
    if tile is None:
        tile = max(1, LINEAR_CHUNK_ELEMENTS // max(1, min(chunk_rows, m)))
    return chunk_rows, min(tile, vocab)


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
    tile: int | None = None,
    check_labels: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and entropies) under the LM head ``z = softcap(s·(hWᵀ + b)) / T``, fused.

    Equal to ``gather_logprobs(z, labels)`` and ``entropy_from_logits(z)`` of the full logits, but the
    ``(M, V)`` logits are only ever built one tile of ``chunk_rows`` rows x ``tile`` vocabulary entries
    at a time, in the forward (an online log-sum-exp over the tiles) and again in the backward pass
    (where they are recomputed): the extra memory is one tile, whatever ``M`` and ``V``. The head is
    read once per chunk of rows in each pass, so large chunks of rows make a large vocabulary cheap.
    Differentiable with respect to ``hidden``, ``weight`` and ``bias`` (through the entropies too).

    Args:
        hidden: (M, H) final hidden states of the positions to score.
        weight: (V, H) LM head.
        labels: (M,) token ids in ``[0, V)`` scored at each row.
        bias: (V,) LM-head bias, or None.
        temperature: ``T > 0``; the logits are divided by it.
        logit_scale: ``s``, a multiplier some models apply to the head's output (Cohere's ``logit_scale``).
        softcap: ``c`` of a final logit soft-capping ``c·tanh(x/c)`` (Gemma 2), or None.
        with_entropy: also return the entropy of each row's distribution.
        chunk_rows: rows per chunk (default: ``LINEAR_CHUNK_ELEMENTS // V``, at least ``LINEAR_CHUNK_ROWS``;
            with ``tile`` given, ``LINEAR_CHUNK_ELEMENTS // tile``, at least ``LINEAR_MIN_ROWS``).
        tile: vocabulary entries per tile (default: ``LINEAR_CHUNK_ELEMENTS // min(chunk_rows, M)``, at
            most ``V``: a small vocabulary is one tile).
        check_labels: raise on a label outside ``[0, V)`` (two host syncs on an accelerator; callers
            whose labels are token ids the model has just embedded can skip it).

    Returns:
        ``(logprobs (M,), entropy (M,) or None)`` in float32 (float64 for a float64 head).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (M, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be ({hidden.shape[0]},), got {tuple(labels.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    vocab = weight.shape[0]
    if check_labels and labels.numel() and (labels.min().item() < 0 or labels.max().item() >= vocab):
        raise ValueError(
            f"labels must be token ids in [0, {vocab}), got values in [{labels.min().item()}, "
            f"{labels.max().item()}]; replace ignore indices (e.g. -100) with a valid id and mask them"
        )
    rows, tile = _tiling(hidden.shape[0], vocab, chunk_rows, tile)
    logprobs, entropy = _LinearLogprobs.apply(
        hidden, weight, bias, labels.long(), float(logit_scale), softcap, float(temperature), with_entropy,
        rows, tile,
    )  # fmt: skip
    return logprobs, entropy
