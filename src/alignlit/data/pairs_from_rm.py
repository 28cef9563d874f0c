"""Training data from scored samples: DPO pairs (best vs worst) and rejection-sampling SFT records.

The input is a *ranked group*: one prompt, ``n`` sampled responses and a score for each (from a reward
model or any scorer), as written by ``alignlit sample``::

    {"prompt": "...", "responses": ["...", ...], "scores": [0.9, ...], "lengths": [5, ...]}

``lengths`` (response tokens) is optional; it is needed only for a length penalty.

- :func:`best_worst_pairs`: ChatGLM-RLHF §3.4 / RLHF-Workflow §3 (algorithms.md §5, §6): the
  highest- and lowest-scoring responses of each prompt become ``(chosen, rejected)``, optionally on
  the length-penalised score ``r - λ|y|`` (RLHF-Workflow eq. 8). Groups whose best and worst
  responses are identical, or whose score gap is not above ``min_gap``, give no pair.
- :func:`best_of_n_records`: rejection-sampling fine-tuning (algorithms.md §8): the best response of
  each prompt becomes an SFT record ``{"prompt", "response"}``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from alignlit.data.args import number_problem
from alignlit.data.records import Record, read_records


@dataclass
class RankedGroup:
    """One prompt with its scored responses.

    Attributes:
        prompt: the prompt string.
        responses: the responses, best first when written by ``alignlit sample``.
        scores: one score per response (higher is better); None for unscored samples.
        lengths: response lengths in tokens, or None when unknown.
        source: where the group was read from (``file:row``), for error messages.
    """

    prompt: str
    responses: list[str]
    scores: list[float] | None
    lengths: list[int] | None = None
    source: str = "<memory>"

    def __post_init__(self) -> None:
        if self.scores is not None and len(self.responses) != len(self.scores):
            raise ValueError(f"{self.source}: {len(self.responses)} responses but {len(self.scores)} scores")
        if self.lengths is not None and len(self.lengths) != len(self.responses):
            raise ValueError(
                f"{self.source}: {len(self.responses)} responses but {len(self.lengths)} lengths"
            )

    @classmethod
    def from_record(cls, record: Record) -> RankedGroup:
        """Parse a ``{"prompt", "responses", "scores"[, "lengths"]}`` record; errors name row and field."""
        prompt = record.text("prompt")
        responses = _list_field(record, "responses", str)
        raw_scores = _list_field(record, "scores", (int, float))
        for i, s in enumerate(raw_scores):
            problem = number_problem(s)
            if problem is not None:
                raise record.error("scores", f"item {i} {problem}")
        scores = [float(s) for s in raw_scores]
        if len(scores) != len(responses):
            raise record.error("scores", f"has {len(scores)} entries for {len(responses)} responses")
        lengths = None
        if "lengths" in record.fields:
            lengths = [int(n) for n in _list_field(record, "lengths", int)]
            if any(n < 0 for n in lengths):
                raise record.error("lengths", f"must be token counts >= 0, got {lengths}")
            if len(lengths) != len(responses):
                raise record.error("lengths", f"has {len(lengths)} entries for {len(responses)} responses")
        return cls(prompt, responses, scores, lengths, record.source)

    def to_record(self) -> dict:
        row = {"prompt": self.prompt, "responses": self.responses, "scores": self.scores}
        if self.lengths is not None:
            row["lengths"] = self.lengths
        return row

    def ranked(self) -> RankedGroup:
        """The same group sorted by score, best first (stable: ties keep their order)."""
        self._require_scores()
        order = sorted(range(len(self.scores)), key=lambda i: -self.scores[i])
        return RankedGroup(
            self.prompt,
            [self.responses[i] for i in order],
            [self.scores[i] for i in order],
            None if self.lengths is None else [self.lengths[i] for i in order],
            self.source,
        )

    def _require_scores(self) -> None:
        if self.scores is None:
            raise ValueError(f"{self.source}: the responses of {self.prompt!r} have no scores")

    def penalised_scores(self, length_penalty: float) -> list[float]:
        """``r_i - λ·|y_i|`` (RLHF-Workflow eq. 8); the raw scores when ``λ = 0``."""
        self._require_scores()
        if length_penalty == 0:
            return list(self.scores)
        if self.lengths is None:
            raise ValueError(
                f"{self.source}: a length penalty needs the response lengths (field 'lengths'), which "
                "this record does not have"
            )
        return [s - length_penalty * n for s, n in zip(self.scores, self.lengths)]


def _list_field(record: Record, field: str, kind) -> list:
    if field not in record.fields:
        raise record.error(field, f"missing (record has {sorted(record.fields)})")
    value = record.fields[field]
    if not isinstance(value, list) or not value:
        raise record.error(field, f"expected a non-empty list, got {value!r}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, kind):
            raise record.error(
                field, f"item {i} is {item!r}, expected {getattr(kind, '__name__', 'a number')}"
            )
    return value


def read_ranked(path: str | Path) -> list[RankedGroup]:
    """All ranked groups of a JSONL/JSON/Parquet file (see :class:`RankedGroup`)."""
    return [RankedGroup.from_record(r) for r in read_records(path)]


def _non_blank(group: RankedGroup, counts: Counter) -> list[int]:
    """Indices of the responses with text; blank ones (nothing to train on) are counted and skipped."""
    keep = [i for i, r in enumerate(group.responses) if r.strip()]
    if len(keep) < len(group.responses):
        counts["blank_responses_skipped"] += len(group.responses) - len(keep)
    return keep


def best_worst_pairs(
    groups: Iterable[RankedGroup], *, length_penalty: float = 0.0, min_gap: float = 0.0
) -> tuple[list[dict], Counter]:
    """One ``(chosen, rejected)`` pair per group: the best and the worst response by score.

    The score is ``r - λ|y|`` with ``λ = length_penalty``. The first best and the last worst (in the
    group's order) are taken. A group gives no pair when its best and worst responses are the same
    text (``"identical"``; this includes groups where every response is the same) or when the score
    gap is ``<= min_gap`` (``"gap"``, so equal scores never make a pair). Blank responses (nothing
    to train on) are never chosen (``"blank_responses_skipped"``); a group with fewer than two other
    responses gives no pair (``"too_few_responses"``).

    Returns:
        ``(pairs, counts)``: pair records ``{"prompt", "chosen", "rejected", "chosen_score",
        "rejected_score"}`` (the penalised scores) and a Counter of ``kept`` and drop reasons.
    """
    pairs, counts = [], Counter()
    for group in groups:
        scores = group.penalised_scores(length_penalty)
        candidates = _non_blank(group, counts)
        if len(candidates) < 2:
            counts["too_few_responses"] += 1
            continue
        best = max(candidates, key=lambda i: (scores[i], -i))
        worst = min(candidates, key=lambda i: (scores[i], -i))
        if group.responses[best] == group.responses[worst]:
            counts["identical"] += 1
            continue
        if scores[best] - scores[worst] <= min_gap:
            counts["gap"] += 1
            continue
        counts["kept"] += 1
        pairs.append(
            {
                "prompt": group.prompt,
                "chosen": group.responses[best],
                "rejected": group.responses[worst],
                "chosen_score": scores[best],
                "rejected_score": scores[worst],
            }
        )
    return pairs, counts


def best_of_n_records(
    groups: Iterable[RankedGroup], *, length_penalty: float = 0.0, min_score: float | None = None
) -> tuple[list[dict], Counter]:
    """Rejection-sampling fine-tuning data: the best response of each group as an SFT record.

    Args:
        groups: scored groups.
        length_penalty: ``λ`` of the score ``r - λ|y|`` used for the choice.
        min_score: drop groups whose best (penalised) score is below this (``"below_min_score"``).
            Blank responses are never chosen, as in :func:`best_worst_pairs`.

    Returns:
        ``(records, counts)``: ``{"prompt", "response", "score"}`` records and a Counter of ``kept``
        and drop reasons.
    """
    records, counts = [], Counter()
    for group in groups:
        scores = group.penalised_scores(length_penalty)
        candidates = _non_blank(group, counts)
        if not candidates:
            counts["too_few_responses"] += 1
            continue
        best = max(candidates, key=lambda i: (scores[i], -i))
        if min_score is not None and scores[best] < min_score:
            counts["below_min_score"] += 1
            continue
        counts["kept"] += 1
        records.append({"prompt": group.prompt, "response": group.responses[best], "score": scores[best]})
    return records, counts


def write_jsonl(rows: Sequence[dict], path: str | Path) -> Path:
    """Write ``rows`` as JSONL atomically (a temporary file renamed into place)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return out
