"""The optimiser steps of an online stage, a part of :class:`~alignlit.modules.online.OnlineModule`.

:class:`Updates` draws the minibatches of a rollout and takes one clipped optimiser step of a trained model
on one loss (:meth:`Updates.step`) or over token-budget micro-batches (``minibatches.token_budget``;
:mod:`alignlit.modules.micro_batches`): of a trajectory's rows (:meth:`Updates.step_on`) or of the items of
a loss that is a mean over items (:meth:`Updates.step_over`: online DPO's pairs, online RRHF's response
sets). The stage's ``train_on`` reaches it through the module's
:meth:`~alignlit.modules.online.OnlineModule.update` and
:meth:`~alignlit.modules.online.OnlineModule.update_on`, or its ``updates`` (``step_over``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from alignlit.losses import aggregation_share
from alignlit.losses.policy_gradient import LossAggregation
from alignlit.modules.base import check_finite
from alignlit.modules.micro_batches import MicroBatchStats, combine_metrics, even_out, row_lengths
from alignlit.modules.trajectory import Minibatches, Trajectory
from alignlit.ops.token_budget import token_budget_microbatches

if TYPE_CHECKING:
    from alignlit.modules.online import OnlineModule
    from alignlit.modules.online_state import Progress

__all__ = ["ItemLossFn", "LossFn", "Updates"]

LossFn = Callable[[Trajectory], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(rows) -> (loss, metrics)``: the loss of some rows of a minibatch under its aggregation."""

ItemLossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(items) -> (loss, metrics)``: the mean loss over some items (1-D long indices) of a step."""

AddPtx = Callable[..., torch.Tensor]
"""``add_ptx(loss, metrics, what=...)``: the loss plus the ptx term of the next ptx batch."""


class MicroBatch(NamedTuple):
    """One micro-batch's loss and metrics, its loss's share of the step's and its loss tokens' share
    (weights of :func:`~alignlit.modules.micro_batches.combine_metrics`), the tokens its forward held and
    how many of them were real."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    share: float
    tokens: float
    padded: int
    real: int


class Updates:
    """The minibatches and optimiser steps of a rollout (module docstring).

    Args:
        module: the stage, under manual optimisation: its ``trained_models()``, optimizers, backward,
            gradient clipping, device and data-parallel group are used through those public methods.
        plan: how a rollout is cut into optimiser steps (``minibatches``, with its ``token_budget``).
        progress: the run's progress, whose minibatch generator draws the minibatches.
        max_grad_norm: the clipping norm of every step (None: measured, not clipped).
        add_ptx: adds the ptx term to a step's loss (the module's :meth:`add_ptx`).
    """

    def __init__(
        self, module: OnlineModule, plan: Minibatches, progress: Progress, *, max_grad_norm: float | None,
        add_ptx: AddPtx,
    ):  # fmt: skip
        self.module, self.plan, self.progress = module, plan, progress
        self.max_grad_norm, self.add_ptx = max_grad_norm, add_ptx
        self.stepped: set[int] = set()
        """The trained models (indices into ``trained_models()``) stepped in the current rollout."""
        self.stats = MicroBatchStats()
        """The current rollout's micro-batches (``perf/*``)."""

    def start_rollout(self) -> None:
        """Forget the previous rollout's steps and micro-batches."""
        self.stepped = set()
        self.stats.reset()

    def minibatches(self, num_rows: int) -> Iterator[torch.Tensor]:
        """The row indices of each optimiser step over ``num_rows`` rows (``minibatches``, drawn with the
        run's seeded generator, saved in checkpoints)."""
        return self.plan.plan(num_rows, self.progress.minibatch_generator)

    def step(self, name: str, loss: torch.Tensor) -> torch.Tensor:
        """Backward ``loss``, clip the gradient norm of the trained model ``name`` and step its optimizer;
        returns the norm before clipping."""
        return self._step(name, lambda: self.module.manual_backward(loss))

    def step_on(
        self, name: str, mb: Trajectory, loss_fn: LossFn, *, aggregation: str | LossAggregation, what: str,
        ptx: bool = False,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """One optimiser step of the trained model ``name`` on the minibatch ``mb``: ``loss_fn(rows) ->
        (loss, metrics)`` gives the loss of some of its rows under ``aggregation`` (``ptx``: plus the ptx
        term, once per step); returns the metrics with ``grad_norm``.

        Without ``minibatches.token_budget``, one backward of ``loss_fn(mb)``. With it, a backward per
        micro-batch of the rows with a loss token (as many on every data-parallel rank), each cut to its own
        longest row and its loss scaled by its :func:`~alignlit.losses.aggregation_share`, then one clipped
        step on the summed gradient; the metrics are combined by :func:`~alignlit.modules.micro_batches.combine_metrics`.
        """
        budget = self.plan.token_budget
        if budget is None:
            return self._one_pass(name, *loss_fn(mb), what=what, ptx=ptx)
        keep = mb.loss_mask.any(-1).nonzero().flatten()  # rows without a loss token add nothing
        lengths = row_lengths(mb.prompt_mask, mb.attention_mask)[keep].cpu()
        micro = [keep[rows.to(keep.device)] for rows in token_budget_microbatches(lengths, budget)]

        def part_loss(rows: torch.Tensor) -> MicroBatch:
            part = mb.select(rows).trimmed()
            share = aggregation_share(aggregation, part.loss_mask, mb.loss_mask)
            tokens = float(part.loss_mask.sum()) / float(mb.loss_mask.sum().clamp(min=1))
            padded = len(rows) * (part.prompt_mask.shape[1] + part.attention_mask.shape[1])
            real = int(row_lengths(part.prompt_mask, part.attention_mask).sum())
            return MicroBatch(*loss_fn(part), share, tokens, padded, real)

        return self._accumulate(name, micro, part_loss, what=what, ptx=ptx)

    def step_over(
        self, name: str, lengths: torch.Tensor, loss_fn: ItemLossFn, *, sizes: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None, what: str, ptx: bool = False,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """One optimiser step of the trained model ``name`` on a loss that is a mean over ``len(lengths)``
        items (online DPO's pairs, online RRHF's response sets): ``loss_fn(items) -> (loss, metrics)`` gives
        the mean loss of some of them (``ptx``: plus the ptx term, once per step); returns the metrics with
        ``grad_norm``.

        Without ``minibatches.token_budget``, one backward of ``loss_fn`` of every item. With it, a backward
        per micro-batch of items (:func:`~alignlit.ops.token_budget_microbatches` over an item's ``sizes``
        sequences (None: one) padded to its longest ``lengths``, as its collate pads them), its loss scaled by
        its share of the items, then one clipped step on the summed gradient. ``tokens``: the real tokens of
        each item, for ``perf/padding_share`` (None: ``sizes × lengths``).
        """
        budget, count = self.plan.token_budget, len(lengths)
        if budget is None:
            return self._one_pass(name, *loss_fn(torch.arange(count)), what=what, ptx=ptx)
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        sizes = torch.ones_like(lengths) if sizes is None else torch.as_tensor(sizes, dtype=torch.long).cpu()
        tokens = lengths * sizes if tokens is None else torch.as_tensor(tokens, dtype=torch.long).cpu()

        def part_loss(items: torch.Tensor) -> MicroBatch:
            padded = int(sizes[items].sum()) * int(lengths[items].max())
            share = len(items) / count
            return MicroBatch(*loss_fn(items), share, share, padded, int(tokens[items].sum()))

        micro = token_budget_microbatches(lengths, budget, sizes)
        return self._accumulate(name, micro, part_loss, what=what, ptx=ptx)

    def _one_pass(
        self, name: str, loss: torch.Tensor, metrics: dict[str, torch.Tensor], *, what: str, ptx: bool
    ) -> dict[str, torch.Tensor]:
        """One step on ``loss`` (plus the ptx term with ``ptx``); the metrics with ``grad_norm``."""
        if ptx:
            loss = self.add_ptx(loss, metrics, what=what)
        metrics["grad_norm"] = self.step(name, loss)
        return metrics

    def _accumulate(
        self, name: str, micro: list[torch.Tensor], part_loss: Callable[[torch.Tensor], MicroBatch], *,
        what: str, ptx: bool,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """One clipped step of ``name`` on the summed gradients of the micro-batches ``micro`` (as many on
        every data-parallel rank: evened out, fillers weighed 0), each ``part_loss(indices)``'s loss scaled by
        its share (the ptx term added to the first); the combined metrics with ``grad_norm``."""
        filler = torch.zeros(1, dtype=torch.long)  # a forward and a backward weighed 0, for the collectives
        micro = even_out(micro, max(self.count_micro_batches(len(micro)), 1), filler=filler)
        records: list[tuple[float, float, dict[str, torch.Tensor]]] = []

        def backward() -> None:
            for k, rows in enumerate(micro):
                part = part_loss(rows)
                share, tokens = (0.0, 0.0) if rows is filler else (part.share, part.tokens)
                loss = part.loss * share
                if ptx and k == 0:
                    loss = self.add_ptx(loss, part.metrics, what=what)
                else:
                    check_finite(loss, what=what, step=self.module.global_step, metrics=part.metrics)
                self.module.manual_backward(loss)
                if rows is not filler:
                    records.append((share, tokens, {key: v.detach() for key, v in part.metrics.items()}))
                self.stats.add(part.padded, part.real)

        norm = self._step(name, backward)
        self.stats.steps += 1
        return combine_metrics(records) | {"grad_norm": norm}

    def count_micro_batches(self, count: int) -> int:
        """The most micro-batches of a step over the data-parallel ranks (``count`` in one process)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return count
        out = torch.tensor(count, device=self.module.device)
        group = self.module.data_parallel_group()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=group)
        return int(out)

    def _step(self, name: str, backward: Callable[[], None]) -> torch.Tensor:
        """Zero the gradients of the trained model ``name``, run ``backward``, clip and step its optimizer."""
        trained = self.module.trained_models()
        names = [t.name for t in trained]
        if name not in names:
            raise KeyError(f"{type(self.module).__name__} trains {names}, not {name!r}")
        index = names.index(name)
        optimizers = self.module.optimizers()
        optimizer = (optimizers if isinstance(optimizers, list) else [optimizers])[index]
        optimizer.zero_grad()
        backward()
        norm = self.module.clip_grad_norm(trained[index].module.parameters(), self.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # not held through the next rollout's forwards
        self.stepped.add(index)
        return norm
