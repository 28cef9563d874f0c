"""Unpaired feedback for KTO: ``{"prompt", "completion", "label": true|false}`` records (TRL's unpaired
format), or preference pairs split into one desirable and one undesirable example each (``from_pairs``).

A batch holds each example's ``prompt + completion`` and, for KTO's reference point, a *mismatched*
sequence per example: its prompt with the completion of the example before it in the batch (the first
takes the last one's), the completion cut from the right to ``max_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from alignlit.data.base import AlignDataModule
from alignlit.data.chat import make_prompt
from alignlit.data.encoding import Encoded, LMBatch, Overflow, Truncation, check_lengths, collate_lm
from alignlit.data.pair_records import parse_pairs
from alignlit.data.records import Record


@dataclass
class UnpairedExample:
    prompt_ids: list[int]
    completion_ids: list[int]  # EOS included
    desirable: bool


@dataclass
class UnpairedBatch:
    """``matched``: (B, T) prompt + own completion; ``mismatched``: (B, T') prompt + the previous example's
    completion; ``desirable``: (B,) bool."""

    matched: LMBatch
    mismatched: LMBatch
    desirable: torch.Tensor

    def __len__(self) -> int:
        return len(self.desirable)


def collate_unpaired(examples: list[UnpairedExample], pad_id: int, max_length: int) -> UnpairedBatch:
    def encoded(prompt: list[int], completion: list[int]) -> Encoded:
        return Encoded((prompt + completion)[:max_length], len(prompt))

    matched = [encoded(e.prompt_ids, e.completion_ids) for e in examples]
    shifted = [examples[i - 1].completion_ids for i in range(len(examples))]  # i = 0 takes the last one's
    mismatched = [encoded(e.prompt_ids, c) for e, c in zip(examples, shifted)]
    desirable = torch.tensor([e.desirable for e in examples], dtype=torch.bool)
    return UnpairedBatch(collate_lm(matched, pad_id), collate_lm(mismatched, pad_id), desirable)


class UnpairedDataModule(AlignDataModule):
    """Unpaired examples for :class:`~alignlit.modules.KTOModule`.

    Records: ``{"prompt", "completion", "label"}`` with a boolean ``label`` (a prompt may be a string or a
    list of messages, rendered with the chat template; ``chat`` renders strings as a user message too); with
    ``from_pairs``, any preference format :class:`~alignlit.data.PreferenceDataModule` reads, each pair
    giving its chosen response as a desirable and its rejected one as an undesirable example. The other
    arguments are those of :class:`~alignlit.data.AlignDataModule`.

    Args:
        max_length: longest prompt + completion in tokens.
        max_prompt_length: prompts are left-truncated to this many tokens (``< max_length``).
        overflow: when prompt + completion exceed ``max_length``: "truncate" the completion, "drop" the
            example, or raise an "error".
        from_pairs: read preference pairs and split each into two unpaired examples.
        chat: render string prompts with the tokenizer's chat template.
        system_prompt: a system message before every rendered prompt.
    """

    def __init__(
        self,
        train_file: str | None = None,
        *,
        max_length: int = 256,
        max_prompt_length: int = 128,
        overflow: Overflow = "truncate",
        from_pairs: bool = False,
        chat: bool = False,
        system_prompt: str | None = None,
        batch_size: int = 16,
        **kwargs,
    ):
        check_lengths(max_length, max_prompt_length, overflow, owner=type(self).__name__)
        super().__init__(train_file, batch_size=batch_size, **kwargs)
        self.truncation_counts: dict[str, int] = {}
        self._truncation: Truncation | None = None

    def _examples(self, record: Record) -> list[tuple[str, str, bool, str]]:
        hp = self.hparams
        if hp.from_pairs:
            pairs, _ = parse_pairs(record, self.tokenizer)
            return [
                (p.prompt, r, good, p.source)
                for p in pairs
                for r, good in ((p.chosen, True), (p.rejected, False))
            ]
        label = record.fields.get("label")
        if not isinstance(label, bool):
            raise record.error(
                "label", f"expected true or false, got {label!r} (from_pairs: true reads preference pairs)"
            )
        completion = record.text("completion")
        if "prompt" not in record.fields:
            raise record.error("prompt", f"missing (record has {sorted(record.fields)})")
        return [(record.fields["prompt"], completion, label, record.source)]

    def encode(self, records: list[Record], split: str) -> list[UnpairedExample]:
        hp = self.hparams
        if self._truncation is None:
            self._truncation = Truncation(
                self.tokenizer,
                max_length=hp.max_length,
                max_prompt_length=hp.max_prompt_length,
                overflow=hp.overflow,
            )
        out = []
        for rec in records:
            for prompt, completion, good, source in self._examples(rec):
                if not isinstance(prompt, str) or hp.chat:
                    prompt = make_prompt(
                        prompt, self.tokenizer, where=f"{source}, field 'prompt'", chat=hp.chat,
                        system_prompt=hp.system_prompt,
                    )  # fmt: skip
                enc = self._truncation.encode(prompt, completion, source)
                if enc is not None:
                    ids = enc.input_ids
                    out.append(UnpairedExample(ids[: enc.prompt_length], ids[enc.prompt_length :], good))
        self.truncation_counts = dict(self._truncation.counts)
        return out

    def drops(self) -> dict[str, int]:
        return self.truncation_counts

    def collate_fn(self):
        return partial(
            collate_unpaired, pad_id=self.tokenizer.pad_token_id, max_length=self.hparams.max_length
        )
