"""Engine-independent steps of a ``generate`` call: prompt encoding, stop strings, padding.

Every engine hands its raw samples (token ids up to and including the first EOS, with the sampled
tokens' log-probs) to :func:`assemble_rollout`, so stop strings, finish reasons, decoding and
padding mean exactly the same thing whichever engine generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from alignlit.data.chat import prompt_token_ids
from alignlit.rollout.base import Rollout, SamplingParams


@dataclass
class RawSample:
    """One generated response before stop strings and padding are applied.

    Attributes:
        token_ids: generated tokens, ending at the first EOS (included) if one was produced.
        logprobs: log-prob of each token in ``token_ids`` (same length).
        ended_early: the engine stopped this sample before ``max_new_tokens`` (EOS or a stop string).
    """

    token_ids: list[int]
    logprobs: list[float]
    ended_early: bool = False


def check_sampling(sampling: SamplingParams) -> None:
    """Raise ``ValueError`` naming the field when a sampling parameter is out of range."""
    if sampling.temperature < 0:
        raise ValueError(f"sampling.temperature must be >= 0 (0 = greedy), got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"sampling.top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise ValueError(f"sampling.top_k must be >= 0 (0 disables it), got {sampling.top_k}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if isinstance(sampling.stop, str):
        raise ValueError(f"sampling.stop must be a list of strings, got the string {sampling.stop!r}")
    for s in sampling.stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"sampling.stop must hold non-empty strings, got {sampling.stop!r}")


def check_prompts(prompts: Sequence[str], n: int) -> list[str]:
    """Validate the ``generate`` arguments and return the prompts as a list."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a sequence of strings, got a single string")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"prompts[{i}] must be a string, got {type(p).__name__}")
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    return prompts


def require_pad_token(tokenizer) -> int:
    """The tokenizer's pad id; a clear error when it has none."""
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "tokenizer has no pad token: set tokenizer.pad_token (for example to its EOS token) before "
            "building a rollout engine"
        )
    return int(tokenizer.pad_token_id)


def encode_prompts(
    tokenizer, prompts: Sequence[str], max_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts (plain text with the tokenizer's own special tokens, a chat-template rendering
    :class:`~alignlit.data.Prompt` without: :func:`alignlit.data.chat.prompt_token_ids`) and left-pad them.

    Args:
        tokenizer: the policy's tokenizer (it must have a pad token).
        prompts: prompt strings.
        max_length: the most tokens (special tokens included) a prompt may have, e.g. the model's
            positions minus the new tokens; a longer prompt is refused with a ``ValueError`` naming
            it (truncate prompts beforehand with :func:`alignlit.data.truncate_prompts` or
            ``PromptDataModule(max_prompt_length=...)``). None: no limit.

    Returns:
        ``(prompt_ids, prompt_mask)``: (B, P) long and (B, P) bool.
    """
    pad_id = require_pad_token(tokenizer)
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        raise ValueError(f"max_length must be an integer >= 1 or None, got {max_length!r}")
    prompts = list(prompts)
    if any(getattr(p, "templated", False) for p in prompts):  # a chat rendering already has its specials
        encoded = [prompt_token_ids(tokenizer, p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    else:
        encoded = tokenizer(prompts)["input_ids"]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompts[{i}] = {prompts[i]!r} encodes to no tokens")
        if max_length is not None and len(ids) > max_length:
            raise ValueError(
                f"prompts[{i}] ({prompts[i][:40]!r}...) encodes to {len(ids)} tokens, more than max_length="
                f"{max_length}; truncate prompts first (alignlit.data.truncate_prompts, or "
                "PromptDataModule's max_prompt_length)"
            )
    width = max(len(ids) for ids in encoded)
    prompt_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)  # (B, P)
    prompt_mask = torch.zeros((len(encoded), width), dtype=torch.bool)  # (B, P)
    for i, ids in enumerate(encoded):
        prompt_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[i, width - len(ids) :] = True
    return prompt_ids, prompt_mask


def pad_prompt_ids(
    tokenizer, prompt_ids: Sequence[Sequence[int]]
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Prompts given as token ids (e.g. a multi-turn episode's history, never re-tokenised), left-padded
    as :func:`encode_prompts` pads encoded strings.

    Returns:
        ``(texts, prompt_ids, prompt_mask)``: the decoded prompts (special tokens kept; for
        :attr:`Rollout.prompts`), (B, P) long and (B, P) bool.
    """
    pad_id = require_pad_token(tokenizer)
    if isinstance(prompt_ids, torch.Tensor) or not len(prompt_ids):
        raise ValueError("prompt_ids must be a non-empty sequence of token-id lists")
    rows = [[int(t) for t in ids] for ids in prompt_ids]
    for i, ids in enumerate(rows):
        if not ids:
            raise ValueError(f"prompt_ids[{i}] is empty")
    width = max(len(ids) for ids in rows)
    ids_t = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, P)
    for i, ids in enumerate(rows):
        ids_t[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[i, width - len(ids) :] = True
    return tokenizer.batch_decode(rows, skip_special_tokens=False), ids_t, mask


def eos_token_ids(tokenizer, model_config=None) -> set[int]:
    """EOS ids from the tokenizer and, when given, a model/generation config (an int or a list)."""
    ids: set[int] = set()
    for source in (tokenizer, model_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
    return ids


def stop_cut(tokenizer, token_ids: Sequence[int], stop: Sequence[str]) -> int | None:
    """How many leading tokens to keep so that the decoded response ends before the first stop string.

    The response is decoded (special tokens skipped) and the earliest occurrence of any stop string
    found at character ``s``. The kept tokens are the longest prefix whose decoded text has at most
    ``s`` characters, i.e. every token that lies wholly before the stop string. A token that
    straddles the boundary (its text holds the end of the response and the start of the stop
    string, e.g. ``"b\\n"`` before ``"\\nHuman:"``) is dropped with its whole text, so the response
    may lose a few characters before the stop string but never contains any part of it, and the
    returned text is always exactly ``decode(token_ids[:keep])``.

    Returns:
        the number of tokens to keep, or None when no stop string occurs.
    """
    if not stop:
        return None
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    starts = [i for i in (text.find(s) for s in stop) if i >= 0]
    if not starts:
        return None
    boundary = min(starts)
    keep = 0
    while keep < len(token_ids):
        if len(tokenizer.decode(list(token_ids[: keep + 1]), skip_special_tokens=True)) > boundary:
            break
        keep += 1
    return keep


def assemble_rollout(
    tokenizer,
    prompts: Sequence[str],
    n: int,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    samples: Sequence[RawSample],
    *,
    stop: Sequence[str],
    eos_ids: set[int],
) -> Rollout:
    """Apply stop strings, decide finish reasons, decode and right-pad ``samples`` into a Rollout.

    ``samples[j]`` is sample ``j % n`` of prompt ``j // n``; ``prompt_ids``/``prompt_mask`` are the
    (B, P) encoded prompts, repeated here to (N, P).

    Finish reason: ``"stop"`` when a stop string was cut, the last token is an EOS, or the engine
    ended the sample early; otherwise ``"length"``.
    """
    num = len(prompts) * n
    if len(samples) != num:
        raise ValueError(f"expected {num} samples ({len(prompts)} prompts x n={n}), got {len(samples)}")
    pad_id = require_pad_token(tokenizer)
    kept_ids: list[list[int]] = []
    kept_logprobs: list[list[float]] = []
    finish_reasons: list[str] = []
    for sample in samples:
        if len(sample.token_ids) != len(sample.logprobs):
            raise ValueError(
                f"sample has {len(sample.token_ids)} tokens but {len(sample.logprobs)} log-probs"
            )
        ids, logps = list(sample.token_ids), list(sample.logprobs)
        cut = stop_cut(tokenizer, ids, stop)
        if cut is not None:
            ids, logps, reason = ids[:cut], logps[:cut], "stop"
        elif (ids and ids[-1] in eos_ids) or sample.ended_early:
            reason = "stop"
        else:
            reason = "length"
        kept_ids.append(ids)
        kept_logprobs.append(logps)
        finish_reasons.append(reason)

    width = max(len(ids) for ids in kept_ids)
    response_ids = torch.full((num, width), pad_id, dtype=torch.long)  # (N, T)
    response_mask = torch.zeros((num, width), dtype=torch.bool)  # (N, T)
    logprobs = torch.zeros((num, width), dtype=torch.float32)  # (N, T)
    for j, (ids, logps) in enumerate(zip(kept_ids, kept_logprobs)):
        response_ids[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[j, : len(ids)] = True
        logprobs[j, : len(ids)] = torch.tensor(logps, dtype=torch.float32)

    return Rollout(
        prompts=[p for p in prompts for _ in range(n)],
        prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
        prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
        response_ids=response_ids,
        response_mask=response_mask,
        logprobs=logprobs,
        texts=tokenizer.batch_decode(kept_ids, skip_special_tokens=True),
        finish_reasons=finish_reasons,
        n=n,
    )
