"""Preference-pair processing (algorithms.md §3): dedup, tie and cycle filtering, length balancing.

Every function takes pairs (or their lengths) and returns what it kept together with a report of
what it dropped and why, so a DataModule can log and expose every drop.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """One preference ``chosen ≻ rejected`` for ``prompt`` (texts, before tokenisation).

    Attributes:
        prompt: the rendered prompt text (chat templates already applied).
        chosen: the preferred response ``y_w``.
        rejected: the other response ``y_l``.
        margin: ``m ≥ 0`` of the Bradley-Terry loss (0 when the data gives none).
        source: ``file:row`` of the record the pair came from.
    """

    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0
    source: str = ""


def drop_duplicates(pairs: Sequence[Pair]) -> tuple[list[Pair], dict[str, int]]:
    """Keep the first of every repeated ``(prompt, chosen, rejected)``; report ``{"duplicates": n}``.

    A repeated pair with a different margin is still a duplicate (the first margin is kept).
    """
    seen: set[tuple[str, str, str]] = set()
    kept = []
    for p in pairs:
        key = (p.prompt, p.chosen, p.rejected)
        if key not in seen:
            seen.add(key)
            kept.append(p)
    return kept, {"duplicates": len(pairs) - len(kept)}


def is_tie(pair: Pair) -> bool:
    """True when both responses are the same text (ignoring surrounding whitespace)."""
    return pair.chosen.strip() == pair.rejected.strip()


def drop_ties(pairs: Sequence[Pair]) -> tuple[list[Pair], dict[str, int]]:
    """Drop pairs whose two responses are identical (ChatGLM-RLHF §3.2); report ``{"ties": n}``.

    Equal *labels* (ranked records with equal scores) never become pairs; the parser counts them.
    """
    kept = [p for p in pairs if not is_tie(p)]
    return kept, {"ties": len(pairs) - len(kept)}


def cycle_members(pairs: Sequence[Pair]) -> list[bool]:
    """For each pair, whether it lies on a preference cycle among the pairs of its prompt.

    Each prompt's pairs form a directed graph with an edge ``chosen → rejected``. An edge ``u → v``
    lies on a cycle iff ``v`` reaches ``u`` (``A≻B, B≻C, C≻A`` marks all three; ``A≻B, B≻A`` both).
    """
    by_prompt: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(pairs):
        by_prompt[p.prompt].append(i)
    flags = [False] * len(pairs)
    for indices in by_prompt.values():
        if len(indices) < 2:
            continue
        succ: dict[str, set[str]] = defaultdict(set)
        for i in indices:
            succ[pairs[i].chosen].add(pairs[i].rejected)
        reach: dict[str, set[str]] = {}
        for i in indices:
            start = pairs[i].rejected
            if start not in reach:
                seen, stack = {start}, [start]
                while stack:
                    for nxt in succ[stack.pop()]:
                        if nxt not in seen:
                            seen.add(nxt)
                            stack.append(nxt)
                reach[start] = seen
            flags[i] = pairs[i].chosen in reach[start]
    return flags


def drop_cycles(pairs: Sequence[Pair]) -> tuple[list[Pair], dict[str, int]]:
    """Drop every pair on a preference cycle of its prompt (ChatGLM-RLHF §3.2, see
    :func:`cycle_members`); report ``{"cycles": pairs dropped, "cycle_prompts": prompts affected}``."""
    flags = cycle_members(pairs)
    kept = [p for p, bad in zip(pairs, flags, strict=True) if not bad]
    prompts = {p.prompt for p, bad in zip(pairs, flags, strict=True) if bad}
    return kept, {"cycles": len(pairs) - len(kept), "cycle_prompts": len(prompts)}


def bucket_of(diff: int, edges: Sequence[int]) -> int:
    """Index of the bucket ``[edges[k], edges[k+1])`` holding ``diff`` (the last bucket is open)."""
    k = -1
    for k_, lo in enumerate(edges):
        if diff >= lo:
            k = k_
    return k


def check_bucket_edges(edges: Sequence[int], *, owner: str = "") -> list[int]:
    """``edges`` as a list if they are strictly increasing integers ``>= 1``; ValueError otherwise."""
    edges = list(edges)
    ints = all(isinstance(e, int) and not isinstance(e, bool) for e in edges)
    if not edges or not ints or edges[0] < 1 or any(b <= a for a, b in itertools.pairwise(edges)):
        raise ValueError(
            f"{owner}{': ' if owner else ''}length bucket edges must be strictly increasing integers >= 1, "
            f"got {edges}"
        )
    return edges


def balance_lengths(
    chosen_lengths: Sequence[int],
    rejected_lengths: Sequence[int],
    *,
    edges: Sequence[int],
    seed: int,
) -> tuple[list[int], dict[str, int]]:
    """Bucket-based length balancing (ChatGLM-RLHF §3.3, algorithms.md §3).

    Each pair goes to the bucket ``[edges[k], edges[k+1])`` of ``d = |len(y_w) - len(y_l)|`` (the
    last bucket is ``[edges[-1], ∞)``). Inside a bucket the larger of the two groups "chosen is
    longer" / "chosen is shorter" is subsampled (seeded) to the size of the smaller, so the
    length of a response no longer predicts the label there. Pairs with ``d < edges[0]`` (e.g. equal
    length when ``edges[0] == 1``) carry no length signal and are kept untouched.

    Args:
        chosen_lengths, rejected_lengths: response lengths (tokens) of each pair.
        edges: strictly increasing bucket lower bounds, ``edges[0] ≥ 1``.
        seed: seed of the subsampling.

    Returns:
        ``(kept indices in ascending order, report)``; the report has ``length_balance_dropped`` and,
        per bucket ``lo-hi``, ``bucket_lo-hi_longer`` / ``_shorter`` / ``_dropped`` counts before balancing.
    """
    if len(chosen_lengths) != len(rejected_lengths):
        raise ValueError(f"{len(chosen_lengths)} chosen lengths but {len(rejected_lengths)} rejected lengths")
    edges = check_bucket_edges(edges)
    longer: dict[int, list[int]] = defaultdict(list)
    shorter: dict[int, list[int]] = defaultdict(list)
    kept = []
    for i, (lw, ll) in enumerate(zip(chosen_lengths, rejected_lengths, strict=True)):
        k = bucket_of(abs(lw - ll), edges)
        if k < 0:
            kept.append(i)
        else:
            (longer if lw > ll else shorter)[k].append(i)
    rng = random.Random(seed)
    report: dict[str, int] = {}
    for k in range(len(edges)):
        hi = str(edges[k + 1]) if k + 1 < len(edges) else "inf"
        name = f"bucket_{edges[k]}-{hi}"
        group_l, group_s = longer[k], shorter[k]
        n = min(len(group_l), len(group_s))
        for group in (group_l, group_s):
            kept += group if len(group) == n else rng.sample(group, n)
        report[f"{name}_longer"] = len(group_l)
        report[f"{name}_shorter"] = len(group_s)
        report[f"{name}_dropped"] = len(group_l) + len(group_s) - 2 * n
    report["length_balance_dropped"] = len(chosen_lengths) - len(kept)
    return sorted(kept), report
