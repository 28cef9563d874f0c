"""Scoring with trained reward models: records (:func:`score_records`), preference pairs
(:func:`evaluate_pairs`: accuracy, margin, reward/length correlation; order-averaged ``P(chosen ≻
rejected)`` for a pairwise preference model) and best-of-n selection (:func:`rm_selector`).

``alignlit score`` (:mod:`alignlit.cli.score`) runs the first two from the command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from alignlit.data.pair_records import parse_pairs
from alignlit.data.records import parse_prompt_response
from alignlit.models.reward_model import (
    AB_FORMAT_KEY,
    load_preference_model,
    load_reward_model,
    resolve_model_path,
)
from alignlit.rollout.reward_protocol import resolve_reward, score_texts


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors (nan when either is constant)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def _is_pairwise(path: Path) -> bool:
    config = path / "config.json"
    return config.exists() and AB_FORMAT_KEY in json.loads(config.read_text())


def score_records(
    model_dir: str, records, *, batch_size: int, max_length: int | None, counts: dict | None = None
) -> list[dict[str, Any]]:
    """Each record with its ``"score"``; ``counts`` (a dict), when given, receives the reward model's
    :attr:`~alignlit.models.reward_model.RewardModel.counts` (what its length limits cut)."""
    rm = load_reward_model(model_dir, batch_size=batch_size, max_length=max_length)
    prompts, responses = [], []
    for rec in records:
        f = rec.fields
        if isinstance(f.get("prompt"), list):
            prompts.append(f["prompt"])
            responses.append(rec.text("response"))
        else:
            prompt, response = parse_prompt_response(rec)
            prompts.append(prompt)
            responses.append(response)
    scores = rm.score(prompts, responses)
    if counts is not None:
        counts.update(rm.counts)
    return [{**rec.fields, "score": float(s)} for rec, s in zip(records, scores, strict=True)]


def evaluate_pairs(model_dir: str, records, *, batch_size: int, max_length: int | None) -> dict[str, float]:
    """Accuracy and score statistics of a reward model (or a pairwise model) on preference pairs; for a
    reward model also how many sequences its length limits cut (``prompts_left_truncated``,
    ``responses_right_truncated`` of ``sequences``)."""
    pairs = []
    for rec in records:
        got, _ = parse_pairs(rec)
        pairs += got
    if not pairs:
        raise ValueError("no preference pairs to evaluate")
    prompts = [p.prompt for p in pairs]
    chosen, rejected = [p.chosen for p in pairs], [p.rejected for p in pairs]
    if _is_pairwise(resolve_model_path(model_dir)):
        pm = load_preference_model(model_dir, batch_size=batch_size)
        prob, consistent = pm.prob_both_orders(prompts, chosen, rejected)
        return {
            "pairs": len(pairs),
            "accuracy": float((prob > 0.5).double().mean()),
            "prob_chosen": float(prob.mean()),
            "position_consistency": float(consistent.double().mean()),
        }
    rm = load_reward_model(model_dir, batch_size=batch_size, max_length=max_length)
    s_w, s_l = rm.score(prompts, chosen), rm.score(prompts, rejected)
    every = torch.cat([s_w, s_l])
    tok = rm.tokenizer
    lengths = torch.tensor([len(tok(r, add_special_tokens=False).input_ids) for r in chosen + rejected])
    return {
        "pairs": len(pairs),
        "accuracy": float((s_w > s_l).double().mean()),
        "margin": float((s_w - s_l).mean()),
        "score_mean": float(every.mean()),
        "score_std": float(every.std()),
        "reward_length_corr": pearson(every, lengths.float()),
        **rm.counts,
    }


def rm_selector(rm_dir: str, *, batch_size: int = 64):
    """Scores for best-of-n selection by a reward model (``select_fn`` of
    :func:`alignlit.eval.gold.best_of_n`); an empty response is never selected (scored ``-inf``)."""
    reward = resolve_reward(rm_dir, batch_size=batch_size)

    def select(prompts, responses):
        keep = [i for i, r in enumerate(responses) if r.strip()]
        out = torch.full((len(responses),), float("-inf"), dtype=torch.float64)
        if keep:
            scores = score_texts(reward, [prompts[i] for i in keep], [responses[i] for i in keep])
            out[keep] = scores.to(torch.float64)
        return out.tolist()

    select.reward = reward  # for the truncation report of a reward model (RewardModel.counts)
    return select
