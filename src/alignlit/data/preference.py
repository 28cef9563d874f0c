"""Preference pairs: the reward-model sequence layout, batches and the DataModule. The record formats are
read by :mod:`alignlit.data.pair_records`.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from alignlit.data.args import check_int
from alignlit.data.base import AlignDataModule
from alignlit.data.chat import hh_as_conversation
from alignlit.data.encoding import Encoded, LMBatch, Overflow, Truncation, check_lengths, pad_right
from alignlit.data.pair_records import PairError, parse_pairs
from alignlit.data.processing import (
    Pair,
    balance_lengths,
    check_bucket_edges,
    cycle_members,
    drop_cycles,
    drop_duplicates,
    drop_ties,
    is_tie,
)
from alignlit.data.records import DataError, Record
from alignlit.data.sampler import make_loader

log = logging.getLogger(__name__)


def response_length(encoded: Encoded) -> int:
    """Tokens after the prompt (the response and its end token)."""
    return len(encoded.input_ids) - encoded.prompt_length


class PairEncoder:
    """The token layout of a scored sequence, shared by training and the scoring API.

    Causal-LM tokenizers (with an EOS token): ``prompt + response + EOS``, with the truncation
    policy of :class:`~alignlit.data.Truncation` (as in SFT: a response cut to fit ``max_length``
    loses its EOS). Encoder tokenizers without EOS but with CLS/SEP (BERT, MiniLM):
    ``CLS + prompt + response + SEP`` as one segment, so the exported model scores
    ``tokenizer(prompt + response)`` in plain Hugging Face code; CLS and SEP are always there.
    Lengths include the special tokens; truncations and drops are counted in :attr:`counts`.
    """

    def __init__(
        self, tokenizer, *, max_length: int, max_prompt_length: int, overflow: Overflow = "truncate"
    ):
        if tokenizer.eos_token_id is not None:
            self.prefix, self.suffix, self.add_eos = [], [], True
        elif tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None:
            self.prefix, self.suffix, self.add_eos = [tokenizer.cls_token_id], [tokenizer.sep_token_id], False
        else:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has neither an EOS token nor CLS/SEP tokens"
            )
        check_lengths(max_length, max_prompt_length, overflow, owner="PairEncoder")
        n = len(self.prefix)
        if max_prompt_length - n < 1 or max_length - n - len(self.suffix) <= max_prompt_length - n:
            raise ValueError(
                f"PairEncoder: with the tokenizer's CLS and SEP tokens, max_prompt_length ({max_prompt_length}) "
                f"must be >= 2 and < max_length - 1 ({max_length - 1})"
            )
        self.truncation = Truncation(
            tokenizer,
            max_length=max_length - n - len(self.suffix),
            max_prompt_length=max_prompt_length - n,
            overflow=overflow,
        )

    @property
    def counts(self):
        return self.truncation.counts

    def encode(self, prompt: str, response: str, source: str, *, allow_empty: bool = False) -> Encoded | None:
        """``None`` when the overflow policy drops the pair. ``allow_empty`` scores an empty response
        (a sample that ended at once) as the prompt followed by the end token."""
        enc = self.truncation.encode(prompt, response, source, add_eos=self.add_eos, allow_empty=allow_empty)
        if enc is None:
            return None
        return Encoded(self.prefix + enc.input_ids + self.suffix, len(self.prefix) + enc.prompt_length)


@dataclass
class PairExample:
    """One encoded pair, with its texts (for text-level models such as the pairwise model)."""

    chosen: Encoded
    rejected: Encoded
    margin: float
    pair: Pair

    @property
    def length(self) -> int:
        return max(len(self.chosen.input_ids), len(self.rejected.input_ids))


@dataclass
class PreferenceBatch:
    """Chosen and rejected sequences stacked for one concatenated forward: rows ``[0, B)`` chosen,
    ``[B, 2B)`` rejected.

    Attributes:
        input_ids: (2B, T) long, right-padded ``prompt + response (+ end token)``.
        attention_mask: (2B, T) bool, True on real tokens.
        loss_mask: (2B, T) bool, True on response tokens.
        margin: (B,) float, 0 where the data gives none.
        prompts: (B,) prompt texts.
        chosen_texts: (B,) preferred responses.
        rejected_texts: (B,) other responses.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    margin: Tensor
    prompts: list[str]
    chosen_texts: list[str]
    rejected_texts: list[str]

    def __len__(self) -> int:
        return len(self.prompts)

    def _half(self, rows: slice) -> LMBatch:
        return LMBatch(self.input_ids[rows], self.attention_mask[rows], self.loss_mask[rows])

    @property
    def chosen(self) -> LMBatch:
        """Rows ``[0, B)``."""
        return self._half(slice(0, len(self)))

    @property
    def rejected(self) -> LMBatch:
        """Rows ``[B, 2B)``."""
        return self._half(slice(len(self), 2 * len(self)))


def collate_preference(
    examples: list[PairExample], pad_id: int, pad_to_multiple_of: int = 1
) -> PreferenceBatch:
    """Stack chosen then rejected rows, right-padded to the longest of the 2B sequences (rounded up
    to a multiple of ``pad_to_multiple_of``)."""
    seqs = [e.chosen for e in examples] + [e.rejected for e in examples]
    ids, attn = pad_right([s.input_ids for s in seqs], pad_id)  # (2B, T)
    extra = -ids.shape[1] % pad_to_multiple_of
    if extra:
        ids = torch.nn.functional.pad(ids, (0, extra), value=pad_id)
        attn = torch.nn.functional.pad(attn, (0, extra), value=False)
    positions = torch.arange(ids.shape[1])[None, :]
    prompt_len = torch.tensor([s.prompt_length for s in seqs])[:, None]
    return PreferenceBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=attn & (positions >= prompt_len),
        margin=torch.tensor([e.margin for e in examples], dtype=torch.float32),
        prompts=[e.pair.prompt for e in examples],
        chosen_texts=[e.pair.chosen for e in examples],
        rejected_texts=[e.pair.rejected for e in examples],
    )


def _collate_batch_of_one(
    items: list[list[PairExample]], pad_id: int, pad_to_multiple_of: int
) -> PreferenceBatch:
    return collate_preference(items[0], pad_id, pad_to_multiple_of)


def length_grouped_batches(
    lengths: list[int], batch_size: int, *, seed: int, chunk_batches: int = 32
) -> list[list[int]]:
    """Batches of similar length, to cut padding: shuffle (seeded), sort each chunk of
    ``chunk_batches * batch_size`` examples by length, cut it into batches."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    chunk = batch_size * chunk_batches
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lengths.__getitem__)
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    return batches


class EpochGroupedBatches(torch.utils.data.Dataset):
    """Batches of similar length (:func:`length_grouped_batches`), re-formed every epoch.

    Item ``(epoch, i)`` is the ``i``-th batch (a list of examples) of that epoch (grouping seed
    ``seed + epoch``); a :class:`~alignlit.data.ResumableSampler` with ``yield_epoch=True`` draws such
    keys, so a resumed run (and every DataLoader worker) rebuilds the same batches. A plain index
    ``i`` is batch ``i`` of epoch 0; with ``regroup=False`` every epoch has epoch 0's batches. The
    number of batches is the same in every epoch.
    """

    def __init__(self, examples: list[PairExample], batch_size: int, *, seed: int, regroup: bool = True):
        self.examples, self.batch_size, self.seed, self.regroup = examples, batch_size, seed, regroup
        self.lengths = [e.length for e in examples]
        self._epoch, self._groups = 0, length_grouped_batches(self.lengths, batch_size, seed=seed)

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, key: int | tuple[int, int]) -> list[PairExample]:
        epoch, i = key if isinstance(key, tuple) else (0, key)
        epoch = epoch if self.regroup else 0
        if epoch != self._epoch:
            self._epoch = epoch
            self._groups = length_grouped_batches(self.lengths, self.batch_size, seed=self.seed + epoch)
        return [self.examples[j] for j in self._groups[i]]


class PreferenceDataModule(AlignDataModule):
    """Preference pairs for reward models, pairwise preference models and DPO.

    Formats: HH-RLHF, generic ``{"prompt","chosen","rejected"[,"margin"]}``, ranked
    ``{"prompt","responses","scores"}`` and conversational message lists (see
    :mod:`alignlit.data.preference`); margins and scores must be finite numbers. Without validation
    records a seeded ``val_fraction`` of the *prompts* is held out (all pairs of a prompt stay on one
    side). After parsing, each split goes through: dedup, tie check, cycle filter, encoding with the
    truncation policy; the training split then through length balancing. Every drop is counted in
    :attr:`report` (``{"train": {...}, "val": {...}}``) and logged. The other arguments (files or
    in-memory records, split, tokenizer, batch sizes, seed, workers) are those of
    :class:`~alignlit.data.AlignDataModule`; a batch of ``batch_size`` pairs holds ``2 * batch_size``
    sequences.

    Args:
        max_length: longest ``prompt + response`` in tokens, special tokens included.
        max_prompt_length: prompts are left-truncated to this many tokens (``< max_length``).
        overflow: when prompt + response exceed ``max_length``: "truncate" the response, "drop" the
            pair, or raise an "error".
        skip_invalid: drop malformed records (missing fields, empty responses, HH prompts that
            differ, ...) and count them by reason, instead of raising a DataError.
        drop_ties: drop pairs whose two responses are identical (counted) instead of raising.
        drop_cycles: drop pairs on a preference cycle of their prompt (A≻B, B≻C, C≻A), counted.
            Cycles are counted (``cycles_kept``) even when they are kept.
        dedup: drop repeated (prompt, chosen, rejected) pairs, counted.
        length_balance: bucket-based length balancing of the training pairs (ChatGLM-RLHF §3.3).
        length_bucket_edges: lower bounds of the buckets of ``|len(y_w) - len(y_l)|`` in tokens.
        ranked_margin: for ranked records use the score difference as the Bradley-Terry margin.
        group_by_length: batch pairs of similar length together (less padding, faster); the
            batches are re-formed (seeded) and shuffled every epoch.
        pad_to_multiple_of: round the padded width of a batch up to a multiple of this. Fewer
            distinct shapes: on CPU the allocator then reuses memory instead of fragmenting it
            (with variable widths, peak memory grows over training); on GPUs tensor cores like it.
        chat: read HH-RLHF dialogues as conversations (Human -> user, Assistant -> assistant), so the
            prompt is rendered with the tokenizer's chat template as every other stage renders it
            (:func:`alignlit.data.chat.hh_as_conversation`); for instruct models.
    """

    def __init__(
        self,
        train_file: str | None = None,
        *,
        max_length: int = 256,
        max_prompt_length: int = 128,
        overflow: Overflow = "truncate",
        skip_invalid: bool = False,
        drop_ties: bool = False,
        drop_cycles: bool = True,
        dedup: bool = True,
        length_balance: bool = False,
        length_bucket_edges: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
        ranked_margin: bool = False,
        group_by_length: bool = False,
        pad_to_multiple_of: int = 1,
        chat: bool = False,
        **kwargs,
    ):
        name = type(self).__name__
        check_lengths(max_length, max_prompt_length, overflow, owner=name)
        check_int("pad_to_multiple_of", pad_to_multiple_of, 1, owner=name)
        check_bucket_edges(length_bucket_edges, owner=name)
        super().__init__(train_file, **kwargs)
        self.report: dict[str, dict[str, int]] = {}

    def _parse(self, records: list[Record]) -> tuple[list[Pair], dict[str, int]]:
        hp = self.hparams
        pairs: list[Pair] = []
        counts = {"records": len(records), "ranked_equal_scores": 0}
        for rec in records:
            try:
                if hp.chat:
                    try:
                        rec = hh_as_conversation(rec)
                    except DataError as e:
                        raise PairError(rec, None, str(e).removeprefix(f"{rec.source}: "), "not_hh") from None
                got, ties = parse_pairs(rec, self.tokenizer, ranked_margin=hp.ranked_margin)
            except PairError as e:
                if not hp.skip_invalid:
                    raise
                key = f"invalid_{e.reason}"
                if key not in counts:
                    log.warning("dropping malformed records (skip_invalid=True), first: %s", e)
                counts[key] = counts.get(key, 0) + 1
                continue
            pairs += got
            counts["ranked_equal_scores"] += ties
        counts["pairs"] = len(pairs)
        return pairs, counts

    def _process(self, pairs: list[Pair], split: str, counts: dict[str, int]) -> list[PairExample]:
        hp = self.hparams
        if hp.dedup:
            pairs, r = drop_duplicates(pairs)
            counts.update(r)
        if hp.drop_ties:
            pairs, r = drop_ties(pairs)
            counts.update(r)
        else:
            ties = [p for p in pairs if is_tie(p)]
            if ties:
                raise DataError(
                    f"{ties[0].source}, field 'rejected': identical to 'chosen' (a tie; {len(ties)} such pairs "
                    f"in the {split} split); set drop_ties=True to drop them"
                )
        if hp.drop_cycles:
            pairs, r = drop_cycles(pairs)
            counts.update(r)
        else:
            counts["cycles_kept"] = sum(cycle_members(pairs))
        encoder = PairEncoder(
            self.tokenizer,
            max_length=hp.max_length,
            max_prompt_length=hp.max_prompt_length,
            overflow=hp.overflow,
        )
        examples, dropped = [], 0
        for p in pairs:
            chosen = encoder.encode(p.prompt, p.chosen, f"{p.source}, field 'chosen'")
            rejected = encoder.encode(p.prompt, p.rejected, f"{p.source}, field 'rejected'")
            if chosen is None or rejected is None:
                dropped += 1
                continue
            examples.append(PairExample(chosen, rejected, p.margin, p))
        counts["over_max_length"] = dropped
        counts.update({f"sequences_{k}": v for k, v in encoder.counts.items()})
        if split == "train" and hp.length_balance:
            keep, r = balance_lengths(
                [response_length(e.chosen) for e in examples],
                [response_length(e.rejected) for e in examples],
                edges=hp.length_bucket_edges,
                seed=hp.seed,
            )
            examples = [examples[i] for i in keep]
            counts.update(r)
        counts["kept"] = len(examples)
        return examples

    def prepare(self, train: list[Record], val: list[Record] | None) -> tuple[list, list]:
        train_pairs, train_counts = self._parse(train)
        if val is not None:
            val_pairs, val_counts = self._parse(val)
        else:
            prompts = list(dict.fromkeys(p.prompt for p in train_pairs))
            held_out = set(self.hold_out(prompts)[1])
            val_pairs = [p for p in train_pairs if p.prompt in held_out]
            train_pairs = [p for p in train_pairs if p.prompt not in held_out]
            val_counts = {"pairs": len(val_pairs), "held_out_prompts": len(held_out)}
            train_counts["pairs"] = len(train_pairs)
        self.report = {"train": train_counts, "val": val_counts}
        return self._process(train_pairs, "train", train_counts), self._process(val_pairs, "val", val_counts)

    def drops(self) -> dict[str, int]:
        return self.report.get("train", {})

    def collate_fn(self):
        return partial(
            collate_preference,
            pad_id=self.tokenizer.pad_token_id,
            pad_to_multiple_of=self.hparams.pad_to_multiple_of,
        )

    def make_loader(self, data: list[PairExample], batch_size: int, *, shuffle: bool):
        if not self.hparams.group_by_length:
            return super().make_loader(data, batch_size, shuffle=shuffle)
        trainer = self.trainer
        drives = trainer is not None and shuffle and getattr(trainer, "datamodule", None) is self
        return make_loader(
            EpochGroupedBatches(data, batch_size, seed=self.hparams.seed, regroup=shuffle),
            batch_size=1,
            shuffle=shuffle,
            seed=self.hparams.seed,
            collate_fn=partial(
                _collate_batch_of_one,
                pad_id=self.tokenizer.pad_token_id,
                pad_to_multiple_of=self.hparams.pad_to_multiple_of,
            ),
            trainer=trainer,
            num_workers=self.hparams.num_workers,
            yield_epoch=True,
            epoch=trainer.current_epoch if drives else 0,
        )
