"""What an online stage's ``train_on`` calls: the minibatches of a rollout, the rows to train on and the
optimiser steps, on one loss (:meth:`OnlineSteps.update`) or over token-budget micro-batches
(:meth:`OnlineSteps.update_on`, ``minibatches.token_budget``; :mod:`alignlit.modules.micro_batches`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from alignlit.lightning_internals import attached_trainer
from alignlit.losses import aggregation_share
from alignlit.losses.policy_gradient import LossAggregation
from alignlit.modules.base import check_finite
from alignlit.modules.micro_batches import combine_metrics, even_out, row_lengths
from alignlit.modules.trajectory import Trajectory
from alignlit.ops.token_budget import token_budget_microbatches

__all__ = ["OnlineSteps"]

LossFn = Callable[[Trajectory], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class OnlineSteps:
    """The optimiser steps of :class:`~alignlit.modules.online.OnlineModule` (a base class of it)."""

    def _listed(self, value) -> list:
        return value if isinstance(value, list) else [value]

    def minibatches(self, num_rows: int) -> Iterator[torch.Tensor]:
        """The row indices of each optimiser step over ``num_rows`` rows (``minibatches``, drawn with the
        stage's seeded generator, saved in checkpoints)."""
        return self.minibatch_plan.plan(num_rows, self.progress.minibatch_generator)

    def trainable(self, trajectory: Trajectory) -> Trajectory:
        """The samples to update on: those with a loss token; with several ranks all of them (masked),
        so that every rank takes as many optimiser steps."""
        if attached_trainer(self) is not None and self.trainer.world_size > 1:
            return trajectory
        return trajectory.with_loss_tokens()

    def update(self, name: str, loss: torch.Tensor) -> torch.Tensor:
        """Backward ``loss``, clip the gradient norm of the trained model ``name`` and step its optimizer;
        returns the norm before clipping."""
        return self._step(name, lambda: self.manual_backward(loss))

    def update_on(
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
        budget = self.minibatch_plan.token_budget
        if budget is None:
            loss, metrics = loss_fn(mb)
            if ptx:
                loss = self.add_ptx(loss, metrics, what=what)
            metrics["grad_norm"] = self.update(name, loss)
            return metrics
        keep = mb.loss_mask.any(-1).nonzero().flatten()  # rows without a loss token add nothing
        lengths = row_lengths(mb.prompt_mask, mb.attention_mask)[keep].cpu()
        micro = [keep[rows.to(keep.device)] for rows in token_budget_microbatches(lengths, budget)]
        filler = torch.zeros(1, dtype=torch.long)  # a forward and a backward weighed 0, for the collectives
        micro = even_out(micro, max(self._micro_batch_count(len(micro)), 1), filler=filler)
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
                    check_finite(loss, what=what, step=self.global_step, metrics=metrics)
                self.manual_backward(loss)
                if rows is not filler:
                    records.append((share, tokens, {key: v.detach() for key, v in metrics.items()}))
                self.micro_stats.add(rows, part.prompt_mask, part.attention_mask)

        norm = self._step(name, backward)
        self.micro_stats.steps += 1
        return combine_metrics(records) | {"grad_norm": norm}

    def _micro_batch_count(self, count: int) -> int:
        """The most micro-batches of a step over the data-parallel ranks (``count`` in one process)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return count
        out = torch.tensor(count, device=self.device)
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=self.data_parallel_group())
        return int(out)

    def _step(self, name: str, backward: Callable[[], None]) -> torch.Tensor:
        """Zero the gradients of the trained model ``name``, run ``backward``, clip and step its optimizer."""
        names = [t.name for t in self.trained_models()]
        if name not in names:
            raise KeyError(f"{type(self).__name__} trains {names}, not {name!r}")
        index = names.index(name)
        model = self.trained_models()[index].module
        optimizer = self._listed(self.optimizers())[index]
        optimizer.zero_grad()
        backward()
        norm = self.clip_grad_norm(model.parameters(), self.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # not held through the next rollout's forwards
        self._stepped.add(index)
        return norm

    def skip(self, reason: str) -> dict[str, float]:
        """Count a rollout the stage cannot learn from (e.g. no loss token) and say why."""
        self.progress.skipped_rollouts += 1
        print(f"alignlit: rollout {self.rollout.rollouts} skipped: {reason}")
        return {"rollout/skipped": 1.0}

    def add_ptx(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], *, what: str) -> torch.Tensor:
        """``loss + ptx.coef · NLL`` on the next ptx batch (metric ``ptx_nll``), checked finite."""
        loss = self.ptx_mixer.add(loss, metrics, self.policy, self.device)
        check_finite(loss, what=what, step=self.global_step, metrics=metrics)
        return loss
