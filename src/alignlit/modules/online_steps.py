"""The optimiser steps of an online stage, a part of :class:`~alignlit.modules.online.OnlineModule`.

:class:`Updates` draws the minibatches of a rollout and takes one clipped optimiser step of a trained model
on one loss (:meth:`Updates.step`) or over token-budget micro-batches (:meth:`Updates.step_on`,
``minibatches.token_budget``; :mod:`alignlit.modules.micro_batches`). The stage's ``train_on`` reaches it
through the module's :meth:`~alignlit.modules.online.OnlineModule.update` and
:meth:`~alignlit.modules.online.OnlineModule.update_on`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

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

__all__ = ["LossFn", "Updates"]

LossFn = Callable[[Trajectory], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(rows) -> (loss, metrics)``: the loss of some rows of a minibatch under its aggregation."""

AddPtx = Callable[..., torch.Tensor]
"""``add_ptx(loss, metrics, what=...)``: the loss plus the ptx term of the next ptx batch."""


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
            loss, metrics = loss_fn(mb)
            if ptx:
                loss = self.add_ptx(loss, metrics, what=what)
            metrics["grad_norm"] = self.step(name, loss)
            return metrics
        keep = mb.loss_mask.any(-1).nonzero().flatten()  # rows without a loss token add nothing
        lengths = row_lengths(mb.prompt_mask, mb.attention_mask)[keep].cpu()
        micro = [keep[rows.to(keep.device)] for rows in token_budget_microbatches(lengths, budget)]
        filler = torch.zeros(1, dtype=torch.long)  # a forward and a backward weighed 0, for the collectives
        micro = even_out(micro, max(self.count_micro_batches(len(micro)), 1), filler=filler)
        records: list[tuple[float, float, dict[str, torch.Tensor]]] = []

        def backward() -> None:
            for k, rows in enumerate(micro):
                part = mb.select(rows).trimmed()
                share, tokens = 0.0, 0.0
                if rows is not filler:
                    share = aggregation_share(aggregation, part.loss_mask, mb.loss_mask)
                    tokens = float(part.loss_mask.sum()) / float(mb.loss_mask.sum().clamp(min=1))
                loss, metrics = loss_fn(part)
                loss = loss * share
                if ptx and k == 0:
                    loss = self.add_ptx(loss, metrics, what=what)
                else:
                    check_finite(loss, what=what, step=self.module.global_step, metrics=metrics)
                self.module.manual_backward(loss)
                if rows is not filler:
                    records.append((share, tokens, {key: v.detach() for key, v in metrics.items()}))
                self.stats.add(rows, part.prompt_mask, part.attention_mask)

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
