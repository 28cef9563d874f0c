"""Conversations: one rendering path from records to the token ids every stage sees.

A prompt is a :class:`Prompt`: the text the policy is given (a plain string, or a list of
``{"role", "content"}`` messages rendered with the tokenizer's chat template and the generation
prompt), carrying the record it came from (:attr:`Prompt.fields`: its other columns, e.g. a GSM8K
``answer``) and where (:attr:`Prompt.source`, ``file:row``). It is a ``str``, so every engine, reward
and log that takes prompt strings takes it unchanged; rewards receive its fields as keyword columns
(:func:`alignlit.rollout.reward_protocol.score_texts`), so a reference answer travels with its prompt.

Rendering happens in :func:`render_messages` only, and a rendered prompt is tokenised without the
tokenizer's own special tokens (the template already wrote them): the ids equal
``tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``.

:func:`encode_conversation` tokenises a whole ``messages`` conversation for SFT with the loss on the
assistant turns only: each assistant turn's span is what rendering the conversation up to and
including it adds to the rendering up to its generation prompt (the turn's content and its end
token(s), e.g. ``<|im_end|>\\n`` in ChatML).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from alignlit.data.encoding import Encoded, token_ids
from alignlit.data.records import HH_ASSISTANT, HH_HUMAN, DataError, Record

ROLES = ("system", "user", "assistant", "tool")


class Prompt(str):
    """A prompt string that carries its record.

    Args:
        text: what the policy is given (already rendered when it came from messages).
        fields: the record's other columns (e.g. ``{"answer": "... #### 72"}``); rewards receive
            them as keyword arguments.
        source: where the record came from (``file:row``), for messages.
        messages: the conversation the text was rendered from (None: a plain-text prompt).
    """

    fields: dict[str, Any]
    source: str | None
    messages: list[dict[str, str]] | None

    def __new__(
        cls,
        text: str,
        *,
        fields: Mapping[str, Any] | None = None,
        source: str | None = None,
        messages: list[dict[str, str]] | None = None,
    ):
        self = super().__new__(cls, text)
        self.fields = dict(fields or {})
        self.source = source
        self.messages = messages
        return self

    @property
    def templated(self) -> bool:
        """Whether the text is a chat-template rendering (then tokenised without added special tokens)."""
        return self.messages is not None

    def __reduce__(self):
        return (_rebuild_prompt, (str(self), self.fields, self.source, self.messages))


def _rebuild_prompt(text, fields, source, messages) -> Prompt:
    return Prompt(text, fields=fields, source=source, messages=messages)


# checkpoints hold prompts (an asynchronous run's batches ahead, the prompt filter's kept prompts) and are
# read with weights_only=True
torch.serialization.add_safe_globals([Prompt, _rebuild_prompt])


def prompt_columns(prompts: Sequence[str]) -> dict[str, list[Any]]:
    """The columns every prompt of ``prompts`` carries (:attr:`Prompt.fields`), as lists in row order."""
    if not prompts or not all(isinstance(p, Prompt) for p in prompts):
        return {}
    names = set(prompts[0].fields)
    for p in prompts[1:]:
        names &= set(p.fields)
    return {name: [p.fields[name] for p in prompts] for name in sorted(names)}


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """``value`` as a non-empty list of ``{"role", "content"}`` messages of strings; DataError naming ``where``."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: expected a non-empty list of {{'role', 'content'}} messages")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {i} is not a {{'role', 'content'}} object of strings")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role {m['role']!r}; expected one of {list(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def require_chat_template(tokenizer, where: str) -> None:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{where}: messages need a tokenizer with a chat template (tokenizer_config.json "
            "'chat_template' or chat_template.jinja); this tokenizer has none"
        )


def render_messages(tokenizer, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    """The chat template's text of ``messages`` (with the assistant generation prompt when asked)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """``messages`` with ``system_prompt`` as the first message, unless they start with a system message."""
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def make_prompt(
    value: Any,
    tokenizer,
    *,
    where: str,
    chat: bool,
    system_prompt: str | None = None,
    fields: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> Prompt:
    """A :class:`Prompt` from a record's prompt value: a list of messages is rendered with the chat
    template; a string is rendered as one user message when ``chat`` is True, else kept as it is.
    ``where`` names the value in errors; ``source`` (default ``where``) is the record's ``file:row``."""
    source = where if source is None else source
    if isinstance(value, list):
        messages = check_messages(value, where)
    elif isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: is empty")
        if not chat:
            return Prompt(value, fields=fields, source=source)
        messages = [{"role": "user", "content": value}]
    else:
        raise DataError(f"{where}: expected a string or a list of messages, got {type(value).__name__}")
    if messages[-1]["role"] == "assistant":
        raise DataError(f"{where}: a prompt's last message is an assistant turn; the policy answers next")
    require_chat_template(tokenizer, where)
    messages = with_system(messages, system_prompt)
    text = render_messages(tokenizer, messages, generation_prompt=True)
    return Prompt(text, fields=fields, source=source, messages=messages)


def prompt_token_ids(tokenizer, prompt: str, where: str = "prompt") -> list[int]:
    """The ids the policy is given for ``prompt``: a chat rendering without added special tokens (the
    template wrote them), plain text with the tokenizer's own (as ``tokenizer(text)``)."""
    if isinstance(prompt, Prompt) and prompt.templated:
        return token_ids(tokenizer, prompt, where)
    return tokenizer(prompt).input_ids


def encode_conversation(
    tokenizer,
    messages: list[dict[str, str]],
    source: str,
    *,
    max_length: int,
    overflow: str,
    counts: Counter,
    system_prompt: str | None = None,
) -> Encoded | None:
    """Token ids of a whole conversation and a loss mask on its assistant turns only.

    Returns None when ``overflow == "drop"`` and the conversation is longer than ``max_length``
    (counted); ``"truncate"`` cuts it from the right (counted); ``"error"`` raises naming ``source``.
    """
    require_chat_template(tokenizer, source)
    messages = with_system(check_messages(messages, source), system_prompt)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{source}, field 'messages': no assistant turn, so nothing to train on")
    full = render_messages(tokenizer, messages, generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_messages(tokenizer, messages[:i], generation_prompt=True) if i else ""
        upto = render_messages(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(
                f"{source}: the chat template does not render this conversation as a sequence of turns "
                f"(the rendering up to message {i} is not a prefix of the whole), so the assistant tokens "
                "cannot be told apart; use a template that renders turns in order"
            )
        spans.append((len(before), len(upto)))
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as e:
        raise DataError(f"{source}: messages need a fast tokenizer (offsets mapping): {e}") from e
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [any(a <= start and end <= b for a, b in spans) and end > start for start, end in offsets]
    if not any(mask):
        raise DataError(f"{source}: the assistant turns tokenise to nothing")
    if len(ids) > max_length:
        if overflow == "error":
            raise DataError(
                f"{source}: the conversation has {len(ids)} tokens, more than max_length={max_length}"
            )
        if overflow == "drop":
            counts["dropped_over_max_length"] += 1
            return None
        ids, mask = ids[:max_length], mask[:max_length]
        counts["conversations_right_truncated"] += 1
        if not any(mask):
            counts["dropped_no_assistant_tokens_left"] += 1
            return None
    first = mask.index(True)
    return Encoded(list(ids), first, loss_mask=mask)


def record_messages(record: Record, field: str = "messages") -> list[dict[str, str]]:
    """The ``messages`` of a record, checked (DataError naming ``file:row`` and the field)."""
    return check_messages(record.fields.get(field), f"{record.source}, field {field!r}")


def hh_messages(text: str, where: str) -> list[dict[str, str]]:
    """An HH-RLHF dialogue (``\\n\\nHuman: … \\n\\nAssistant: …``) as ``{"role", "content"}`` messages
    (contents stripped); DataError naming ``where`` when it does not alternate from a Human turn."""
    messages: list[dict[str, str]] = []
    rest = text
    if not rest.startswith(HH_HUMAN):
        raise DataError(f"{where}: not an HH-RLHF dialogue (it must start with '\\n\\nHuman:')")
    while rest:
        role, marker = ("user", HH_HUMAN) if rest.startswith(HH_HUMAN) else ("assistant", HH_ASSISTANT)
        if not rest.startswith(marker):
            raise DataError(f"{where}: not an HH-RLHF dialogue (text outside a Human/Assistant turn)")
        rest = rest[len(marker) :]
        nxt = [i for i in (rest.find(HH_HUMAN), rest.find(HH_ASSISTANT)) if i >= 0]
        cut = min(nxt) if nxt else len(rest)
        messages.append({"role": role, "content": rest[:cut].strip()})
        rest = rest[cut:]
    return messages


def hh_as_conversation(record: Record) -> Record:
    """An HH-RLHF ``{"chosen", "rejected"}`` record of dialogue strings as the conversational format
    (lists of messages), other fields kept; other records unchanged."""
    f = record.fields
    if not all(isinstance(f.get(k), str) for k in ("chosen", "rejected")) or "prompt" in f:
        return record
    converted = {k: hh_messages(f[k], f"{record.source}, field {k!r}") for k in ("chosen", "rejected")}
    return Record(record.source, {**f, **converted})
