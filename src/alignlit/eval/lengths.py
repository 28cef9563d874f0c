"""Prompts against the positions of the models that read them, checked before anything is generated.

A policy with ``P`` positions (``max_position_embeddings``) can generate ``max_new_tokens`` after a
prompt only if ``prompt tokens + max_new_tokens <= P``; beyond that Hugging Face generates on with
positions it was never trained on, and says so only in a log line. ``alignlit sample`` and
``alignlit eval`` call :func:`fit_prompts` up front: ``overflow="error"`` (their default) refuses
naming the longest prompt and the limit, ``"truncate"`` keeps each prompt's end (the prompt truncation
policy of :mod:`alignlit.data.prompts`) and ``"drop"`` leaves it out, both counted for the log and the
results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alignlit.data.encoding import Overflow
from alignlit.data.prompts import COUNT_CHARS, truncate_prompts


@dataclass
class Reader:
    """A model that reads the prompts: its name (for messages), tokenizer and positions (None: no limit)."""

    name: str
    tokenizer: Any
    positions: int | None


def prompt_budget(reader: Reader, max_new_tokens: int) -> int | None:
    """The most tokens (without special tokens) a prompt may have so that it, the special tokens the
    tokenizer adds, and ``max_new_tokens`` fit ``reader``'s positions; None when it has no limit.
    ``ValueError`` when ``max_new_tokens`` alone leaves no room."""
    if reader.positions is None:
        return None
    special = len(reader.tokenizer("")["input_ids"])
    budget = reader.positions - max_new_tokens - special
    if budget < 1:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the {reader.positions} positions "
            f"of {reader.name} (max_position_embeddings): give at most {reader.positions - special - 1}"
        )
    return budget


def _tokens(tokenizer, prompt: str) -> int:
    if len(prompt) > COUNT_CHARS:
        return COUNT_CHARS  # more than any model's positions: counted as too long without tokenising it
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def fit_prompts(
    prompts: Sequence[str],
    readers: Sequence[Reader],
    *,
    max_new_tokens: int,
    overflow: Overflow = "error",
    sources: Sequence[str] | None = None,
) -> tuple[list[str], dict[str, int]]:
    """``prompts`` made to fit every one of ``readers`` with ``max_new_tokens`` generated after them.

    Returns ``(prompts, counts)`` with ``counts = {"prompts", "prompts_left_truncated",
    "prompts_dropped_over_max_length"}``. ``overflow="error"`` raises a ``ValueError`` naming how many
    prompts are too long, the longest one (its source) and the limit.
    """
    prompts = list(prompts)
    counts = {"prompts": len(prompts), "prompts_left_truncated": 0, "prompts_dropped_over_max_length": 0}
    for reader in readers:
        budget = prompt_budget(reader, max_new_tokens)
        if budget is None:
            continue
        if overflow == "error":
            lengths = [_tokens(reader.tokenizer, p) for p in prompts]
            over = [i for i, n in enumerate(lengths) if n > budget]
            if over:
                worst = max(over, key=lambda i: lengths[i])
                where = sources[worst] if sources is not None else f"prompt {worst}"
                raise ValueError(
                    f"{len(over)} of {len(prompts)} prompts do not fit {reader.name}: a prompt and the "
                    f"--max-new-tokens {max_new_tokens} response must fit its {reader.positions} positions "
                    f"(max_position_embeddings), so a prompt may have at most {budget} tokens; the longest "
                    f"({where}) has {lengths[worst]}. Pass --prompt-overflow truncate (keep each prompt's "
                    "end) or drop, lower --max-new-tokens, or shorten the prompts"
                )
            continue
        kept, got = truncate_prompts(reader.tokenizer, prompts, budget, overflow)
        if sources is not None and len(kept) != len(prompts):
            keep = set(kept)
            sources = [s for p, s in zip(prompts, sources, strict=True) if p in keep]
        prompts = kept
        counts["prompts_left_truncated"] += got["prompts_left_truncated"]
        counts["prompts_dropped_over_max_length"] += got["prompts_dropped_over_max_length"]
    return prompts, counts


def describe(counts: dict[str, int], readers: Sequence[Reader], max_new_tokens: int) -> str | None:
    """One log sentence about what :func:`fit_prompts` did (None when it changed nothing)."""
    cut, dropped = counts["prompts_left_truncated"], counts["prompts_dropped_over_max_length"]
    if not (cut or dropped):
        return None
    limits = ", ".join(f"{r.name} {r.positions}" for r in readers if r.positions is not None)
    return (
        f"{cut} of {counts['prompts']} prompts left-truncated and {dropped} dropped so that a prompt and "
        f"{max_new_tokens} new tokens fit the models' positions ({limits})"
    )
