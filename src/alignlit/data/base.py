"""The base of every alignlit DataModule: where records come from, the tokenizer, the split, the loaders.

A DataModule on :class:`AlignDataModule` writes only what is its own: how a split's records become
examples (:meth:`AlignDataModule.encode`) and how examples become a batch
(:meth:`AlignDataModule.collate_fn`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

from alignlit.data.args import check_fraction, check_int, check_optional_int, resolve_seed
from alignlit.data.records import DataError, Record, read_records, records_from_memory
from alignlit.data.sampler import ResumableDataLoader, make_loader
from alignlit.data.sources import (
    check_columns,
    check_dataset_spec,
    describe,
    load_dataset_records,
    rename_columns,
)
from alignlit.data.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger(__name__)

DROP_WARN_SHARE = 0.05
"""A DataModule that drops more than this share of its records warns (the counts are always printed)."""


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic seeded (train, val) split of ``range(n)``; both sides sorted."""
    check_fraction("val_fraction", val_fraction)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = round(n * val_fraction)
    return sorted(order[n_val:]), sorted(order[:n_val])


def read_split(
    train_file: str, val_file: str | None, *, val_fraction: float, seed: int, max_examples: int | None = None
) -> tuple[list[Record], list[Record]]:
    """(train, val) records: ``val_file`` if given, else a seeded ``val_fraction`` of ``train_file``
    (after keeping its first ``max_examples`` records)."""
    records = read_records(train_file)
    if max_examples is not None:
        records = records[:max_examples]
    if val_file is not None:
        return records, read_records(val_file)
    tr, va = split_indices(len(records), val_fraction, seed)
    return [records[i] for i in tr], [records[i] for i in va]


def resolve_tokenizer(datamodule: L.LightningDataModule, path: str | None):
    """The DataModule's tokenizer: from ``path`` if given, else the attached module's ``tokenizer``."""
    if path is not None:
        return load_tokenizer(path)
    trainer = datamodule.trainer
    module = trainer.lightning_module if trainer is not None else None
    if module is None or getattr(module, "tokenizer", None) is None:
        raise ValueError(
            f"{type(datamodule).__name__} needs a tokenizer: pass `tokenizer: <dir>` or attach it to a "
            "Trainer with a module that has one"
        )
    return module.tokenizer


def _digest(records: list[Record]) -> str:
    text = json.dumps([r.fields for r in records], sort_keys=True, ensure_ascii=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


class AlignDataModule(L.LightningDataModule):
    """Records from files or memory, a tokenizer, a seeded train/val split and resumable loaders.

    Set-up (once, however often Lightning calls :meth:`setup`): resolve the tokenizer, read the
    records, split them, :meth:`encode` each split. Loaders are torchdata ``StatefulDataLoader`` s over
    a :class:`~alignlit.data.ResumableSampler`: the training loader shuffles (seed ``seed + epoch``),
    the validation loader does not; both are sharded over the trainer's data-parallel ranks
    (``trainer.strategy.distributed_sampler_kwargs``, so the ranks of one tensor-parallel group read
    the same batches), and Lightning saves and restores the training loader's position in
    checkpoints, so a resumed run sees exactly the batches it would have seen. Every size and count
    argument is checked when the DataModule is built.

    Args:
        train_file: training records: a ``.jsonl`` (optionally ``.gz``), ``.json`` (a list) or
            ``.parquet`` file or a ``datasets.Dataset.save_to_disk`` directory. Exactly one of
            ``train_file``, ``dataset`` and ``records``.
        dataset: training records from ``datasets.load_dataset``: a hub dataset
            (``{path: openai/gsm8k, name: main, split: train}``) or local files
            (``{path: json, data_files: FILE, split: train}``); see :mod:`alignlit.data.sources`.
        val_dataset: validation records from ``datasets.load_dataset`` (same form).
        columns: renames columns before parsing, ``{source: target}`` (``{question: prompt}``); applied
            to every source.
        records: in-memory training records instead of ``train_file``: a list of dicts or a
            ``datasets.Dataset``; errors name ``records[i]`` as they name ``file:row``. Not saved in
            ``hparams`` (a ``records_sha256`` of them is).
        val_file: validation records; with neither it nor ``val_records``, a seeded ``val_fraction``
            of the training records is held out.
        val_records: in-memory validation records instead of ``val_file``.
        val_fraction: held-out fraction when no validation records are given, in ``[0, 1)``.
        tokenizer: tokenizer directory; default: the attached module's tokenizer.
        batch_size: training batch size per data-parallel rank.
        eval_batch_size: validation batch size (default: ``batch_size``).
        max_examples: use only the first N training records (None: all).
        seed: seed of the split and of the shuffling. None (the default): the run's ``seed_everything``
            (:func:`alignlit.data.args.resolve_seed`).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        train_file: str | None = None,
        records: list[dict] | Dataset | None = None,
        val_file: str | None = None,
        val_records: list[dict] | Dataset | None = None,
        dataset: dict[str, Any] | None = None,
        val_dataset: dict[str, Any] | None = None,
        columns: dict[str, str] | None = None,
        val_fraction: float = 0.05,
        tokenizer: str | None = None,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        max_examples: int | None = None,
        seed: int | None = None,
        num_workers: int = 0,
    ):
        super().__init__()
        name = type(self).__name__
        given = [
            k
            for k, v in (("train_file", train_file), ("dataset", dataset), ("records", records))
            if v is not None
        ]
        if len(given) != 1:
            got = " and ".join(given) if given else "neither"
            raise ValueError(f"{name}: give exactly one of train_file, dataset and records (got {got})")
        val_given = [
            k
            for k, v in (("val_file", val_file), ("val_dataset", val_dataset), ("val_records", val_records))
            if v is not None
        ]
        if len(val_given) > 1:
            raise ValueError(
                f"{name}: give at most one of val_file, val_dataset and val_records (got {val_given})"
            )
        if dataset is not None:
            check_dataset_spec(dataset, f"{name}: dataset")
        if val_dataset is not None:
            check_dataset_spec(val_dataset, f"{name}: val_dataset")
        check_columns(columns, f"{name}: columns")
        check_fraction("val_fraction", val_fraction, owner=name)
        check_int("batch_size", batch_size, 1, owner=name)
        check_optional_int("eval_batch_size", eval_batch_size, 1, owner=name)
        check_optional_int("max_examples", max_examples, 1, owner=name)
        seed = resolve_seed(seed)
        check_int("seed", seed, 0, owner=name)
        check_int("num_workers", num_workers, 0, owner=name)
        self.save_hyperparameters(ignore=["records", "val_records"])
        self.hparams.seed = seed  # resolved (a subclass's frame, which Lightning reads, holds None)
        self._records, self._val_records = records, val_records
        self.tokenizer = None
        self.train_set: list = []
        self.val_set: list = []
        self._ready = False

    # ------------------------------------------------------------------ what subclasses write
    def encode(self, records: list[Record], split: str) -> list:
        """The examples of one split (``"train"`` or ``"val"``) from its records."""
        raise NotImplementedError

    def collate_fn(self) -> Callable[[list], Any]:
        """A picklable function (examples -> batch), e.g. a ``functools.partial`` of a module-level one."""
        raise NotImplementedError

    def uses_tokenizer(self) -> bool:
        """Whether set-up resolves a tokenizer (prompt-only data needs one only to truncate)."""
        return True

    def drops(self) -> dict[str, int]:
        """Counts of what the data policy truncated or dropped (for logs and error messages)."""
        return {}

    def hold_out(self, records: list) -> tuple[list, list]:
        """The seeded (train, val) split of ``records``: ``val_fraction`` of them held out."""
        tr, va = split_indices(len(records), self.hparams.val_fraction, self.hparams.seed)
        return [records[i] for i in tr], [records[i] for i in va]

    def prepare(self, train: list[Record], val: list[Record] | None) -> tuple[list, list]:
        """(train, val) examples (train encoded first); ``val`` is None when a fraction of ``train``
        is to be held out."""
        if val is None:
            train, val = self.hold_out(train)
        return self.encode(train, "train"), self.encode(val, "val")

    # ------------------------------------------------------------------ set-up
    @property
    def train_source(self) -> str:
        """Where the training records come from (for messages)."""
        hp = self.hparams
        if hp.train_file is not None:
            return hp.train_file
        return f"dataset {describe(hp.dataset)}" if hp.get("dataset") is not None else "records"

    def read(self) -> tuple[list[Record], list[Record] | None]:
        """Training records (the first ``max_examples``) and validation records (None: hold out),
        with ``columns`` renamed."""
        hp = self.hparams
        if hp.train_file is not None:
            train = read_records(hp.train_file)
        elif hp.get("dataset") is not None:
            train = load_dataset_records(hp.dataset, "dataset")
        else:
            train = records_from_memory(self._records, "records")
            hp["records_sha256"] = _digest(train)
        if hp.max_examples is not None:
            train = train[: hp.max_examples]
        val = None
        if hp.val_file is not None:
            val = read_records(hp.val_file)
        elif hp.get("val_dataset") is not None:
            val = load_dataset_records(hp.val_dataset, "val_dataset")
        elif self._val_records is not None:
            val = records_from_memory(self._val_records, "val_records")
            hp["val_records_sha256"] = _digest(val)
        columns = hp.get("columns")
        return rename_columns(train, columns), (None if val is None else rename_columns(val, columns))

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        if self.uses_tokenizer():
            self.tokenizer = resolve_tokenizer(self, self.hparams.tokenizer)
        train, val = self.read()
        self.train_set, self.val_set = self.prepare(train, val)
        if not self.train_set:
            raise DataError(
                f"{self.train_source}: no training examples left ({len(train)} records; "
                f"{self.drops() or 'nothing dropped'})"
            )
        self._ready = True
        self.report_setup(len(train) + (len(val) if val is not None else 0))

    def report_setup(self, n_records: int) -> None:
        """Print what set-up made of the records, with every truncation and drop count (rank zero), log
        the counts as ``data/<count>`` metrics to the trainer's loggers, and warn loudly when the length
        policy dropped more than :data:`DROP_WARN_SHARE` of the records."""
        drops = {k: int(v) for k, v in self.drops().items() if isinstance(v, (int, float)) and v}
        name = type(self).__name__
        trainer = self.trainer
        rank_zero = trainer is None or trainer.is_global_zero
        counted = ", ".join(f"{k} {v}" for k, v in sorted(drops.items())) or "nothing truncated or dropped"
        line = (
            f"alignlit: {name} ({self.train_source}): {n_records} records -> {len(self.train_set)} train / "
            f"{len(self.val_set)} val examples; {counted}"
        )
        log.info(line)
        # drops by length policy (a data-cleaning drop such as a tie or a duplicate is counted, not warned)
        dropped = sum(v for k, v in drops.items() if k.endswith("over_max_length"))
        if rank_zero:
            print(line)
            if n_records and dropped / n_records > DROP_WARN_SHARE:
                warnings.warn(
                    f"{name}: {dropped} of {n_records} records ({dropped / n_records:.0%}) were dropped "
                    f"({counted}); training uses only the rest. Raise the length limits or use overflow "
                    "'truncate' if this is not intended",
                    stacklevel=2,
                )
        if trainer is not None and drops:
            metrics = {
                "data/examples_train": float(len(self.train_set)),
                **{f"data/{k}": float(v) for k, v in drops.items()},
            }
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=0)

    # ------------------------------------------------------------------ loaders
    def make_loader(self, data: list, batch_size: int, *, shuffle: bool) -> ResumableDataLoader:
        """A resumable, rank-sharded loader over ``data`` with this DataModule's collation.

        A training loader asked for by the trainer that drives this DataModule starts at the trainer's
        epoch (so one built after a resume from an end-of-epoch checkpoint has the right order even
        when its workers start before Lightning calls ``set_epoch``).
        """
        trainer = self.trainer
        drives = trainer is not None and shuffle and getattr(trainer, "datamodule", None) is self
        return make_loader(
            data,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=self.hparams.seed,
            collate_fn=self.collate_fn(),
            trainer=trainer,
            num_workers=self.hparams.num_workers,
            epoch=trainer.current_epoch if drives else 0,
        )

    def train_dataloader(self):
        return self.make_loader(self.train_set, self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        if not self.val_set:
            return []
        return self.make_loader(
            self.val_set, self.hparams.eval_batch_size or self.hparams.batch_size, shuffle=False
        )
