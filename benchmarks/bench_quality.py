"""The quality table on the simulated task: gold reward, KL to the SFT policy and response length.

Rows, all on the same held-out test prompts, sampled at temperature 1 with the same seed:
the SFT policy; best-of-n of the SFT policy (selected by the reward model when one is given,
otherwise by the gold reward itself: an oracle upper bound); and every trained policy (DPO, RRHF,
PPO, ...). KL is the Monte-Carlo ``KL(π ‖ π_SFT)`` per response; for best-of-n it is the analytic
``log n - (n-1)/n``. Prints a Markdown table and writes ``benchmarks/results/quality.{json,md}``.

    python benchmarks/bench_quality.py        # the quickstart's out/quickstart/{sft,reward,dpo,rrhf,ppo}
    python benchmarks/bench_quality.py --policy dpo=out/x/dpo rrhf=out/x/rrhf --reward out/x/reward
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from alignlit.data import parse_prompt, read_records
from alignlit.eval.gold import EvalResult, best_of_n, evaluate_policy, format_table
from alignlit.models import load_policy
from alignlit.rollout import SamplingParams
from alignlit.sim import load_sim

QUICKSTART = Path("out/quickstart")
DEFAULT_POLICIES = {name: str(QUICKSTART / name) for name in ("dpo", "rrhf", "ppo")}


def blank_safe(score_fn):
    """A selection score that ranks blank responses last: a reward model cannot score an empty
    response (its encoding raises), and an empty answer is never the best of n."""

    def select(prompts, responses):
        kept = [i for i, r in enumerate(responses) if r.strip()]
        out = torch.full((len(responses),), float("-inf"))
        if kept:
            out[kept] = torch.as_tensor(
                score_fn([prompts[i] for i in kept], [responses[i] for i in kept]), dtype=torch.float32
            )
        return out.tolist()

    return select


def parse_policies(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"bench_quality: --policy takes NAME=DIR, got {item!r}")
        out[name] = path
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", default="data/sim", help="`alignlit sim make-data` directory")
    p.add_argument("--sft", default=str(QUICKSTART / "sft"), help="SFT policy (the KL reference)")
    p.add_argument(
        "--reward",
        default=str(QUICKSTART / "reward"),
        help="reward model selecting best-of-n (missing: oracle selection by the gold reward)",
    )
    p.add_argument(
        "--policy",
        nargs="*",
        default=None,
        help="NAME=DIR rows (default: dpo, rrhf, ppo under out/quickstart/, those that exist)",
    )
    p.add_argument("--best-of", type=int, nargs="*", default=[4], help="best-of-n rows (default: 4)")
    p.add_argument(
        "--oracle", action="store_true", help="also best-of-n selected by the gold reward (an upper bound)"
    )
    p.add_argument("--n-prompts", type=int, default=500, help="held-out test prompts (default: 500)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="response token limit (default: 24)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per generate call")
    p.add_argument("--out", default="benchmarks/results/quality", help="output path without extension")
    return p


def main(argv: list[str] | None = None) -> list[EvalResult]:
    args = build_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    if not Path(args.sft).is_dir():
        raise SystemExit(f"bench_quality: no SFT policy at {args.sft}; run the quickstart first (README)")
    if args.policy is None:
        policies = {k: v for k, v in DEFAULT_POLICIES.items() if Path(v).is_dir()}
        skipped = sorted(set(DEFAULT_POLICIES) - set(policies))
        if skipped:
            print(f"bench_quality: not trained yet, skipped: {', '.join(skipped)}")
    else:
        policies = parse_policies(args.policy)
        missing = [f"{k}={v}" for k, v in policies.items() if not Path(v).is_dir()]
        if missing:
            raise SystemExit(f"bench_quality: no policy directory for {', '.join(missing)}")

    task, _ = load_sim(args.sim)
    prompts = [parse_prompt(r) for r in read_records(Path(args.sim) / "prompts_test.jsonl")][: args.n_prompts]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    sft, tokenizer = load_policy(args.sft)
    sft.eval()
    common = dict(sampling=sampling, batch_size=args.batch_size)
    start = time.perf_counter()

    results = [
        evaluate_policy(sft, tokenizer, prompts, task.gold_rewards, reference=sft, name="SFT", **common)
    ]
    select_fn, selector = None, "oracle: gold"
    if Path(args.reward).is_dir():
        from alignlit.models import load_reward_model

        select_fn, selector = (
            blank_safe(load_reward_model(args.reward, batch_size=args.batch_size).score),
            "RM",
        )
    selectors = [(select_fn, selector)]
    if args.oracle and select_fn is not None:
        selectors.append((None, "oracle: gold"))
    for n in args.best_of:
        for fn, label in selectors:
            results.append(
                best_of_n(
                    sft,
                    tokenizer,
                    prompts,
                    task.gold_rewards,
                    n=n,
                    select_fn=fn,
                    name=f"SFT best-of-{n} ({label})",
                    **common,
                )
            )
    for name, path in policies.items():
        policy, policy_tokenizer = load_policy(path)
        policy.eval()
        results.append(
            evaluate_policy(
                policy, policy_tokenizer, prompts, task.gold_rewards, reference=sft, name=name, **common
            )
        )

    table = format_table(results)
    print(table)
    elapsed = time.perf_counter() - start
    print(f"\n{len(prompts)} test prompts, T=1, seed {args.seed}; KL to {args.sft}; {elapsed:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {
        "sim": args.sim,
        "sft": args.sft,
        "reward": args.reward if select_fn is not None else None,
        "policies": policies,
        "prompts": len(prompts),
        "temperature": 1.0,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
    }
    out.with_suffix(".json").write_text(
        json.dumps({"setup": setup, "results": [r.as_dict() for r in results]}, indent=2) + "\n"
    )
    out.with_suffix(".md").write_text(table + "\n")
    return results


if __name__ == "__main__":
    main()
