"""A deterministic, rank-aware sampler whose position is saved, and the stateful loader around it.

Loading state is kept by torchdata's ``StatefulDataLoader`` (Lightning saves and restores any loader
with ``state_dict``/``load_state_dict``); this module adds only what it lacks: a sampler whose
state holds the *epoch* as well as the position, so that a loader restored in epoch ``e`` replays the
order of epoch ``e`` before anything calls ``set_epoch`` (PPO's ptx loader, a restore inside
Lightning's ``setup_data``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


class _Pass(Iterator):
    """One pass over a :class:`ResumableSampler`. Its order is fixed when the first index is drawn
    (so a ``set_epoch`` between ``iter()`` and the first batch still applies); ``state_dict`` is
    ``{"epoch", "yielded"}`` and ``load_state_dict`` continues that epoch after ``yielded`` indices."""

    def __init__(self, sampler: ResumableSampler):
        self.sampler = sampler
        self.epoch: int | None = None
        self.yielded = 0
        self.order: list[int] | None = None

    def __next__(self):
        s = self.sampler
        if self.order is None:
            if self.epoch is None:
                self.epoch, self.yielded, s.skip = s.epoch, s.skip, 0
            self.order = s.order(self.epoch)
        if self.yielded >= len(self.order):
            raise StopIteration
        index = self.order[self.yielded]
        self.yielded += 1
        return (self.epoch, index) if s.yield_epoch else index

    def state_dict(self) -> dict[str, int]:
        if self.epoch is None:
            return {"epoch": self.sampler.epoch, "yielded": self.sampler.skip}
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.yielded, self.order = int(state["epoch"]), int(state["yielded"]), None
        self.sampler.set_epoch(self.epoch)


class ResumableSampler(DistributedSampler):
    """Permutation of ``range(n)`` fixed by ``(seed, epoch)``, sharded across data-parallel ranks.

    The order is exactly ``DistributedSampler``'s (rank ``r`` of ``world`` takes every ``world``-th
    index of the permutation, padded by wrapping around), and being a ``DistributedSampler`` the
    loaders built on it are never re-wrapped by Lightning (``use_distributed_sampler=True``, the
    plain-``Trainer`` default): they shard themselves. Each pass is resumable (see :class:`_Pass`);
    ``skip`` indices are dropped from the start of the next pass.

    Args:
        n: dataset size.
        shuffle: permute (seed ``seed + epoch``) or keep ``0..n-1``.
        seed: seed of the permutation.
        rank: this data-parallel rank.
        world: the number of data-parallel ranks.
        yield_epoch: yield ``(epoch, index)`` pairs, for datasets whose items depend on the epoch
            (length-grouped batches re-formed every epoch): the epoch then travels with the index into
            DataLoader workers.
    """

    def __init__(
        self, n: int, *, shuffle: bool, seed: int, rank: int = 0, world: int = 1, yield_epoch: bool = False
    ):
        if n < 1:
            raise ValueError("cannot sample from an empty dataset")
        super().__init__(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.n, self.yield_epoch = n, yield_epoch
        self.skip = 0

    @property
    def world(self) -> int:
        return self.num_replicas

    def order(self, epoch: int) -> list[int]:
        """This rank's indices in ``epoch`` (the same as ``DistributedSampler`` at that epoch)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        pad = self.total_size - self.n
        order += (order * -(-pad // self.n))[:pad]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> _Pass:
        return _Pass(self)


class ResumableDataLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader``, which also accepts the ``{"epoch", "batches"}`` state that
    alignlit's loaders wrote before they were built on it (checkpoints of earlier versions resume)."""

    def __init__(self, *args, **kwargs):
        with warnings.catch_warnings():  # torchdata 0.11 calls a torch function torch 2.13 deprecates
            warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")
            super().__init__(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) == {"epoch", "batches"} and isinstance(self.sampler, ResumableSampler):
            super().load_state_dict({})
            self.sampler.set_epoch(int(state_dict["epoch"]))
            self.sampler.skip = int(state_dict["batches"]) * self.batch_size
            return
        super().load_state_dict(state_dict)


def data_parallel_rank(trainer) -> tuple[int, int]:
    """``(rank, world)`` of the trainer's data-parallel group (``(0, 1)`` without a trainer).

    From the strategy's ``distributed_sampler_kwargs``: with tensor parallel, the ranks of one
    tensor-parallel group share a data-parallel rank and so read the same batches.
    """
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
    if kwargs:
        return kwargs["rank"], kwargs["num_replicas"]
    return 0, 1


def make_loader(
    dataset,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    collate_fn,
    trainer=None,
    num_workers: int = 0,
    yield_epoch: bool = False,
    epoch: int = 0,
) -> ResumableDataLoader:
    """A resumable loader over ``dataset``, sharded over the trainer's data-parallel ranks (if a
    trainer is attached), whose sampler starts at ``epoch``."""
    rank, world = data_parallel_rank(trainer)
    sampler = ResumableSampler(
        len(dataset), shuffle=shuffle, seed=seed, rank=rank, world=world, yield_epoch=yield_epoch
    )
    sampler.set_epoch(epoch)
    return ResumableDataLoader(
        dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, num_workers=num_workers
    )


def scheduled_batch(loader, index: int, batches_per_epoch: int) -> list:
    """The batch a resumable ``loader`` hands at training step ``index`` (epoch ``index // batches_per_epoch``),
    known ahead from its sampler's order: what the asynchronous rollouts generate ahead."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, ResumableSampler) or sampler.yield_epoch:
        raise ValueError(
            "rollout.max_staleness >= 1 generates the prompts of later steps ahead, from the training "
            f"loader's sampler; it needs alignlit's resumable prompt loader (PromptDataModule), got {loader!r}"
        )
    epoch, batch = divmod(index, batches_per_epoch)
    rows = sampler.order(epoch)[batch * loader.batch_size : (batch + 1) * loader.batch_size]
    return loader.collate_fn([loader.dataset[i] for i in rows])
