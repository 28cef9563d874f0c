"""``alignlit sim``: write the simulated data set, or show examples with their gold reward.

alignlit sim make-data --out data/sim [--seed 0] [--n-sft 20000] [--n-pairs 10000] ...
alignlit sim make-multiturn-data --sim data/sim [--hint answer] [--n-train 5000] [--n-val 250]
alignlit sim make-pairs --sim data/sim --n 40000 [--out data/sim/pairs_extra_train.jsonl] [--seed 1]
alignlit sim label-samples --sim data/sim --samples ranked.jsonl --out pairs.jsonl [--pairs-per-prompt 1]
    [--include data/sim/pairs_extra_train.jsonl]
alignlit sim show [--n 5] [--split train] [--demos 4]
"""

from __future__ import annotations

import argparse
import inspect
import random
from collections.abc import Callable, Sequence
from typing import Any

from alignlit.sim.annotator import Annotator
from alignlit.sim.data import make_data, write_tokenizer
from alignlit.sim.multiturn import HINTS, write_multiturn_sft
from alignlit.sim.pairs import EXTRA_PAIRS, label_samples, make_extra_pairs
from alignlit.sim.task import SimTask


def _default(fn: Callable[..., Any], name: str) -> Any:
    """The default of parameter ``name`` of ``fn``: the signature stays the one place defaults live."""
    return inspect.signature(fn).parameters[name].default


def _add_task_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seed",
        type=int,
        default=_default(SimTask, "seed"),
        help="seed of prompts, demonstrations and labels",
    )
    parser.add_argument(
        "--ops",
        default=",".join(_default(SimTask, "ops")),
        help="comma-separated operations (default: %(default)s)",
    )
    parser.add_argument(
        "--symbols", default=_default(SimTask, "symbols"), help="alphabet (default: %(default)s)"
    )
    parser.add_argument(
        "--min-len",
        type=int,
        default=_default(SimTask, "min_len"),
        help="shortest input sequence (default: %(default)s)",
    )
    parser.add_argument(
        "--max-len",
        type=int,
        default=_default(SimTask, "max_len"),
        help="longest input sequence (default: %(default)s)",
    )


def _task(args: argparse.Namespace) -> SimTask:
    return SimTask(
        seed=args.seed,
        ops=tuple(op.strip() for op in args.ops.split(",") if op.strip()),
        symbols=args.symbols,
        min_len=args.min_len,
        max_len=args.max_len,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignlit sim", description="The simulated-human-feedback task.")
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser("make-data", help="write SFT, preference and prompt JSONL files")
    make.add_argument("--out", required=True, help="output directory")
    _add_task_args(make)
    make.add_argument(
        "--n-sft",
        type=int,
        default=_default(make_data, "n_sft"),
        help="SFT demonstrations (default: %(default)s)",
    )
    make.add_argument(
        "--n-pairs",
        type=int,
        default=_default(make_data, "n_pairs"),
        help="preference pairs (default: %(default)s)",
    )
    make.add_argument(
        "--n-prompts",
        type=int,
        default=_default(make_data, "n_prompts"),
        help="prompts for online stages (default: %(default)s)",
    )
    make.add_argument(
        "--n-val",
        type=int,
        default=_default(make_data, "n_val"),
        help="rows of each validation file (default: %(default)s)",
    )
    make.add_argument(
        "--n-test",
        type=int,
        default=_default(make_data, "n_test"),
        help="test prompts (default: %(default)s)",
    )
    make.add_argument(
        "--temperature",
        type=float,
        default=_default(Annotator, "temperature"),
        help="annotator τ (default: %(default)s)",
    )
    make.add_argument(
        "--length-bias",
        type=float,
        default=_default(Annotator, "length_bias"),
        help="annotator length bias b (default: %(default)s)",
    )
    make.add_argument(
        "--label-noise",
        type=float,
        default=_default(Annotator, "label_noise"),
        help="annotator label flips (default: %(default)s)",
    )
    make.add_argument(
        "--tokenizer-vocab",
        type=int,
        default=512,
        help="also train a byte-level BPE tokenizer of this size on the written text into OUT/tokenizer "
        "(0: skip; default: %(default)s)",
    )

    multi = commands.add_parser(
        "make-multiturn-data",
        help="write sft_multiturn_{train,val}.jsonl: the SFT rows plus second-turn demonstrations of the hint task",
    )
    multi.add_argument("--sim", required=True, help="a make-data directory (its SFT rows and tokenizer)")
    multi.add_argument("--hint", default=_default(write_multiturn_sft, "hint"), choices=sorted(HINTS))
    for split in ("train", "val"):
        multi.add_argument(
            f"--n-{split}",
            type=int,
            default=_default(write_multiturn_sft, f"n_{split}"),
            help=f"second-turn demonstrations added to sft_{split}.jsonl's rows (default: %(default)s)",
        )
    multi.add_argument("--seed", type=int, default=_default(write_multiturn_sft, "seed"))

    more = commands.add_parser(
        "make-pairs", help="write more annotator-labelled demonstration pairs on unused training prompts"
    )
    more.add_argument("--sim", required=True, help="a make-data directory (task, annotator, prompts used)")
    more.add_argument("--n", type=int, required=True, help="pairs to write, one per new training prompt")
    more.add_argument("--out", help=f"output file (default: SIM/{EXTRA_PAIRS})")
    more.add_argument("--seed", type=int, default=_default(make_extra_pairs, "seed"))

    label = commands.add_parser(
        "label-samples", help="annotator-labelled pairs of a policy's samples (an `alignlit sample` output)"
    )
    label.add_argument("--sim", required=True, help="a make-data directory (task and annotator)")
    label.add_argument(
        "--samples", required=True, help="`alignlit sample --out` file (training prompts only)"
    )
    label.add_argument("--out", required=True, help="pair file to write")
    label.add_argument(
        "--pairs-per-prompt",
        type=int,
        default=_default(label_samples, "pairs_per_prompt"),
        help="disjoint pairs of different responses per prompt (default: %(default)s)",
    )
    label.add_argument("--seed", type=int, default=_default(label_samples, "seed"))
    label.add_argument(
        "--include",
        nargs="*",
        default=[],
        help="pair files whose rows go first into --out (e.g. make-pairs' output)",
    )

    show = commands.add_parser("show", help="print a few prompts with demonstrations and their gold reward")
    _add_task_args(show)
    show.add_argument("--split", default="train", choices=("train", "val", "test"))
    show.add_argument("--n", type=int, default=5, help="prompts to show (default: %(default)s)")
    show.add_argument("--demos", type=int, default=4, help="demonstrations per prompt (default: %(default)s)")
    return parser


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``alignlit sim``; ``argv`` is what follows ``sim`` on the command line."""
    args = build_parser().parse_args(argv)
    if args.command == "make-multiturn-data":
        rows = write_multiturn_sft(
            args.sim, n_train=args.n_train, n_val=args.n_val, hint=args.hint, seed=args.seed
        )
        print(f"wrote {args.sim}:")
        for name, count in rows.items():
            print(f"  {name:<26} {count:>7} rows")
        return 0
    if args.command in ("make-pairs", "label-samples"):
        if args.command == "make-pairs":
            stats = make_extra_pairs(args.sim, args.n, out=args.out, seed=args.seed)
            out = args.out or f"{args.sim}/{EXTRA_PAIRS}"
        else:
            stats = label_samples(
                args.sim,
                args.samples,
                args.out,
                pairs_per_prompt=args.pairs_per_prompt,
                seed=args.seed,
                include=args.include,
            )
            out = args.out
        print(
            f"wrote {out}: {stats['rows']} labelled pairs"
            + (f" after {stats['included_rows']} included ones" if stats.get("included_rows") else "")
            + "; the annotator agrees with gold on "
            f"{_fmt(stats['annotator_gold_agreement'])} of those with unequal gold; chosen is the longer in "
            f"{_fmt(stats['chosen_longer_fraction'])} of unequal-length pairs"
        )
        return 0
    task = _task(args)
    if args.command == "make-data":
        annotator = Annotator(
            temperature=args.temperature,
            length_bias=args.length_bias,
            label_noise=args.label_noise,
            seed=args.seed,
            task=task,
        )
        manifest = make_data(
            args.out,
            seed=args.seed,
            n_sft=args.n_sft,
            n_pairs=args.n_pairs,
            n_prompts=args.n_prompts,
            n_val=args.n_val,
            n_test=args.n_test,
            task=task,
            annotator=annotator,
        )
        if args.tokenizer_vocab:
            write_tokenizer(args.out, vocab_size=args.tokenizer_vocab)
        print(f"wrote {args.out}:")
        for info in manifest["files"].values():
            print(f"  {info['path']:<26} {info['rows']:>7} rows")
        sft, pairs = manifest["stats"]["sft"]["train"], manifest["stats"]["pairs"]["train"]
        length_gap = None
        if pairs["chosen_mean_words"] is not None:
            length_gap = pairs["chosen_mean_words"] - pairs["rejected_mean_words"]
        print(
            f"train demos: mean gold {_fmt(sft['demo_mean_gold'])} (ideal {_fmt(sft['ideal_mean_gold'])}), "
            f"mean words {_fmt(sft['demo_mean_words'])}"
        )
        print(
            f"train pairs: annotator agrees with gold on {_fmt(pairs['annotator_gold_agreement'])} "
            f"({pairs['gold_ties_dropped']} gold ties dropped); chosen/rejected mean gold "
            f"{_fmt(pairs['chosen_mean_gold'])}/{_fmt(pairs['rejected_mean_gold'])}; chosen - rejected words "
            f"{_fmt(length_gap)}; chosen is the longer in {_fmt(pairs['chosen_longer_fraction'])} of unequal pairs"
        )
        return 0
    rng = random.Random(f"alignlit.sim.show:{args.seed}")
    for prompt in task.prompts(args.n, args.split):
        ideal = task.ideal(prompt)
        print(f"{prompt!r}\n  ideal {ideal!r} gold {task.gold_reward(prompt, ideal):+.2f}")
        for _ in range(args.demos):
            kind = task.demo_kind(rng)
            response = task.demonstration(prompt, rng, kind=kind)
            print(f"  {kind:<8}{response!r} gold {task.gold_reward(prompt, response):+.2f}")
    return 0
