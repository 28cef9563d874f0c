"""Token-budget micro-batches: the rows of one optimiser step split by how many tokens a forward holds,
instead of by a row count (NeMo-RL's dynamic batching, OpenRLHF's ``dynamic_batch_enable``).

:func:`token_budget_microbatches` packs rows into micro-batches whose padded size ``rows × longest row``
stays within a budget (or items of several sequences, such as preference pairs, by ``sizes``); the
gradients of the micro-batches are accumulated before the step, each one's loss scaled by its share
(:func:`~alignlit.losses.aggregation_share`, or the items' share of a mean over items) so that their sum is
the loss of the whole minibatch, whatever the packing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["token_budget_microbatches"]


def token_budget_microbatches(
    lengths: Sequence[int] | torch.Tensor,
    budget: int,
    sizes: Sequence[int] | torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Row indices of each micro-batch: rows sorted by length (longest first, ties by index), each appended
    to the open micro-batch while ``(rows + 1) × longest ≤ budget``, else opening the next one. A row longer
    than the budget gets a micro-batch of its own (it cannot be split). Deterministic; every row once.

    With ``sizes``, each item ``i`` (a preference pair, a prompt's response set) is ``sizes[i]`` sequences
    padded together with the others of its micro-batch, and ``lengths[i]`` is its longest: a micro-batch
    holds ``(Σ sizes) × longest`` padded tokens, and an item is appended while that stays within the budget.

    Args:
        lengths: (N,) tokens of each row (prompt and response, as the forward holds them).
        budget: the most padded tokens ``rows × longest`` a micro-batch holds (``>= 1``).
        sizes: (N,) sequences of each item (``>= 1``; None: one each).

    Returns:
        Micro-batches as 1-D long tensors of row indices, each sorted ascending.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    lengths = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if (lengths < 0).any():
        raise ValueError(f"row lengths must be >= 0, got {lengths.tolist()}")
    sizes = torch.ones_like(lengths) if sizes is None else torch.as_tensor(sizes, dtype=torch.long).flatten()
    if sizes.shape != lengths.shape or (sizes < 1).any():
        raise ValueError(f"sizes must be {len(lengths)} counts >= 1, got {sizes.tolist()}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    longest = rows = 0
    for i in order:
        n, size = int(lengths[i]), int(sizes[i])
        if batches and (rows + size) * max(longest, n) <= budget:
            batches[-1].append(i)
            longest, rows = max(longest, n), rows + size
        else:
            batches.append([i])
            longest, rows = n, size
    return [torch.tensor(sorted(b), dtype=torch.long) for b in batches]
