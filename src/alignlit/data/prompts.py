"""The truncation policy for prompt-only data: online stages, the sampler and evaluation.

:func:`truncate_prompts` (and :class:`PromptTruncation`, its per-prompt form) keeps every prompt within
``max_prompt_length`` tokens: ``overflow="truncate"`` keeps the longest suffix of the prompt text that
fits (the most recent turn survives; when the kept text holds an HH-RLHF ``\\n\\nHuman:`` turn
boundary, the cut moves forward to it so the prompt starts with a whole turn), ``"drop"`` drops the
prompt, ``"error"`` raises naming its source. Truncations and drops are counted.

The result is always a suffix of the original text (never re-decoded tokens), so nothing is
invented at the cut. A pathological prompt (say 1 MB of text) is never tokenised whole: prompts of
up to :data:`COUNT_CHARS` characters are counted exactly, a longer one counts as over the limit, and
truncation looks only at the last ``(max_prompt_length + 16) * L`` characters, where ``L`` is the
longest text a single token of the vocabulary stands for (they hold more tokens than the limit).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from alignlit.data.args import check_choice, check_int
from alignlit.data.chat import Prompt, render_messages
from alignlit.data.encoding import OVERFLOW_CHOICES, Overflow, max_token_chars, token_ids
from alignlit.data.records import HH_HUMAN, DataError

COUNT_CHARS = 100_000
"""Prompts up to this many characters are tokenised whole to count their tokens (~0.1 s at most)."""


class PromptTruncation:
    """Applies the prompt truncation policy one prompt at a time and counts what it did.

    Args:
        tokenizer: the policy's tokenizer; lengths are counted without special tokens.
        max_prompt_length: the most tokens a prompt may have (>= 1).
        overflow: for a longer prompt: "truncate" (keep the longest fitting suffix), "drop" it, or
            raise an "error".
    """

    def __init__(self, tokenizer, max_prompt_length: int, overflow: Overflow = "truncate"):
        self.check(max_prompt_length, overflow)
        self.tokenizer = tokenizer
        self.max_prompt_length, self.overflow = max_prompt_length, overflow
        self.window = (max_prompt_length + 16) * max_token_chars(tokenizer)
        self.counts: Counter[str] = Counter()

    @staticmethod
    def check(max_prompt_length: int, overflow: str, *, owner: str = "PromptTruncation") -> None:
        """``max_prompt_length >= 1`` (an integer) and a known ``overflow``; ValueError otherwise."""
        check_int("max_prompt_length", max_prompt_length, 1, owner=owner)
        check_choice("overflow", overflow, OVERFLOW_CHOICES, owner=owner)

    def num_tokens(self, text: str, source: str = "prompt") -> int:
        return len(token_ids(self.tokenizer, text, source))

    def __call__(self, prompt: str, source: str = "prompt") -> str | None:
        """The prompt within the limit, or None when the policy drops it. A :class:`~alignlit.data.Prompt`
        keeps its fields; a rendered conversation loses whole turns from its start instead of characters."""
        if not isinstance(prompt, str):
            raise DataError(f"{source}: expected a prompt string, got {type(prompt).__name__}")
        if isinstance(prompt, Prompt) and prompt.templated:
            return self._conversation(prompt, source)
        kept = self._text(prompt, source)
        if isinstance(prompt, Prompt) and kept is not None and kept is not prompt:
            return Prompt(kept, fields=prompt.fields, source=prompt.source)
        return kept

    def _over(self, size: str, source: str) -> None:
        """Raise for overflow 'error'; count a drop for 'drop'."""
        if self.overflow == "error":
            raise DataError(
                f"{source}: the prompt has {size}, more than max_prompt_length={self.max_prompt_length} "
                "tokens (overflow='error')"
            )
        self.counts["prompts_dropped_over_max_length"] += 1

    def _conversation(self, prompt: Prompt, source: str) -> Prompt | None:
        """A rendered conversation within the limit: its earliest non-system turns dropped (up to the next
        user turn) until it fits, the last turn kept; None, counted, when the last turn alone does not fit."""
        n = self.num_tokens(prompt, source)
        if n <= self.max_prompt_length:
            return prompt
        if self.overflow != "truncate":
            self._over(f"{n} tokens", source)
            return None
        messages = list(prompt.messages)
        system = messages[:1] if messages[0]["role"] == "system" else []
        turns = messages[len(system) :]
        while len(turns) > 1:
            turns = turns[1:]
            while len(turns) > 1 and turns[0]["role"] != "user":  # a conversation restarts at a user turn
                turns = turns[1:]
            text = render_messages(self.tokenizer, system + turns, generation_prompt=True)
            if self.num_tokens(text, source) <= self.max_prompt_length:
                self.counts["prompts_left_truncated"] += 1
                return Prompt(text, fields=prompt.fields, source=prompt.source, messages=system + turns)
        self.counts["prompts_dropped_over_max_length"] += 1
        return None

    def _text(self, prompt: str, source: str) -> str | None:
        if len(prompt) <= max(COUNT_CHARS, self.window):
            n = self.num_tokens(prompt, source)
            if n <= self.max_prompt_length:
                return prompt
            size = f"{n} tokens"
        else:
            size = f"{len(prompt)} characters (too long to tokenise whole)"
        if self.overflow != "truncate":
            self._over(size, source)
            return None
        kept = self._longest_fitting_suffix(prompt[-self.window :])
        if not kept:
            raise DataError(
                f"{source}: not even the prompt's last character fits in max_prompt_length="
                f"{self.max_prompt_length} tokens"
            )
        self.counts["prompts_left_truncated"] += 1
        return kept

    def _longest_fitting_suffix(self, text: str) -> str:
        """The longest suffix of ``text`` of at most ``max_prompt_length`` tokens (binary search over
        the cut; the answer is checked, so it fits even where token counts are not monotone), moved
        forward to the first turn boundary inside it."""
        lo, hi = 0, len(text)  # text[hi:] fits (empty); text[lo:] is the candidate
        while lo < hi:
            mid = (lo + hi) // 2
            if self.num_tokens(text[mid:]) <= self.max_prompt_length:
                hi = mid
            else:
                lo = mid + 1
        kept = text[hi:]
        turn = kept.find(HH_HUMAN)
        return kept[turn:] if turn > 0 else kept


def truncate_prompts(
    tokenizer,
    prompts: Sequence[str],
    max_prompt_length: int,
    overflow: Overflow = "truncate",
    *,
    sources: Sequence[str] | None = None,
) -> tuple[list[str], dict[str, int]]:
    """Apply the prompt truncation policy (see :mod:`alignlit.data.prompts`) to ``prompts``.

    Args:
        tokenizer: the policy's tokenizer.
        prompts: prompt strings.
        max_prompt_length: the most tokens (without special tokens) a prompt may keep.
        overflow: "truncate", "drop" or "error" for a longer prompt.
        sources: where each prompt came from (``file:row``), for error messages; default ``prompts[i]``.

    Returns:
        ``(prompts, counts)``: the kept prompts in order (dropped ones left out) and
        ``{"prompts", "prompts_left_truncated", "prompts_dropped_over_max_length"}``.
    """
    if isinstance(prompts, str):
        raise ValueError("prompts must be a sequence of strings, got a single string")
    if sources is not None and len(sources) != len(prompts):
        raise ValueError(f"{len(sources)} sources for {len(prompts)} prompts")
    policy = PromptTruncation(tokenizer, max_prompt_length, overflow)
    kept = []
    for i, prompt in enumerate(prompts):
        out = policy(prompt, sources[i] if sources is not None else f"prompts[{i}]")
        if out is not None:
            kept.append(out)
    counts = {
        "prompts": len(prompts),
        "prompts_left_truncated": policy.counts["prompts_left_truncated"],
        "prompts_dropped_over_max_length": policy.counts["prompts_dropped_over_max_length"],
    }
    return kept, counts
