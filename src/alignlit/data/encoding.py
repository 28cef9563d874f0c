"""Tokenising (prompt, response) pairs with an explicit truncation policy, and batch collation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

import torch

from alignlit.data.args import check_choice, check_int
from alignlit.data.records import DataError

Overflow = Literal["truncate", "drop", "error"]
OVERFLOW_CHOICES = ("truncate", "drop", "error")


def check_lengths(max_length: int, max_prompt_length: int, overflow: str, *, owner: str = "") -> None:
    """``1 <= max_prompt_length < max_length`` (integers) and a known ``overflow``; ValueError otherwise."""
    check_int("max_length", max_length, 2, owner=owner)
    check_int("max_prompt_length", max_prompt_length, 1, owner=owner)
    if max_prompt_length >= max_length:
        raise ValueError(
            f"{owner}{': ' if owner else ''}max_prompt_length ({max_prompt_length}) must be < max_length "
            f"({max_length})"
        )
    check_choice("overflow", overflow, OVERFLOW_CHOICES, owner=owner)


@dataclass
class Encoded:
    """Token ids of ``prompt + response (+ EOS)`` and where the response starts; a conversation
    (:func:`alignlit.data.chat.encode_conversation`) also has a per-token ``loss_mask`` (its assistant
    turns), which then takes the place of "every token from ``prompt_length`` on"."""

    input_ids: list[int]
    prompt_length: int
    loss_mask: list[bool] | None = None


def max_token_chars(tokenizer) -> int:
    """The most characters of text any one token of ``tokenizer``'s vocabulary stands for (an upper
    bound: vocabulary strings of byte-level and WordPiece tokenizers are at least as long as their text)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def token_ids(tokenizer, text: str, where: str) -> list[int]:
    """Token ids of ``text`` without special tokens; a :class:`DataError` naming ``where`` for a
    non-string or for text the tokenizer refuses (a lone surrogate, ``"\\ud800"``)."""
    if not isinstance(text, str):
        raise DataError(f"{where}: expected a string, got {type(text).__name__}")
    try:
        return tokenizer(text, add_special_tokens=False).input_ids
    except TypeError as e:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            problem = "holds a lone surrogate (an unpaired \\ud800-\\udfff), which is not valid Unicode text"
        else:
            problem = f"the tokenizer refuses it ({e})"
        raise DataError(f"{where}: {problem}") from e


class Truncation:
    """The truncation policy, applied the same way by every DataModule.

    Prompts longer than ``max_prompt_length`` lose tokens from the left (the start of the
    dialogue), so the most recent turn survives. The response is kept whole; if prompt + response
    still exceed ``max_length``: ``overflow="truncate"`` cuts the response from the right (it then
    has no EOS), ``"drop"`` drops the example, ``"error"`` raises naming the row. Every truncation
    and drop is counted in :attr:`counts` so DataModules can report them.

    Arguments are checked at construction (``1 <= max_prompt_length < max_length``). A pathological
    text is never tokenised whole: of a prompt only the last, of a response only the first
    ``(limit + 16) * L`` characters are (``L``: the longest text one token stands for), which
    already hold more tokens than the limit.
    """

    def __init__(
        self, tokenizer, *, max_length: int, max_prompt_length: int, overflow: Overflow = "truncate"
    ):
        check_lengths(max_length, max_prompt_length, overflow, owner="Truncation")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self.overflow = overflow
        self.counts: Counter[str] = Counter()
        self._chars = max_token_chars(tokenizer)

    def encode_prompt(self, prompt: str, source: str = "prompt") -> list[int]:
        window = (self.max_prompt_length + 16) * self._chars
        ids = token_ids(self.tokenizer, prompt[-window:] if isinstance(prompt, str) else prompt, source)
        if len(ids) > self.max_prompt_length or len(prompt) > window:
            self.counts["prompts_left_truncated"] += 1
            ids = ids[-self.max_prompt_length :]
        return ids

    def encode(
        self, prompt: str, response: str, source: str, *, add_eos: bool = True, allow_empty: bool = False
    ) -> Encoded | None:
        """Encode one pair; None when the policy drops it. An empty response is an error in data
        (``allow_empty=False``); scoring a policy's sample that ended at once passes ``allow_empty``."""
        prompt_ids = self.encode_prompt(prompt, source)
        window = (self.max_length + 16) * self._chars
        response_ids = token_ids(
            self.tokenizer, response[:window] if isinstance(response, str) else response, source
        )
        if not response_ids and not allow_empty:
            raise DataError(f"{source}: response tokenises to nothing")
        if add_eos:
            response_ids = [*response_ids, self.tokenizer.eos_token_id]
        budget = self.max_length - len(prompt_ids)
        if len(response_ids) > budget:
            if self.overflow == "error":
                more = "more than " if len(response) > window else ""
                raise DataError(
                    f"{source}: prompt ({len(prompt_ids)} tokens after truncation) + response "
                    f"({more}{len(response_ids)} tokens) exceed max_length={self.max_length}"
                )
            if self.overflow == "drop":
                self.counts["dropped_over_max_length"] += 1
                return None
            self.counts["responses_right_truncated"] += 1
            response_ids = response_ids[:budget]
        return Encoded(prompt_ids + response_ids, len(prompt_ids))


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists: (ids (B, T) long, mask (B, T) bool)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = True
    return ids, mask


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists (for generation): (ids (B, T) long, mask (B, T) bool)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = True
    return ids, mask


@dataclass
class LMBatch:
    """A right-padded batch of prompt + response sequences.

    Attributes:
        input_ids: (B, T) long.
        attention_mask: (B, T) bool, True on real tokens.
        loss_mask: (B, T) bool, True on response tokens (the ones the loss is taken over).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def collate_lm(examples: list[Encoded], pad_id: int) -> LMBatch:
    ids, attn = pad_right([e.input_ids for e in examples], pad_id)
    positions = torch.arange(ids.shape[1])[None, :]
    prompt_len = torch.tensor([e.prompt_length for e in examples])[:, None]
    loss_mask = attn & (positions >= prompt_len)
    for i, e in enumerate(examples):
        if e.loss_mask is not None:
            loss_mask[i, : len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.bool)
    return LMBatch(ids, attn, loss_mask)
