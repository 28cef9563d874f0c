"""Preference pairs: record formats, the reward-model sequence layout, batches and the DataModule.

Formats (one record per line/row):

- HH-RLHF ``{"chosen": dialogue, "rejected": dialogue}``: the prompt is the shared prefix up to the
  last ``\\n\\nAssistant:``; the two prefixes must be equal.
- generic ``{"prompt", "chosen", "rejected"[, "margin"]}``.
- ranked ``{"prompt", "responses": [...], "scores": [...]}``: every two responses with different
  scores give a pair (higher score chosen); equal scores are ties and give no pair (counted).
- conversational ``{"chosen": [messages], "rejected": [messages]}``: the prompt is the shared
  message prefix, the responses are the last (assistant) messages.

A prompt may be a string or a list of ``{"role", "content"}`` messages; messages are rendered with
the tokenizer's chat template (``add_generation_prompt=True``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from alignlit.data.args import check_int, number_problem
from alignlit.data.base import AlignDataModule
from alignlit.data.encoding import Encoded, LMBatch, Overflow, Truncation, check_lengths, pad_right
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
from alignlit.data.records import HH_ASSISTANT, DataError, Record
from alignlit.data.sampler import make_loader

log = logging.getLogger(__name__)


class PairError(DataError):
    """A preference record that cannot give a pair; ``reason`` names the kind of problem."""

    def __init__(self, record: Record, field: str | None, problem: str, reason: str):
        super().__init__(str(record.error(field, problem)))
        self.reason = reason


def _text(record: Record, field: str) -> str:
    f = record.fields
    if field not in f:
        raise PairError(record, field, f"missing (record has {sorted(f)})", "missing_field")
    value = f[field]
    if not isinstance(value, str):
        raise PairError(record, field, f"expected a string, got {type(value).__name__}", "bad_type")
    if not value.strip():
        raise PairError(record, field, "is empty", "empty_response")
    return value


def _messages(record: Record, field: str, value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise PairError(record, field, "expected a non-empty list of messages", "bad_type")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise PairError(
                record, field, f"message {i} is not a {{'role', 'content'}} object of strings", "bad_type"
            )
    return value


def render_prompt(prompt: str | list[dict[str, str]], tokenizer, where: str = "prompt") -> str:
    """A prompt string as the model sees it: strings as they are, message lists through the
    tokenizer's chat template with the generation prompt appended."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: a list of messages needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def _render(record: Record, field: str, messages: list[dict[str, str]], tokenizer) -> str:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise PairError(
            record, field, "a list of messages needs a tokenizer with a chat template", "no_chat_template"
        )
    return render_prompt(messages, tokenizer)


def _prompt(record: Record, tokenizer) -> str:
    value = record.fields.get("prompt")
    if isinstance(value, list):
        return _render(record, "prompt", _messages(record, "prompt", value), tokenizer)
    return _text(record, "prompt")


def _margin(record: Record) -> float:
    value = record.fields.get("margin", 0.0)
    if value is None:
        return 0.0
    problem = number_problem(value)
    if problem is not None or value < 0:
        shown = "an integer too large for a float" if problem and "too large" in problem else repr(value)
        raise PairError(record, "margin", f"expected a number >= 0 (finite), got {shown}", "bad_margin")
    return float(value)


def _hh_pair(record: Record) -> Pair:
    parts = {}
    for field in ("chosen", "rejected"):
        text = _text(record, field)
        cut = text.rfind(HH_ASSISTANT)
        if cut < 0:
            raise PairError(record, field, "not in HH-RLHF format: no '\\n\\nAssistant:' turn", "not_hh")
        cut += len(HH_ASSISTANT)
        if not text[cut:].strip():
            raise PairError(record, field, "the last Assistant turn is empty", "empty_response")
        parts[field] = (text[:cut], text[cut:])
    if parts["chosen"][0] != parts["rejected"][0]:
        raise PairError(
            record,
            "rejected",
            "its dialogue before the last Assistant turn differs from 'chosen' (no shared prompt)",
            "prompt_mismatch",
        )
    return Pair(parts["chosen"][0], parts["chosen"][1], parts["rejected"][1], _margin(record), record.source)


def _conversation_pair(record: Record, tokenizer) -> Pair:
    convs = {f: _messages(record, f, record.fields[f]) for f in ("chosen", "rejected")}
    if convs["chosen"][:-1] != convs["rejected"][:-1]:
        raise PairError(
            record, "rejected", "its messages before the last one differ from 'chosen'", "prompt_mismatch"
        )
    responses = {}
    for f, conv in convs.items():
        if conv[-1]["role"] != "assistant":
            raise PairError(
                record, f, f"the last message has role {conv[-1]['role']!r}, not 'assistant'", "bad_type"
            )
        if not conv[-1]["content"].strip():
            raise PairError(record, f, "the last message is empty", "empty_response")
        responses[f] = conv[-1]["content"]
    if len(convs["chosen"]) < 2:
        raise PairError(
            record, "chosen", "a conversation needs at least one message before the response", "bad_type"
        )
    prompt = _render(record, "chosen", convs["chosen"][:-1], tokenizer)
    return Pair(prompt, responses["chosen"], responses["rejected"], _margin(record), record.source)


def _ranked_pairs(record: Record, tokenizer, ranked_margin: bool) -> tuple[list[Pair], int]:
    prompt = _prompt(record, tokenizer)
    responses, scores = record.fields["responses"], record.fields.get("scores")
    if not isinstance(responses, list) or len(responses) < 2:
        raise PairError(record, "responses", "expected a list of at least two responses", "bad_type")
    if not isinstance(scores, list) or len(scores) != len(responses):
        raise PairError(
            record,
            "scores",
            f"expected a list of {len(responses)} numbers (one per response), got {scores!r}",
            "bad_type" if "scores" in record.fields else "missing_field",
        )
    for i, (r, s) in enumerate(zip(responses, scores, strict=True)):
        if not isinstance(r, str) or not r.strip():
            raise PairError(record, "responses", f"response {i} is empty or not a string", "empty_response")
        problem = number_problem(s)
        if problem is not None:
            raise PairError(record, "scores", f"score {i} {problem}", "bad_type")
    pairs, ties = [], 0
    for i in range(len(responses)):
        for j in range(i + 1, len(responses)):
            if scores[i] == scores[j]:
                ties += 1
                continue
            w, lo = (i, j) if scores[i] > scores[j] else (j, i)
            margin = float(scores[w] - scores[lo]) if ranked_margin else 0.0
            pairs.append(Pair(prompt, responses[w], responses[lo], margin, record.source))
    return pairs, ties


def parse_pairs(record: Record, tokenizer=None, *, ranked_margin: bool = False) -> tuple[list[Pair], int]:
    """The preference pairs of one record (any supported format) and the number of ranked ties
    (pairs of equal score, which give no pair).

    Raises :class:`PairError` (a :class:`DataError` naming file:row and field) on a malformed record.
    ``ranked_margin``: for ranked records use the score difference as the pair's margin.
    """
    f = record.fields
    if "responses" in f:
        return _ranked_pairs(record, tokenizer, ranked_margin)
    if "prompt" in f:
        prompt = _prompt(record, tokenizer)
        return [
            Pair(prompt, _text(record, "chosen"), _text(record, "rejected"), _margin(record), record.source)
        ], 0
    if "chosen" in f and "rejected" in f:
        if isinstance(f["chosen"], list) or isinstance(f["rejected"], list):
            return [_conversation_pair(record, tokenizer)], 0
        return [_hh_pair(record)], 0
    raise PairError(
        record,
        None,
        "unknown preference format: expected HH-RLHF 'chosen'+'rejected', 'prompt'+'chosen'+'rejected', "
        f"or 'prompt'+'responses'+'scores'; got {sorted(f)}",
        "unknown_format",
    )


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
