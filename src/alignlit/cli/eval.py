"""``alignlit eval --sim``: gold reward of policies on the simulated task's held-out prompts.

Without ``--sim``, ``alignlit eval`` evaluates policies on real prompts with a verifiable reward
(accuracy, pass@k, length, KL): :mod:`alignlit.cli.eval_data`.

Example::

    alignlit eval --sim data/sim --policy out/quickstart/sft out/quickstart/dpo --name SFT DPO \\
        --reference out/quickstart/sft --best-of 4 16 --json out/quickstart/eval.json \\
        --plot out/quickstart/frontier.png

A progress bar per row goes to stderr; the table (with each row's win rate against the reference
policy's row) to stdout; ``--plot`` draws gold reward against KL to the reference for every row that
has a KL (:func:`alignlit.eval.plots.plot_frontier`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from alignlit.data.encoding import OVERFLOW_CHOICES
from alignlit.data.records import parse_prompt, read_records
from alignlit.eval.gold import EvalResult, best_of_n, evaluate_policy, format_table, win_rate
from alignlit.eval.lengths import Reader, describe, fit_prompts
from alignlit.eval.score import rm_selector
from alignlit.models.reward_model import model_positions
from alignlit.rollout.base import SamplingParams
from alignlit.sim import load_sim


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignlit eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", required=True, help="directory written by `alignlit sim make-data`")
    p.add_argument("--policy", nargs="*", default=[], help="policy directories to evaluate")
    p.add_argument(
        "--name", nargs="*", default=None, help="row names for --policy (default: directory names)"
    )
    p.add_argument("--untrained", help="tokenizer directory: also evaluate a randomly initialised tiny model")
    p.add_argument("--reference", help="reference policy directory for the KL column (e.g. the SFT policy)")
    p.add_argument("--split", default="test", choices=("val", "test"), help="prompt split (default: test)")
    p.add_argument("--n-prompts", type=int, default=500, help="held-out prompts (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="response token limit (default: 24)")
    p.add_argument(
        "--prompt-overflow",
        choices=OVERFLOW_CHOICES,
        default="error",
        help="a prompt too long for a policy's (or the reference's) positions with --max-new-tokens after "
        "it: refuse ('error', the default), keep its end ('truncate') or leave it out ('drop'); counted",
    )
    p.add_argument("--greedy", action="store_true", help="also evaluate greedy decoding")
    p.add_argument("--best-of", type=int, nargs="*", default=[], help="best-of-n rows")
    p.add_argument(
        "--best-of-for",
        nargs="*",
        default=None,
        help="row names that get the --best-of rows (default: every policy)",
    )
    p.add_argument(
        "--select",
        nargs="+",
        default=["gold"],
        help="who picks the best of n: 'gold' (oracle) and/or reward-model directories, one set of "
        "best-of-n rows each (default: gold)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per generate call")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--plot", help="also write the gold-vs-KL plot (PNG) here; needs --reference")
    p.add_argument(
        "--baseline",
        help="row name the win-rate column compares with (default: the --policy that is the --reference)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def frontier_points(results: Sequence[EvalResult]) -> list[dict]:
    """The rows of ``results`` as :func:`~alignlit.eval.plots.plot_frontier` points (rows without a
    KL are left out); each policy's best-of-n rows and its own sampled row form one series per selector."""
    selectors = {}
    for r in results:
        if r.mode.startswith("best-of-"):
            selectors.setdefault(r.name, set()).add("RM" if r.mode.endswith("(RM)") else "gold")
    points = []
    for r in results:
        if r.kl_to_reference is None:
            continue
        if r.mode.startswith("best-of-"):
            selector = "RM" if r.mode.endswith("(RM)") else "gold"
            name, series = f"{r.name} {r.mode.removesuffix(' (RM)')} ({selector})", [selector]
        elif r.mode.startswith("T="):  # the n = 1 end of the policy's best-of-n curves
            name, series = r.name, sorted(selectors.get(r.name, ()))
        else:
            name, series = f"{r.name} {r.mode}", []
        points.append(
            {
                "name": name,
                "kl": r.kl_to_reference,
                "gold": r.gold,
                "gold_err": r.gold_stderr,
                "series": [f"{r.name} best-of-n ({s})" for s in series],
            }
        )
    return points


def main(argv: Sequence[str] | None = None) -> list[EvalResult]:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--sim" or a.startswith("--sim=") for a in argv):
        from alignlit.cli.eval_data import main as eval_data

        if not argv or argv[0] in ("-h", "--help"):
            build_parser().print_help()
            print("\n(without --sim: real prompts and a verifiable reward)\n")
        return eval_data(argv)
    from alignlit.models import TinyLlama, load_policy

    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("n_prompts", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.best_of):
        parser.error(f"--best-of values must be >= 1, got {args.best_of}")
    if args.plot and not args.reference:
        parser.error("--plot needs --reference (the policy the KL axis is measured to)")
    names = args.name or [Path(p).name for p in args.policy]
    if len(names) != len(args.policy):
        parser.error(f"{len(args.policy)} --policy but {len(names)} --name")
    baseline = args.baseline
    if baseline is None and args.reference:
        same = [n for n, p in zip(names, args.policy) if Path(p).resolve() == Path(args.reference).resolve()]
        baseline = same[0] if same else None
    row_names = (["untrained"] if args.untrained else []) + names
    if baseline is not None and baseline not in row_names:
        parser.error(f"--baseline {baseline!r} is not a row name ({', '.join(row_names)})")
    unknown = sorted(set(args.best_of_for or ()) - set(row_names))
    if unknown:
        parser.error(f"--best-of-for names no row: {', '.join(unknown)} (rows: {', '.join(row_names)})")
    torch.manual_seed(args.seed)
    task, manifest = load_sim(args.sim)
    prompt_file = Path(args.sim) / f"prompts_{args.split}.jsonl"
    records = read_records(prompt_file)[: args.n_prompts]
    prompts = [parse_prompt(r) for r in records]
    readers = prompt_readers(args)
    try:
        prompts, fitted = fit_prompts(
            prompts,
            readers,
            max_new_tokens=args.max_new_tokens,
            overflow=args.prompt_overflow,
            sources=[r.source for r in records],
        )
    except ValueError as e:
        parser.error(str(e))
    if describe(fitted, readers, args.max_new_tokens):
        print(f"alignlit eval: {describe(fitted, readers, args.max_new_tokens)}")
    if not prompts:
        parser.error(f"{prompt_file}: no prompt fits the policies (--prompt-overflow drop left none)")
    sampling = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    reference = load_policy(args.reference)[0].eval() if args.reference else None

    candidates = [(name, path) for name, path in zip(names, args.policy)]
    if args.untrained:
        candidates.insert(0, ("untrained", TinyLlama(tokenizer=args.untrained)))

    selectors = [None if spec == "gold" else rm_selector(spec) for spec in args.select]
    results: list[EvalResult] = []
    for name, source in candidates:
        policy, tokenizer = load_policy(source)
        policy.eval()
        common = dict(name=name, batch_size=args.batch_size, progress=not args.no_progress)
        results.append(
            evaluate_policy(
                policy,
                tokenizer,
                prompts,
                task.gold_rewards,
                sampling=sampling,
                reference=reference,
                **common,
            )
        )
        if args.greedy:
            results.append(
                evaluate_policy(policy, tokenizer, prompts, task.gold_rewards, sampling=greedy, **common)
            )
        for n in args.best_of if args.best_of_for is None or name in args.best_of_for else ():
            for select_fn in selectors:
                results.append(
                    best_of_n(
                        policy,
                        tokenizer,
                        prompts,
                        task.gold_rewards,
                        n=n,
                        sampling=sampling,
                        select_fn=select_fn,
                        **common,
                    )
                )
    print(format_table(results, baseline=baseline))
    for spec, select_fn in zip(args.select, selectors):
        rm_cut = getattr(getattr(select_fn, "reward", None), "describe_truncation", None)
        if callable(rm_cut) and rm_cut():
            print(f"alignlit eval: {spec}: {rm_cut()}")
    demos = manifest["stats"]["sft"]["train"]
    print(
        f"\ndemonstrations (sft_train.jsonl): mean gold {demos['demo_mean_gold']:.3f}; "
        f"ideal answers: {demos['ideal_mean_gold']:.3f}; {len(prompts)} {args.split} prompts"
    )
    if args.json:
        rows = [r.as_dict() for r in results]
        if baseline is not None:
            base = next(r for r in results if r.name == baseline)
            for row, r in zip(rows, results):
                row[f"win_vs_{baseline}"] = win_rate(r.prompt_gold, base.prompt_gold)
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "results": rows,
                    "demonstrations": demos,
                    "prompts": len(prompts),
                    "split": args.split,
                    "prompt_fit": fitted,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"alignlit eval: results -> {out}")
    if args.plot:
        from alignlit.eval.plots import plot_frontier

        written = plot_frontier(
            frontier_points(results),
            args.plot,
            title=f"gold reward vs KL to {args.reference} ({len(prompts)} {args.split} prompts, "
            f"{sampling_label(sampling)})",
            baseline=baseline,
        )
        print(f"alignlit eval: gold-vs-KL plot -> {written}")
    return results


def prompt_readers(args) -> list[Reader]:
    """Every model that reads the prompts (the policies, the untrained model, the reference), with its
    tokenizer and positions, read from its config without loading weights."""
    from transformers import AutoConfig

    from alignlit.data.tokenizer import load_tokenizer
    from alignlit.hub import resolve_model
    from alignlit.models import TinyLlama
    from alignlit.models.lora import adapter_base, is_adapter_dir

    readers = []
    if args.untrained:
        spec = TinyLlama(tokenizer=args.untrained)
        readers.append(
            Reader("the untrained model", load_tokenizer(args.untrained), spec.max_position_embeddings)
        )
    for role, path in [("policy", p) for p in args.policy] + [("reference", args.reference)] * bool(
        args.reference
    ):
        try:  # a hub id: its cached snapshot (a model that does not resolve: load_policy says why)
            local = resolve_model(path, what=role)
        except (FileNotFoundError, ValueError):
            continue
        config = AutoConfig.from_pretrained(str(adapter_base(local) if is_adapter_dir(local) else local))
        readers.append(Reader(f"the {role} {path}", load_tokenizer(local), model_positions(config)))
    return readers


def sampling_label(sampling: SamplingParams) -> str:
    return "greedy" if sampling.temperature == 0 else f"T={sampling.temperature:g}, seed {sampling.seed}"
