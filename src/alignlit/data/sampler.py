"""A deterministic, resumable, rank-aware sampler and the DataLoader that checkpoints it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


class ResumableSampler(Sampler[int]):
    """Permutation of ``range(n)`` fixed by ``(seed, epoch)``, sharded across ranks.

    Rank ``r`` of ``world`` takes every ``world``-th index of the padded permutation, as
    ``DistributedSampler`` does. ``skip`` indices are dropped from the start of the next pass (used
    to resume mid-epoch).
    """

    def __init__(self, n: int, *, shuffle: bool, seed: int, rank: int = 0, world: int = 1):
        if n == 0:
            raise ValueError("cannot sample from an empty dataset")
        self.n, self.shuffle, self.seed, self.rank, self.world = n, shuffle, seed, rank, world
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        per_rank = -(-self.n // self.world)
        order += order[: per_rank * self.world - self.n]
        return order[self.rank :: self.world]

    def __len__(self) -> int:
        return -(-self.n // self.world)

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return iter(self._indices()[skip:])


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position inside an epoch is saved in Lightning checkpoints.

    Lightning calls ``state_dict`` when it writes a checkpoint and ``load_state_dict`` before it
    resumes; the loader counts the batches it has handed out in the current epoch, so resuming
    continues with the next unseen batch. (Lightning pre-fetches nothing from a loader with a
    length, so every batch handed out has been trained on when a checkpoint is written.)
    """

    def __init__(self, *args, sampler: ResumableSampler, **kwargs):
        super().__init__(*args, sampler=sampler, **kwargs)
        self._served = 0

    def __iter__(self):
        self._served = self.sampler.skip // self.batch_size
        for batch in super().__iter__():
            self._served += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.sampler.epoch, "batches": self._served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.set_epoch(state["epoch"])
        self.sampler.skip = state["batches"] * self.batch_size


def make_loader(
    dataset, *, batch_size: int, shuffle: bool, seed: int, collate_fn, trainer=None, num_workers=0
):
    """A resumable loader sharded over the trainer's data-parallel ranks (if a trainer is attached).

    Ranks are the strategy's data-parallel ones (``distributed_sampler_kwargs``): with tensor parallel,
    the ranks of one tensor-parallel group see the same batches.
    """
    rank, world = 0, 1
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
    if kwargs:
        rank, world = kwargs["rank"], kwargs["num_replicas"]
    sampler = ResumableSampler(len(dataset), shuffle=shuffle, seed=seed, rank=rank, world=world)
    return ResumableDataLoader(
        dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, num_workers=num_workers
    )
