"""``alignlit score``: score records with a trained reward model, or measure it on preference pairs.

Examples::

    alignlit score --model out/quickstart/reward --input data/sim/sft_val.jsonl --output scored.jsonl
    alignlit score --model out/quickstart/reward --pairs data/sim/pairs_gold_val.jsonl --json acc.json

``--input`` records are ``{"prompt", "response"}`` (the prompt may be a list of chat messages) or
HH-RLHF dialogues (``{"chosen"}`` / ``{"text"}``); each output line is the input record plus
``"score"``. ``--pairs`` takes any preference format of :class:`~alignlit.data.PreferenceDataModule`
and reports pairwise accuracy, mean margin and the reward/length Pearson correlation. A pairwise
preference model (``PairwisePrefModule`` export) is measured on ``--pairs`` too (order-averaged
``P(chosen ≻ rejected)`` and position consistency). The model must hold a trained head: a policy
directory is refused (:func:`alignlit.models.load_reward_model`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from alignlit.data.pair_records import PairError
from alignlit.data.records import read_records
from alignlit.eval.score import evaluate_pairs, score_records
from alignlit.hub import ModelNotFoundError, RemoteCodeError
from alignlit.models.export import read_metadata
from alignlit.models.reward_model import PositionsError, resolve_model_path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignlit score", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        required=True,
        help="exported reward model (or pairwise preference model) directory, or hub id org/name[@revision]",
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
    for name in ("batch_size", "max_examples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.max_length is not None and args.max_length < 2:
        parser.error(f"--max-length must be >= 2, got {args.max_length}")
    source = args.input or args.pairs
    records = read_records(source)[: args.max_examples]
    try:
        model_dir = str(resolve_model_path(args.model, what="reward model"))
        with torch.no_grad():
            if args.input:
                from alignlit.sim.data import write_jsonl

                counts: dict[str, int] = {}
                scored = score_records(
                    model_dir, records, batch_size=args.batch_size, max_length=args.max_length, counts=counts
                )
                write_jsonl(args.output, scored)
                s = torch.tensor([r["score"] for r in scored])
                spread = f", std {s.std():.4f}" if len(s) > 1 else ""
                print(f"scored {len(scored)} records (mean {s.mean():.4f}{spread}) -> {args.output}")
                print(truncation_line(counts))
                return
            metrics = evaluate_pairs(
                model_dir, records, batch_size=args.batch_size, max_length=args.max_length
            )
    except (PairError, ModelNotFoundError, RemoteCodeError) as e:
        sys.exit(f"alignlit score: {e}")
    except PositionsError as e:
        parser.error(f"--max-length {args.max_length}: {e}")
    metrics = {
        "model": args.model,
        "pairs_file": args.pairs,
        "stage": read_metadata(model_dir).get("stage"),
        **metrics,
    }
    print(json.dumps(metrics, indent=2))
    if "sequences" in metrics:
        print(truncation_line(metrics))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(metrics, indent=2) + "\n")


def truncation_line(counts: dict[str, int]) -> str:
    """What the reward model's length limits cut, in one line (``RewardModel.counts``)."""
    return (
        f"alignlit score: of {counts['sequences']} scored sequences, {counts['prompts_left_truncated']} had their "
        f"prompt left-truncated and {counts['responses_right_truncated']} their response cut to fit the reward "
        "model's max_length (its training limits; --max-length changes them)"
    )
