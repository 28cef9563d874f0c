"""Ranked responses for RRHF: k responses per prompt, each with a reward (algorithms.md §7)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import partial

import lightning as L
import torch

from alignlit.data.encoding import Encoded, Overflow, Truncation, pad_right
from alignlit.data.pairs_from_rm import RankedGroup
from alignlit.data.records import DataError
from alignlit.data.sampler import make_loader
from alignlit.data.sft import read_split, resolve_tokenizer

log = logging.getLogger(__name__)


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


class RankingDataModule(L.LightningDataModule):
    """Prompts with ``k`` scored responses each, for RRHF.

    Records are ``{"prompt", "responses": [...], "scores": [...]}`` (what ``alignlit sample`` writes;
    responses from any source work: policy samples, dataset responses, other models). Every record
    holds ``k = num_responses`` responses (default: the most any training record has; ``k >= 2``);
    records with fewer (e.g. blank samples left out by ``alignlit sample``) are dropped, and so are
    records with a blank response or one the truncation policy drops; every drop is counted in
    :attr:`counts` and logged, as are truncations. EOS is appended to every response.

    Args:
        train_file: ranked records.
        val_file: held-out ranked records; if None, ``val_fraction`` of ``train_file`` is held out.
        val_fraction: held-out fraction when there is no ``val_file``.
        tokenizer: tokenizer directory; default: the policy's tokenizer.
        max_length: longest prompt + response in tokens.
        max_prompt_length: prompts are left-truncated to this many tokens.
        overflow: when prompt + response exceed ``max_length``: "truncate" the response, "drop" the
            record, or raise an "error".
        batch_size: prompts per training batch (each with ``k`` responses).
        eval_batch_size: prompts per validation batch (default: ``batch_size``).
        num_responses: ``k``, responses per prompt (None: the most any training record has); a record
            with more is an error.
        max_examples: use only the first N training records.
        seed: seed of the split and of the shuffling.
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
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_responses: int | None = None,
        max_examples: int | None = None,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = None
        self.train_set: list[RankingExample] = []
        self.val_set: list[RankingExample] = []
        self.counts: Counter[str] = Counter()
        self.k: int | None = None

    def _encode(self, groups: list[RankedGroup], trunc: Truncation, k: int) -> list[RankingExample]:
        out = []
        for group in groups:
            if len(group.responses) > k:
                raise DataError(
                    f"{group.source}, field 'responses': has {len(group.responses)} responses, more than "
                    f"num_responses={k}"
                )
            if len(group.responses) < k:
                self.counts["dropped_fewer_than_k_responses"] += 1
                continue
            if any(not r.strip() for r in group.responses):
                self.counts["dropped_blank_response"] += 1
                continue
            encoded = [trunc.encode(group.prompt, r, group.source) for r in group.responses]
            if any(e is None for e in encoded):
                self.counts["dropped_over_max_length"] += 1
                continue
            out.append(RankingExample(encoded, group.scores, group.prompt, group.responses))
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
        train_groups = [RankedGroup.from_record(r) for r in train_recs]
        val_groups = [RankedGroup.from_record(r) for r in val_recs]
        k = hp.num_responses or max((len(g.responses) for g in train_groups), default=0)
        if k < 2:
            raise DataError(
                f"{hp.train_file}: RRHF needs at least 2 responses per prompt, got num_responses={k}"
            )
        self.k = k
        self.train_set = self._encode(train_groups, trunc, k)
        self.val_set = self._encode(val_groups, trunc, k)
        if not self.train_set:
            raise ValueError(f"{hp.train_file}: no training records left after dropping blank/overlong ones")
        self.counts.update(trunc.counts)
        log.info(
            "ranking data: %d train / %d val prompts, k=%d responses each; drops/truncation: %s",
            len(self.train_set),
            len(self.val_set),
            k,
            dict(self.counts) or "none",
        )

    def _loader(self, data, batch_size, shuffle):
        return make_loader(
            data,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=self.hparams.seed,
            collate_fn=partial(collate_ranking, pad_id=self.tokenizer.pad_token_id),
            trainer=self.trainer,
        )

    def train_dataloader(self):
        return self._loader(self.train_set, self.hparams.batch_size, True)

    def val_dataloader(self):
        if not self.val_set:
            return []
        return self._loader(self.val_set, self.hparams.eval_batch_size or self.hparams.batch_size, False)
