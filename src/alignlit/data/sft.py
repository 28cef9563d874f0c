"""DataModules for supervised fine-tuning and for prompt-only (online) stages."""

from __future__ import annotations

from functools import partial

from alignlit.data.args import check_choice
from alignlit.data.base import AlignDataModule, resolve_tokenizer
from alignlit.data.chat import Prompt, encode_conversation, make_prompt, record_messages
from alignlit.data.encoding import OVERFLOW_CHOICES, Overflow, Truncation, check_lengths, collate_lm
from alignlit.data.prompts import PromptTruncation
from alignlit.data.records import Record, parse_prompt, parse_prompt_response

__all__ = ["PromptDataModule", "SFTDataModule"]


class SFTDataModule(AlignDataModule):
    """(prompt, response) pairs for supervised fine-tuning; the loss is on response tokens only.

    Records are in the generic ``{"prompt", "response"}`` format, the HH-RLHF dialogue format
    (``{"chosen": …}`` or ``{"text": …}``, split at the last ``\\n\\nAssistant:``), or a conversation
    ``{"messages": [{"role", "content"}, …]}`` rendered with the tokenizer's chat template, the loss on
    its assistant turns only (each turn's content and end token; :func:`~alignlit.data.chat.encode_conversation`).
    EOS is appended to every ``response``; with ``chat`` the ``prompt`` is rendered as a user message
    (after ``system_prompt``) with the generation prompt, as the online stages render it. Truncations and drops are counted in :attr:`truncation_counts`. The other
    arguments (files or in-memory records, split, tokenizer, batch sizes, seed) are those of
    :class:`~alignlit.data.AlignDataModule`; ``batch_size`` defaults to 32 here.

    Args:
        max_length: longest prompt + response in tokens.
        max_prompt_length: prompts are left-truncated to this many tokens (``< max_length``).
        overflow: what to do when prompt + response exceed ``max_length``: "truncate" the response
            (a conversation from its end), "drop" the example, or raise an "error".
        chat: render ``prompt`` strings with the chat template (a conversation always is).
        system_prompt: a system message put first in every rendered conversation that has none.
    """

    def __init__(
        self,
        train_file: str | None = None,
        *,
        max_length: int = 256,
        max_prompt_length: int = 128,
        overflow: Overflow = "truncate",
        chat: bool = False,
        system_prompt: str | None = None,
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
            if "messages" in rec.fields:
                enc = encode_conversation(
                    self.tokenizer, record_messages(rec), rec.source, max_length=hp.max_length,
                    overflow=hp.overflow, counts=self._truncation.counts, system_prompt=hp.system_prompt,
                )  # fmt: skip
            else:
                prompt, response = parse_prompt_response(rec)
                if hp.chat:
                    prompt = make_prompt(
                        prompt, self.tokenizer, where=f"{rec.source}, field 'prompt'", chat=True,
                        system_prompt=hp.system_prompt,
                    )  # fmt: skip
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


PROMPT_SOURCE_FIELDS = ("prompt", "chosen", "text", "rejected")
"""Fields a prompt is read from; the others travel with it (:attr:`~alignlit.data.Prompt.fields`)."""


def record_prompt(record: Record, tokenizer, *, chat: bool, system_prompt: str | None) -> Prompt:
    """The :class:`~alignlit.data.Prompt` of a prompt record as every stage renders it (its ``prompt``: a string
    or messages; or an HH-RLHF dialogue's prompt), carrying the record's other fields; used by
    :class:`PromptDataModule` and ``alignlit sample``."""
    f = record.fields
    fields = {k: v for k, v in f.items() if k not in PROMPT_SOURCE_FIELDS}
    if "prompt" in f:
        return make_prompt(
            f["prompt"], tokenizer, where=f"{record.source}, field 'prompt'", chat=chat,
            system_prompt=system_prompt, fields=fields, source=record.source,
        )  # fmt: skip
    return make_prompt(
        parse_prompt(record), tokenizer, where=record.source, chat=chat, system_prompt=system_prompt,
        fields=fields, source=record.source,
    )  # fmt: skip


class PromptDataModule(AlignDataModule):
    """Prompts for online stages (PPO, GRPO, online DPO/RRHF), sampling and evaluation.

    Records are ``{"prompt": …}`` (a string, or a list of ``{"role", "content"}`` messages), or
    HH-RLHF dialogues whose prompt is the part up to the last ``\\n\\nAssistant:``. Batches are lists of
    :class:`~alignlit.data.Prompt` strings that carry the record's other columns (e.g. a GSM8K
    ``answer``, which a verifiable reward receives as its ``answer`` argument) and its ``file:row``; the
    rollout engine tokenises them. Message prompts are rendered with the tokenizer's chat template and
    the generation prompt (:mod:`alignlit.data.chat`, the one rendering path of every stage); with
    ``chat`` a string prompt is rendered as one user message, with ``system_prompt`` first. Use
    ``columns`` to map a dataset's fields (``{question: prompt}``). Duplicate prompts are kept.

    With ``max_prompt_length`` set, every prompt goes through the prompt truncation policy: plain text
    keeps its longest fitting suffix (:func:`~alignlit.data.truncate_prompts`); a rendered conversation
    loses whole turns from its start (the system message and the last turn are kept) and is dropped,
    counted, when its last turn alone does not fit. Truncations and drops are counted in
    :attr:`truncation_counts`, printed and logged. The other arguments are those of
    :class:`~alignlit.data.AlignDataModule`; here ``val_fraction`` defaults to 0.

    Args:
        max_prompt_length: the most tokens a prompt may have; None: no limit.
        overflow: for a longer prompt: "truncate" it, "drop" it, or raise an "error".
        chat: render string prompts as a user message with the tokenizer's chat template.
        system_prompt: a system message put before every rendered conversation that has none.
    """

    def __init__(
        self,
        train_file: str | None = None,
        *,
        max_prompt_length: int | None = None,
        overflow: Overflow = "truncate",
        chat: bool = False,
        system_prompt: str | None = None,
        val_fraction: float = 0.0,
        **kwargs,
    ):
        if max_prompt_length is not None:
            PromptTruncation.check(max_prompt_length, overflow, owner=type(self).__name__)
        check_choice("overflow", overflow, OVERFLOW_CHOICES, owner=type(self).__name__)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"{type(self).__name__}: system_prompt must be a string or None")
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
        hp = self.hparams
        return hp.max_prompt_length is not None or hp.chat or hp.system_prompt is not None

    def _prompt(self, record: Record) -> Prompt:
        hp = self.hparams
        if isinstance(record.fields.get("prompt"), list) and self.tokenizer is None:
            self.tokenizer = resolve_tokenizer(self, hp.tokenizer)
        return record_prompt(record, self.tokenizer, chat=hp.chat, system_prompt=hp.system_prompt)

    def encode(self, records: list[Record], split: str) -> list[str]:
        hp = self.hparams
        prompts = [self._prompt(r) for r in records]
        if hp.max_prompt_length is None:
            return prompts
        if self._truncation is None:
            self._truncation = PromptTruncation(self.tokenizer, hp.max_prompt_length, hp.overflow)
        kept = [self._truncation(p, p.source or "prompt") for p in prompts]
        self.truncation_counts = dict(self._truncation.counts)
        return [p for p in kept if p is not None]

    def drops(self) -> dict[str, int]:
        return self.truncation_counts

    def collate_fn(self):
        return _collate_prompts
