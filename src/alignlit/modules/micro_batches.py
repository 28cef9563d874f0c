"""Token-budget micro-batches of the online stages (``minibatches.token_budget``).

With a budget, the forward/backward passes of one optimiser step are not one pass over the minibatch's
``rows × longest`` padded tokens but several over micro-batches of rows of similar length
(:func:`~alignlit.ops.token_budget_microbatches` over the rows' real lengths), each cut to its own longest
row (:func:`padding_bounds`). Each micro-batch's loss is scaled by its
:func:`~alignlit.losses.aggregation_share`, so that the accumulated gradient is that of the whole
minibatch under the stage's aggregation (:meth:`Updates.step_on
<alignlit.modules.online_steps.Updates.step_on>`); a loss that is a mean over items (online DPO's pairs,
online RRHF's response sets) by the items' share (:meth:`Updates.step_over
<alignlit.modules.online_steps.Updates.step_over>`). The no-grad passes of a trajectory (old and
reference log-probs, values, a teacher's log-probs) are split the same way (:func:`forward_in_budget`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from alignlit.ops.token_budget import token_budget_microbatches

__all__ = [
    "MicroBatchStats",
    "combine_metrics",
    "even_out",
    "forward_in_budget",
    "padding_bounds",
    "row_lengths",
]


def row_lengths(prompt_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(N,) long, the real tokens of each row: its prompt and its response side, padding left out."""
    return prompt_mask.sum(-1).long() + attention_mask.sum(-1).long()


def padding_bounds(prompt_mask: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, int]:
    """``(p0, t1)``: rows ``prompt[:, p0:]`` and ``response[:, :t1]`` hold every real token of the rows
    (the prompt's leading and the response's trailing columns that are padding in every row left out; at
    least one column of each). The forward functions count positions over real tokens, so a row's values
    do not change."""
    prompt = prompt_mask.bool().any(0).nonzero().flatten()
    p0 = min(int(prompt[0]), prompt_mask.shape[1] - 1) if len(prompt) else prompt_mask.shape[1] - 1
    response = attention_mask.bool().any(0).nonzero().flatten()
    t1 = int(response[-1]) + 1 if len(response) else 1
    return max(p0, 0), t1


def forward_in_budget(
    fn: Callable[..., torch.Tensor], ids: tuple[torch.Tensor, ...], budget: int | None
) -> torch.Tensor:
    """(N, T) ``fn(prompt_ids, prompt_mask, response_ids, response_mask)`` of the rows ``ids``, computed over
    token-budget micro-batches of rows cut to their own longest row, 0 past each micro-batch's last
    column (``fn`` gives 0 on padding); one call on every row when ``budget`` is None."""
    if budget is None:
        return fn(*ids)
    prompt_ids, prompt_mask, response_ids, response_mask = ids
    out = None
    for rows in token_budget_microbatches(row_lengths(prompt_mask, response_mask).cpu(), budget):
        rows = rows.to(response_ids.device)
        p0, t1 = padding_bounds(prompt_mask[rows], response_mask[rows])
        part = fn(
            prompt_ids[rows, p0:], prompt_mask[rows, p0:], response_ids[rows, :t1], response_mask[rows, :t1]
        )  # (m, t1)
        if out is None:
            out = part.new_zeros(response_ids.shape)
        out[rows, :t1] = part
    return out


def even_out(micro: list[torch.Tensor], count: int, filler: torch.Tensor) -> list[torch.Tensor]:
    """``micro`` as ``count`` micro-batches (every data-parallel rank runs as many forward/backward passes):
    the one with the most rows halved until there are enough, then ``filler`` rows (weighed 0) added."""
    micro = list(micro)
    while len(micro) < count and any(len(rows) > 1 for rows in micro):
        largest = max(range(len(micro)), key=lambda k: len(micro[k]))
        rows = micro.pop(largest)
        micro[largest:largest] = list(rows.tensor_split(2))
    return micro + [filler] * (count - len(micro))


def combine_metrics(records: list[tuple[float, float, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """One step's metrics from its micro-batches' ``(aggregation share, token share, metrics)``: a loss
    (a key ending in ``loss``) weighted by the aggregation share (exactly the minibatch's loss), ``*_max``
    the largest, any other (a mean over loss tokens) weighted by the token share; a key only some
    micro-batches give (``ptx_nll``: the first) is averaged over those."""
    out: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(k for _, _, metrics in records for k in metrics):
        given = [(agg, tok, m[key]) for agg, tok, m in records if key in m]
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64).cpu() for _, _, v in given])
        if key.endswith("_max"):
            out[key] = values.max()
            continue
        weights = torch.tensor(
            [agg if key.endswith("loss") else tok for agg, tok, _ in given], dtype=torch.float64
        )
        out[key] = (values * weights).sum() / weights.sum() if weights.sum() > 0 else values.mean()
    return out


class MicroBatchStats:
    """The micro-batches of a rollout's optimiser steps: ``perf/microbatches`` (per optimiser step) and
    ``perf/padding_share`` (the padding columns' share of the tokens their forwards held)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = self.micro_batches = self.padded = self.real = 0

    def add(self, padded: int, real: int) -> None:
        """Count one micro-batch whose forward held ``padded`` tokens, ``real`` of them not padding."""
        self.micro_batches += 1
        self.padded += padded
        self.real += real

    def metrics(self) -> dict[str, float]:
        """The rollout's ``perf/*`` metrics ({} when no step was taken over micro-batches)."""
        if not self.steps:
            return {}
        return {
            "perf/microbatches": self.micro_batches / self.steps,
            "perf/padding_share": 1.0 - self.real / max(self.padded, 1),
        }
