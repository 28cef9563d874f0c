"""RRHF: rank responses by length-normalised log-probability, plus SFT on the best (algorithms.md §7)."""

from __future__ import annotations

import torch

from alignlit.ops.stats import check_ndim, check_same_shape


def rrhf_loss(
    token_logps: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    *,
    rank_weight: float = 1.0,
    sft_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RRHF loss (Yuan et al. 2023, eqs. 1-5), correct for any batch size and number of responses.

    Per prompt, with ``p_i = (1/|y_i|)·Σ_t log π(y_{i,t} | x, y_{i,<t})`` over valid tokens:
    ``L_rank = Σ_{r_i < r_j} max(0, p_i - p_j)`` and ``L_ft = -Σ_t log π(y_{i*,t} | x, y_{i*,<t})``
    with ``i* = argmax_i r_i`` (ties: the first). Both are averaged over the batch;
    ``L = rank_weight·L_rank + sft_weight·L_ft``. Padding is excluded from ``p_i`` and ``L_ft``.

    Args:
        token_logps: (B, k, T) log-probs of the response tokens under the policy.
        mask: (B, k, T) 1 on response tokens; every response needs at least one.
        rewards: (B, k) reward of each response.
        rank_weight: weight of ``L_rank``.
        sft_weight: weight of ``L_ft``.

    Returns:
        ``(loss, metrics)``; metrics ``loss``, ``rank_loss``, ``sft_loss`` and ``ranking_accuracy``:
        over all pairs of the batch with ``r_i < r_j``, the fraction with ``p_i < p_j`` (NaN when
        every reward in the batch is tied).
    """
    check_ndim("token_logps", token_logps, 3, "(B, k, T)")
    check_same_shape(token_logps=token_logps, mask=mask)
    check_same_shape(**{"token_logps.shape[:2]": token_logps[..., 0], "rewards": rewards})
    weights = mask.to(token_logps.dtype)  # (B, k, T)
    lengths = weights.sum(-1)  # (B, k)
    if (lengths == 0).any():
        empty = [tuple(index) for index in torch.nonzero(lengths == 0).tolist()]
        raise ValueError(f"responses with zero valid tokens at (batch, k) indices {empty}")
    logp_sums = (token_logps * weights).sum(-1)  # (B, k)
    scores = logp_sums / lengths  # p_i, (B, k)

    # pairs[b, i, j] is True where r_i < r_j, i.e. response j should score higher than response i.
    pairs = rewards[:, :, None] < rewards[:, None, :]  # (B, k, k)
    score_gaps = scores[:, :, None] - scores[:, None, :]  # p_i - p_j, (B, k, k)
    rank_loss = (torch.relu(score_gaps) * pairs).sum((1, 2)).mean()

    num_responses = rewards.shape[1]
    is_best = rewards == rewards.max(dim=1, keepdim=True).values  # (B, k)
    candidates = torch.where(is_best, torch.arange(num_responses, device=rewards.device), num_responses)
    best = candidates.min(dim=1).values  # first argmax, (B,)
    sft_loss = -logp_sums.gather(1, best[:, None]).squeeze(1).mean()

    loss = rank_weight * rank_loss + sft_weight * sft_loss
    with torch.no_grad():
        correct = ((score_gaps < 0) & pairs).sum().to(scores.dtype)
        accuracy = correct / pairs.sum().to(scores.dtype)  # 0/0 = NaN when every reward is tied
    metrics = {
        "loss": loss.detach(),
        "rank_loss": rank_loss.detach(),
        "sft_loss": sft_loss.detach(),
        "ranking_accuracy": accuracy,
    }
    return loss, metrics
