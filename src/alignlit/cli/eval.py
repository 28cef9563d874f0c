"""``alignlit eval``: gold reward of policies on the simulated task's held-out prompts.

Example::

    alignlit eval --sim data/sim --policy out/quickstart/sft --reference out/quickstart/sft \\
        --untrained data/sim/tokenizer --best-of 1 4 16 --json out/quickstart/eval.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from alignlit.data.records import parse_prompt, read_records
from alignlit.eval.gold import EvalResult, best_of_n, evaluate_policy, format_table
from alignlit.eval.score import rm_selector
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
    p.add_argument("--greedy", action="store_true", help="also evaluate greedy decoding")
    p.add_argument("--best-of", type=int, nargs="*", default=[], help="best-of-n rows")
    p.add_argument(
        "--select",
        default="gold",
        help="who picks the best of n: 'gold' (oracle) or a reward-model directory (default: gold)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per generate call")
    p.add_argument("--json", help="also write the results as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> list[EvalResult]:
    from alignlit.models import TinyLlama, load_policy

    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("n_prompts", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.best_of):
        parser.error(f"--best-of values must be >= 1, got {args.best_of}")
    torch.manual_seed(args.seed)
    task, manifest = load_sim(args.sim)
    prompt_file = Path(args.sim) / f"prompts_{args.split}.jsonl"
    prompts = [parse_prompt(r) for r in read_records(prompt_file)][: args.n_prompts]
    sampling = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    reference = load_policy(args.reference)[0].eval() if args.reference else None

    names = args.name or [Path(p).name for p in args.policy]
    if len(names) != len(args.policy):
        parser.error(f"{len(args.policy)} --policy but {len(names)} --name")
    candidates = [(name, path) for name, path in zip(names, args.policy)]
    if args.untrained:
        candidates.insert(0, ("untrained", TinyLlama(tokenizer=args.untrained)))

    select_fn = None if args.select == "gold" else rm_selector(args.select)
    results: list[EvalResult] = []
    for name, source in candidates:
        policy, tokenizer = load_policy(source)
        policy.eval()
        common = dict(name=name, batch_size=args.batch_size)
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
        for n in args.best_of:
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
    print(format_table(results))
    demos = manifest["stats"]["sft"]["train"]
    print(
        f"\ndemonstrations (sft_train.jsonl): mean gold {demos['demo_mean_gold']:.3f}; "
        f"ideal answers: {demos['ideal_mean_gold']:.3f}; {len(prompts)} {args.split} prompts"
    )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {"results": [r.as_dict() for r in results], "demonstrations": demos, "prompts": len(prompts)},
                indent=2,
            )
            + "\n"
        )
    return results
