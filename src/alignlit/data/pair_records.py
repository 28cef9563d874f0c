"""Preference pairs: the record formats and their parsing into pairs.

Formats (one record per line/row):

- HH-RLHF ``{"chosen": dialogue, "rejected": dialogue}``: the prompt is the shared prefix up to the
  last ``\\n\\nAssistant:``; the two prefixes must be equal.
- generic ``{"prompt", "chosen", "rejected"[, "margin"]}``.
- ranked ``{"prompt", "responses": [...], "scores": [...]}``: every two responses with different
  scores give a pair (higher score chosen); equal scores are ties and give no pair (counted).
- conversational ``{"chosen": [messages], "rejected": [messages]}``: the prompt is the shared
  message prefix, the responses are the last (assistant) messages.

A prompt may be a string or a list of ``{"role", "content"}`` messages; messages are rendered with
the tokenizer's chat template (``add_generation_prompt=True``).
"""

from __future__ import annotations

from typing import Any

from alignlit.data.args import number_problem
from alignlit.data.processing import Pair
from alignlit.data.records import HH_ASSISTANT, DataError, Record


class PairError(DataError):
    """A preference record that cannot give a pair; ``reason`` names the kind of problem."""

    def __init__(self, record: Record, field: str | None, problem: str, reason: str):
        super().__init__(str(record.error(field, problem)))
        self.reason = reason


def _text(record: Record, field: str) -> str:
    f = record.fields
    if field not in f:
        raise PairError(record, field, f"missing (record has {sorted(f)})", "missing_field")
    value = f[field]
    if not isinstance(value, str):
        raise PairError(record, field, f"expected a string, got {type(value).__name__}", "bad_type")
    if not value.strip():
        raise PairError(record, field, "is empty", "empty_response")
    return value


def _messages(record: Record, field: str, value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise PairError(record, field, "expected a non-empty list of messages", "bad_type")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise PairError(
                record, field, f"message {i} is not a {{'role', 'content'}} object of strings", "bad_type"
            )
    return value


def render_prompt(prompt: str | list[dict[str, str]], tokenizer, where: str = "prompt") -> str:
    """A prompt string as the model sees it: strings as they are, message lists through the
    tokenizer's chat template with the generation prompt appended."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: a list of messages needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def _render(record: Record, field: str, messages: list[dict[str, str]], tokenizer) -> str:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise PairError(
            record, field, "a list of messages needs a tokenizer with a chat template", "no_chat_template"
        )
    return render_prompt(messages, tokenizer)


def _prompt(record: Record, tokenizer) -> str:
    value = record.fields.get("prompt")
    if isinstance(value, list):
        return _render(record, "prompt", _messages(record, "prompt", value), tokenizer)
    return _text(record, "prompt")


def _margin(record: Record) -> float:
    value = record.fields.get("margin", 0.0)
    if value is None:
        return 0.0
    problem = number_problem(value)
    if problem is not None or value < 0:
        shown = "an integer too large for a float" if problem and "too large" in problem else repr(value)
        raise PairError(record, "margin", f"expected a number >= 0 (finite), got {shown}", "bad_margin")
    return float(value)


def _hh_pair(record: Record) -> Pair:
    parts = {}
    for field in ("chosen", "rejected"):
        text = _text(record, field)
        cut = text.rfind(HH_ASSISTANT)
        if cut < 0:
            raise PairError(record, field, "not in HH-RLHF format: no '\\n\\nAssistant:' turn", "not_hh")
        cut += len(HH_ASSISTANT)
        if not text[cut:].strip():
            raise PairError(record, field, "the last Assistant turn is empty", "empty_response")
        parts[field] = (text[:cut], text[cut:])
    if parts["chosen"][0] != parts["rejected"][0]:
        raise PairError(
            record,
            "rejected",
            "its dialogue before the last Assistant turn differs from 'chosen' (no shared prompt)",
            "prompt_mismatch",
        )
    return Pair(parts["chosen"][0], parts["chosen"][1], parts["rejected"][1], _margin(record), record.source)


def _conversation_pair(record: Record, tokenizer) -> Pair:
    convs = {f: _messages(record, f, record.fields[f]) for f in ("chosen", "rejected")}
    if convs["chosen"][:-1] != convs["rejected"][:-1]:
        raise PairError(
            record, "rejected", "its messages before the last one differ from 'chosen'", "prompt_mismatch"
        )
    responses = {}
    for f, conv in convs.items():
        if conv[-1]["role"] != "assistant":
            raise PairError(
                record, f, f"the last message has role {conv[-1]['role']!r}, not 'assistant'", "bad_type"
            )
        if not conv[-1]["content"].strip():
            raise PairError(record, f, "the last message is empty", "empty_response")
        responses[f] = conv[-1]["content"]
    if len(convs["chosen"]) < 2:
        raise PairError(
            record, "chosen", "a conversation needs at least one message before the response", "bad_type"
        )
    prompt = _render(record, "chosen", convs["chosen"][:-1], tokenizer)
    return Pair(prompt, responses["chosen"], responses["rejected"], _margin(record), record.source)


def _ranked_pairs(record: Record, tokenizer, ranked_margin: bool) -> tuple[list[Pair], int]:
    prompt = _prompt(record, tokenizer)
    responses, scores = record.fields["responses"], record.fields.get("scores")
    if not isinstance(responses, list) or len(responses) < 2:
        raise PairError(record, "responses", "expected a list of at least two responses", "bad_type")
    if not isinstance(scores, list) or len(scores) != len(responses):
        raise PairError(
            record,
            "scores",
            f"expected a list of {len(responses)} numbers (one per response), got {scores!r}",
            "bad_type" if "scores" in record.fields else "missing_field",
        )
    for i, (r, s) in enumerate(zip(responses, scores, strict=True)):
        if not isinstance(r, str) or not r.strip():
            raise PairError(record, "responses", f"response {i} is empty or not a string", "empty_response")
        problem = number_problem(s)
        if problem is not None:
            raise PairError(record, "scores", f"score {i} {problem}", "bad_type")
    pairs, ties = [], 0
    for i in range(len(responses)):
        for j in range(i + 1, len(responses)):
            if scores[i] == scores[j]:
                ties += 1
                continue
            w, lo = (i, j) if scores[i] > scores[j] else (j, i)
            margin = float(scores[w] - scores[lo]) if ranked_margin else 0.0
            pairs.append(Pair(prompt, responses[w], responses[lo], margin, record.source))
    return pairs, ties


def parse_pairs(record: Record, tokenizer=None, *, ranked_margin: bool = False) -> tuple[list[Pair], int]:
    """The preference pairs of one record (any supported format) and the number of ranked ties
    (pairs of equal score, which give no pair).

    Raises :class:`PairError` (a :class:`DataError` naming file:row and field) on a malformed record.
    ``ranked_margin``: for ranked records use the score difference as the pair's margin.
    """
    f = record.fields
    if "responses" in f:
        return _ranked_pairs(record, tokenizer, ranked_margin)
    if "prompt" in f:
        prompt = _prompt(record, tokenizer)
        return [
            Pair(prompt, _text(record, "chosen"), _text(record, "rejected"), _margin(record), record.source)
        ], 0
    if "chosen" in f and "rejected" in f:
        if isinstance(f["chosen"], list) or isinstance(f["rejected"], list):
            return [_conversation_pair(record, tokenizer)], 0
        return [_hh_pair(record)], 0
    raise PairError(
        record,
        None,
        "unknown preference format: expected HH-RLHF 'chosen'+'rejected', 'prompt'+'chosen'+'rejected', "
        f"or 'prompt'+'responses'+'scores'; got {sorted(f)}",
        "unknown_format",
    )
