"""DataModules for supervised fine-tuning and for prompt-only (online) stages."""

from __future__ import annotations

from functools import partial

from alignlit.data.args import check_choice
from alignlit.data.base import AlignDataModule
from alignlit.data.encoding import OVERFLOW_CHOICES, Overflow, Truncation, check_lengths, collate_lm
from alignlit.data.prompts import PromptTruncation
from alignlit.data.records import Record, parse_prompt, parse_prompt_response

__all__ = ["PromptDataModule", "SFTDataModule"]


class SFTDataModule(AlignDataModule):
    """(prompt, response) pairs for supervised fine-tuning; the loss is on response tokens only.

    Records are in the generic ``{"prompt", "response"}`` format or the HH-RLHF dialogue format
    (``{"chosen": …}`` or ``{"text": …}``, split at the last ``\\n\\nAssistant:``). EOS is appended to
    every response. Truncations and drops are counted in :attr:`truncation_counts`. The other
    arguments (files or in-memory records, split, tokenizer, batch sizes, seed) are those of
    :class:`~alignlit.data.AlignDataModule`; ``batch_size`` defaults to 32 here.

    Args:
        max_length: longest prompt + response in tokens.
        max_prompt_length: prompts are left-truncated to this many tokens (``< max_length``).
        overflow: what to do when prompt + response exceed ``max_length``: "truncate" the response,
            "drop" the example, or raise an "error".
    """

    def __init__(
        self,
        train_file: str | None = None,
        *,
        max_length: int = 256,
        max_prompt_length: int = 128,
        overflow: Overflow = "truncate",
        batch_size: int = 32,
        **kwargs,
    ):
        check_lengths(max_length, max_prompt_length, overflow, owner=type(self).__name__)
        super().__init__(train_file, batch_size=batch_size, **kwargs)
        self.truncation_counts: dict[str, int] = {}
        self._truncation: Truncation | None = None

    def encode(self, records: list[Record], split: str) -> list:
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
            prompt, response = parse_prompt_response(rec)
            enc = self._truncation.encode(prompt, response, rec.source)
            if enc is not None:
                out.append(enc)
        self.truncation_counts = dict(self._truncation.counts)
        return out

    def drops(self) -> dict[str, int]:
        return self.truncation_counts

    def collate_fn(self):
        return partial(collate_lm, pad_id=self.tokenizer.pad_token_id)


def _collate_prompts(prompts: list[str]) -> list[str]:
    return list(prompts)


class PromptDataModule(AlignDataModule):
    """Prompts for online stages (PPO, online DPO/RRHF) and for sampling.

    Records are ``{"prompt": …}``, or any record with a ``prompt`` field, or HH-RLHF dialogues
    whose prompt is the part up to the last ``\\n\\nAssistant:``. Batches are lists of prompt
    strings; the rollout engine tokenises them. Duplicate prompts are kept (they are sampled
    more often, as in the data). With ``max_prompt_length`` set, every prompt goes through the prompt
    truncation policy (:func:`~alignlit.data.truncate_prompts`: the longest suffix that fits, starting
    at a turn boundary when it holds one); truncations and drops are counted in
    :attr:`truncation_counts` and logged. The other arguments are those of
    :class:`~alignlit.data.AlignDataModule`; here ``val_fraction`` defaults to 0 and the tokenizer is
    needed only for ``max_prompt_length``.

    Args:
        max_prompt_length: the most tokens (without special tokens) a prompt may have; None: no limit.
        overflow: for a longer prompt: "truncate" it from the left, "drop" it, or raise an "error".
    """

    def __init__(
        self,
        train_file: str | None = None,
        *,
        max_prompt_length: int | None = None,
        overflow: Overflow = "truncate",
        val_fraction: float = 0.0,
        **kwargs,
    ):
        if max_prompt_length is not None:
            PromptTruncation.check(max_prompt_length, overflow, owner=type(self).__name__)
        check_choice("overflow", overflow, OVERFLOW_CHOICES, owner=type(self).__name__)
        super().__init__(train_file, val_fraction=val_fraction, **kwargs)
        self.truncation_counts: dict[str, int] = {}
        self._truncation: PromptTruncation | None = None

    @property
    def train_prompts(self) -> list[str]:
        return self.train_set

    @train_prompts.setter
    def train_prompts(self, prompts: list[str]) -> None:
        self.train_set = prompts

    @property
    def val_prompts(self) -> list[str]:
        return self.val_set

    @val_prompts.setter
    def val_prompts(self, prompts: list[str]) -> None:
        self.val_set = prompts

    def uses_tokenizer(self) -> bool:
        return self.hparams.max_prompt_length is not None

    def encode(self, records: list[Record], split: str) -> list[str]:
        hp = self.hparams
        prompts = [(parse_prompt(r), r.source) for r in records]
        if hp.max_prompt_length is None:
            return [p for p, _ in prompts]
        if self._truncation is None:
            self._truncation = PromptTruncation(self.tokenizer, hp.max_prompt_length, hp.overflow)
        kept = [self._truncation(p, source) for p, source in prompts]
        self.truncation_counts = dict(self._truncation.counts)
        return [p for p in kept if p is not None]

    def drops(self) -> dict[str, int]:
        return self.truncation_counts

    def collate_fn(self):
        return _collate_prompts
