"""DataModules for supervised fine-tuning and for prompt-only (online) stages."""

from __future__ import annotations

import logging
from functools import partial

import lightning as L
import torch

from alignlit.data.encoding import Overflow, Truncation, collate_lm
from alignlit.data.records import parse_prompt, parse_prompt_response, read_records
from alignlit.data.sampler import make_loader

log = logging.getLogger(__name__)


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic seeded (train, val) split of ``range(n)``; both sides sorted."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = round(n * val_fraction)
    return sorted(order[n_val:]), sorted(order[:n_val])


def read_split(
    train_file: str, val_file: str | None, *, val_fraction: float, seed: int, max_examples: int | None = None
) -> tuple[list, list]:
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
        from alignlit.models import load_tokenizer

        return load_tokenizer(path)
    trainer = datamodule.trainer
    module = trainer.lightning_module if trainer is not None else None
    if module is None or getattr(module, "tokenizer", None) is None:
        raise ValueError(
            f"{type(datamodule).__name__} needs a tokenizer: pass `tokenizer: <dir>` or attach it to a "
            "Trainer with a module that has one"
        )
    return module.tokenizer


class SFTDataModule(L.LightningDataModule):
    """(prompt, response) pairs for supervised fine-tuning; the loss is on response tokens only.

    Reads local JSONL / JSON / Parquet / ``datasets`` directories in the generic
    ``{"prompt", "response"}`` format or the HH-RLHF dialogue format (``{"chosen": …}`` or
    ``{"text": …}``, split at the last ``\\n\\nAssistant:``). EOS is appended to every response.

    Args:
        train_file: training records.
        val_file: validation records; if None, ``val_fraction`` of ``train_file`` is held out
            (seeded split).
        val_fraction: held-out fraction when there is no ``val_file``.
        tokenizer: tokenizer directory; default: the policy's tokenizer.
        max_length: longest prompt + response in tokens.
        max_prompt_length: prompts are left-truncated to this many tokens.
        overflow: what to do when prompt + response exceed ``max_length``: "truncate" the response,
            "drop" the example, or raise an "error".
        batch_size: training batch size (per device).
        eval_batch_size: validation batch size (default: ``batch_size``).
        max_examples: use only the first N training records (None: all).
        seed: seed of the split and of the shuffling.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        train_file: str,
        val_file: str | None = None,
        val_fraction: float = 0.05,
        tokenizer: str | None = None,
        max_length: int = 256,
        max_prompt_length: int = 128,
        overflow: Overflow = "truncate",
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        max_examples: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = None
        self.train_set: list = []
        self.val_set: list = []

    def _encode(self, records, trunc: Truncation) -> list:
        out = []
        for rec in records:
            prompt, response = parse_prompt_response(rec)
            enc = trunc.encode(prompt, response, rec.source)
            if enc is not None:
                out.append(enc)
        return out

    def setup(self, stage: str | None = None) -> None:
        if self.train_set:
            return
        hp = self.hparams
        self.tokenizer = resolve_tokenizer(self, hp.tokenizer)
        trunc = Truncation(
            self.tokenizer,
            max_length=hp.max_length,
            max_prompt_length=hp.max_prompt_length,
            overflow=hp.overflow,
        )
        train_recs, val_recs = read_split(
            hp.train_file,
            hp.val_file,
            val_fraction=hp.val_fraction,
            seed=hp.seed,
            max_examples=hp.max_examples,
        )
        self.train_set = self._encode(train_recs, trunc)
        self.val_set = self._encode(val_recs, trunc)
        if not self.train_set:
            raise ValueError(f"{hp.train_file}: no training examples left after the truncation policy")
        log.info(
            "SFT data: %d train / %d val examples; truncation: %s",
            len(self.train_set),
            len(self.val_set),
            dict(trunc.counts) or "none",
        )
        self.truncation_counts = dict(trunc.counts)

    def _loader(self, data, batch_size, shuffle):
        return make_loader(
            data,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=self.hparams.seed,
            collate_fn=partial(collate_lm, pad_id=self.tokenizer.pad_token_id),
            trainer=self.trainer,
            num_workers=self.hparams.num_workers,
        )

    def train_dataloader(self):
        return self._loader(self.train_set, self.hparams.batch_size, True)

    def val_dataloader(self):
        if not self.val_set:
            return []
        return self._loader(self.val_set, self.hparams.eval_batch_size or self.hparams.batch_size, False)


def _collate_prompts(prompts: list[str]) -> list[str]:
    return list(prompts)


class PromptDataModule(L.LightningDataModule):
    """Prompts for online stages (PPO, online DPO/RRHF) and for sampling.

    Records are ``{"prompt": …}``, or any record with a ``prompt`` field, or HH-RLHF dialogues
    whose prompt is the part up to the last ``\\n\\nAssistant:``. Batches are lists of prompt
    strings; the rollout engine tokenises them. Duplicate prompts are kept (they are sampled
    more often, as in the data).

    Args:
        train_file: prompt records.
        val_file: held-out prompt records (optional; else ``val_fraction`` of ``train_file``).
        val_fraction: held-out fraction when there is no ``val_file``.
        batch_size: prompts per rollout batch (per device).
        max_examples: use only the first N records.
        seed: seed of the split and shuffling.
    """

    def __init__(
        self,
        train_file: str,
        val_file: str | None = None,
        val_fraction: float = 0.0,
        batch_size: int = 16,
        max_examples: int | None = None,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.train_prompts: list[str] = []
        self.val_prompts: list[str] = []

    def setup(self, stage: str | None = None) -> None:
        if self.train_prompts:
            return
        hp = self.hparams
        train_recs, val_recs = read_split(
            hp.train_file,
            hp.val_file,
            val_fraction=hp.val_fraction,
            seed=hp.seed,
            max_examples=hp.max_examples,
        )
        self.train_prompts = [parse_prompt(r) for r in train_recs]
        self.val_prompts = [parse_prompt(r) for r in val_recs]
        if not self.train_prompts:
            raise ValueError(f"{hp.train_file}: no prompts")

    def _loader(self, data, shuffle):
        return make_loader(
            data,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            seed=self.hparams.seed,
            collate_fn=_collate_prompts,
            trainer=self.trainer,
        )

    def train_dataloader(self):
        return self._loader(self.train_prompts, True)

    def val_dataloader(self):
        return self._loader(self.val_prompts, False) if self.val_prompts else []
