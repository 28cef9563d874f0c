"""Ranked responses for RRHF: k responses per prompt, each with a reward (algorithms.md §7)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch

from alignlit.data.base import AlignDataModule
from alignlit.data.encoding import Encoded, Overflow, Truncation, check_lengths, pad_right
from alignlit.data.pairs_from_rm import RankedGroup
from alignlit.data.records import DataError, Record


@dataclass
class RankingExample:
    """One prompt's ``k`` encoded responses (prompt + response + EOS each) and their rewards."""

    encoded: list[Encoded]
    rewards: list[float]
    prompt: str
    responses: list[str]


@dataclass
class RankingBatch:
    """``B`` prompts with ``k`` responses each, flattened prompt-major and right-padded.

    Attributes:
        input_ids: (B·k, T) long; row ``b·k + i`` is response ``i`` of prompt ``b``.
        attention_mask: (B·k, T) bool, True on real tokens.
        loss_mask: (B·k, T) bool, True on response tokens.
        rewards: (B, k) float, the reward of each response.
        prompts: (B,) prompt strings.
        responses: (B, k) response strings.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rewards: torch.Tensor
    prompts: list[str]
    responses: list[list[str]]

    @property
    def k(self) -> int:
        return self.rewards.shape[1]

    def __len__(self) -> int:
        return self.rewards.shape[0]


def collate_ranking(examples: list[RankingExample], pad_id: int) -> RankingBatch:
    """Stack examples that all have the same ``k`` into a :class:`RankingBatch`."""
    ks = {len(e.encoded) for e in examples}
    if len(ks) != 1:
        raise ValueError(
            f"every prompt of a ranking batch needs the same number of responses, got {sorted(ks)}"
        )
    flat = [enc for e in examples for enc in e.encoded]
    ids, attn = pad_right([enc.input_ids for enc in flat], pad_id)  # (B·k, T)
    positions = torch.arange(ids.shape[1])[None, :]
    prompt_len = torch.tensor([enc.prompt_length for enc in flat])[:, None]  # (B·k, 1)
    return RankingBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=attn & (positions >= prompt_len),
        rewards=torch.tensor([e.rewards for e in examples], dtype=torch.float32),  # (B, k)
        prompts=[e.prompt for e in examples],
        responses=[e.responses for e in examples],
    )


class RankingDataModule(AlignDataModule):
    """Prompts with ``k`` scored responses each, for RRHF.

    Records are ``{"prompt", "responses": [...], "scores": [...]}`` (what ``alignlit sample`` writes;
    responses from any source work: policy samples, dataset responses, other models); scores must be
    finite numbers. Every record holds ``k = num_responses`` responses (default: the most any training
    record has; ``k >= 2``); records with fewer (e.g. blank samples left out by ``alignlit sample``)
    are dropped, and so are records with a blank response or one the truncation policy drops; every
    drop is counted in :attr:`counts` and logged, as are truncations. EOS is appended to every
    response. The other arguments are those of :class:`~alignlit.data.AlignDataModule`; ``batch_size``
    (prompts per batch, each with ``k`` responses) defaults to 8 here.

    Args:
        max_length: longest prompt + response in tokens.
        max_prompt_length: prompts are left-truncated to this many tokens (``< max_length``).
        overflow: when prompt + response exceed ``max_length``: "truncate" the response, "drop" the
            record, or raise an "error".
        num_responses: ``k``, responses per prompt (None: the most any training record has); a record
            with more is an error.
    """

    def __init__(
        self,
        train_file: str | None = None,
        *,
        max_length: int = 256,
        max_prompt_length: int = 128,
        overflow: Overflow = "truncate",
        num_responses: int | None = None,
        batch_size: int = 8,
        **kwargs,
    ):
        name = type(self).__name__
        check_lengths(max_length, max_prompt_length, overflow, owner=name)
        if num_responses is not None and (
            isinstance(num_responses, bool) or not isinstance(num_responses, int)
        ):
            raise ValueError(f"{name}: num_responses must be an integer >= 2 or None, got {num_responses!r}")
        if num_responses is not None and num_responses < 2:
            raise ValueError(
                f"{name}: RRHF needs at least 2 responses per prompt, got num_responses={num_responses}"
            )
        super().__init__(train_file, batch_size=batch_size, **kwargs)
        self.counts: Counter[str] = Counter()
        self.k: int | None = None
        self._dropped: Counter[str] = Counter()
        self._truncation: Truncation | None = None

    def encode(self, records: list[Record], split: str) -> list[RankingExample]:
        hp = self.hparams
        groups = [RankedGroup.from_record(r) for r in records]
        if split == "train":
            self.k = hp.num_responses or max((len(g.responses) for g in groups), default=0)
            if self.k < 2:
                raise DataError(
                    f"{self.train_source}: RRHF needs at least 2 responses per prompt, got num_responses={self.k}"
                )
        if self._truncation is None:
            self._truncation = Truncation(
                self.tokenizer,
                max_length=hp.max_length,
                max_prompt_length=hp.max_prompt_length,
                overflow=hp.overflow,
            )
        out = []
        for group in groups:
            if len(group.responses) > self.k:
                raise DataError(
                    f"{group.source}, field 'responses': has {len(group.responses)} responses, more than "
                    f"num_responses={self.k}"
                )
            if len(group.responses) < self.k:
                self._dropped["dropped_fewer_than_k_responses"] += 1
                continue
            if any(not r.strip() for r in group.responses):
                self._dropped["dropped_blank_response"] += 1
                continue
            encoded = [self._truncation.encode(group.prompt, r, group.source) for r in group.responses]
            if any(e is None for e in encoded):
                self._dropped["dropped_over_max_length"] += 1
                continue
            out.append(RankingExample(encoded, group.scores, group.prompt, group.responses))
        self.counts = self._dropped + self._truncation.counts
        return out

    def drops(self) -> dict[str, int]:
        return dict(self.counts)

    def collate_fn(self):
        return partial(collate_ranking, pad_id=self.tokenizer.pad_token_id)
