"""``alignlit score``: score records with a trained reward model, or measure it on preference pairs.

Examples::

    alignlit score --model out/quickstart/reward --input data/sim/sft_val.jsonl --output scored.jsonl
    alignlit score --model out/quickstart/reward --pairs data/sim/pairs_gold_val.jsonl --json acc.json

``--input`` records are ``{"prompt", "response"}`` (the prompt may be a list of chat messages) or
HH-RLHF dialogues (``{"chosen"}`` / ``{"text"}``); each output line is the input record plus
``"score"``. ``--pairs`` takes any preference format of :class:`~alignlit.data.PreferenceDataModule`
and reports pairwise accuracy, mean margin and the reward/length Pearson correlation. A pairwise
preference model (``PairwisePrefModule`` export) is measured on ``--pairs`` too (order-averaged
``P(chosen ≻ rejected)`` and position consistency).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from alignlit.data.preference import PairError, parse_pairs
from alignlit.data.records import parse_prompt_response, read_records
from alignlit.models.export import read_metadata
from alignlit.models.reward import AB_FORMAT_KEY, load_preference_model, load_reward_model, resolve_model_path


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors (nan when either is constant)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def _is_pairwise(path: Path) -> bool:
    config = path / "config.json"
    return config.exists() and AB_FORMAT_KEY in json.loads(config.read_text())


def score_records(
    model_dir: str, records, *, batch_size: int, max_length: int | None
) -> list[dict[str, Any]]:
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
    return [{**rec.fields, "score": float(s)} for rec, s in zip(records, scores, strict=True)]


def evaluate_pairs(model_dir: str, records, *, batch_size: int, max_length: int | None) -> dict[str, float]:
    """Accuracy and score statistics of a reward model (or a pairwise model) on preference pairs."""
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
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignlit score", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", required=True, help="exported reward model (or pairwise preference model) directory"
    )
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--input", help="records to score ({prompt, response} or HH-RLHF)")
    group.add_argument("--pairs", help="preference pairs: report accuracy and score statistics")
    p.add_argument("--output", help="with --input: where to write the scored records (JSONL)")
    p.add_argument("--json", help="with --pairs: also write the metrics as JSON here")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per forward (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=None, help="token limit (default: the training limit)")
    p.add_argument("--max-examples", type=int, default=None, help="use only the first N records")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.input and not args.output:
        parser.error("--input needs --output")
    torch.set_grad_enabled(False)
    source = args.input or args.pairs
    records = read_records(source)[: args.max_examples]
    try:
        if args.input:
            from alignlit.sim.data import write_jsonl

            scored = score_records(
                args.model, records, batch_size=args.batch_size, max_length=args.max_length
            )
            write_jsonl(args.output, scored)
            s = torch.tensor([r["score"] for r in scored])
            print(f"scored {len(scored)} records (mean {s.mean():.4f}, std {s.std():.4f}) -> {args.output}")
            return
        metrics = evaluate_pairs(args.model, records, batch_size=args.batch_size, max_length=args.max_length)
    except PairError as e:
        sys.exit(f"alignlit score: {e}")
    metrics = {
        "model": args.model,
        "pairs_file": args.pairs,
        "stage": read_metadata(args.model).get("stage"),
        **metrics,
    }
    print(json.dumps(metrics, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(metrics, indent=2) + "\n")
