"""Token-budget micro-batches: the rows of one optimiser step split by how many tokens a forward holds,
instead of by a row count (NeMo-RL's dynamic batching, OpenRLHF's ``dynamic_batch_enable``).

:func:`token_budget_microbatches` packs rows into micro-batches whose padded size ``rows × longest row``
stays within a budget; the gradients of the micro-batches are accumulated before the step, each one's loss
scaled by :func:`~alignlit.losses.aggregation_share` so that their sum is the loss of the whole minibatch
under its aggregation, whatever the packing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["token_budget_microbatches"]


def token_budget_microbatches(lengths: Sequence[int] | torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch: rows sorted by length (longest first, ties by index), each appended
    to the open micro-batch while ``(rows + 1) × longest ≤ budget``, else opening the next one. A row longer
    than the budget gets a micro-batch of its own (it cannot be split). Deterministic; every row once.

    Args:
        lengths: (N,) tokens of each row (prompt and response, as the forward holds them).
        budget: the most padded tokens ``rows × longest`` a micro-batch holds (``>= 1``).

    Returns:
        Micro-batches as 1-D long tensors of row indices, each sorted ascending.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    lengths = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if (lengths < 0).any():
        raise ValueError(f"row lengths must be >= 0, got {lengths.tolist()}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    longest = 0
    for i in order:
        n = int(lengths[i])
        if batches and (len(batches[-1]) + 1) * max(longest, n) <= budget:
            batches[-1].append(i)
            longest = max(longest, n)
        else:
            batches.append([i])
            longest = n
    return [torch.tensor(sorted(b), dtype=torch.long) for b in batches]
