"""``alignlit eval`` on real prompts: any policy, any verifiable reward, a table and JSON.

Example (GSM8K test accuracy of the GRPO recipe's export against the instruct model it started from)::

    alignlit eval --policy Qwen/Qwen2.5-0.5B-Instruct out/recipes/gsm8k-grpo --name instruct grpo \\
        --dataset openai/gsm8k --dataset-name main --split test --columns question:prompt --chat \\
        --system-prompt "Solve the math problem step by step. Write the final answer as a number after '####'." \\
        --reward alignlit.rewards.math.MathVerifyReward --samples 4 --reference Qwen/Qwen2.5-0.5B-Instruct \\
        --json out/recipes/gsm8k-eval.json

The prompts come from a :class:`~alignlit.data.PromptDataModule` built from these arguments, so they are
rendered exactly as training renders them and carry their reference answers (``answer`` column) to the
reward. ``--prompts FILE`` reads a local JSONL/JSON/Parquet file instead of ``--dataset``. Rows:
:mod:`alignlit.eval.verifiable`. Without ``--sim`` this is the command ``alignlit eval`` runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from alignlit.checks import import_object
from alignlit.data.encoding import OVERFLOW_CHOICES
from alignlit.data.sources import columns_from_pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignlit eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", nargs="+", required=True, help="policies: hub ids or directories")
    p.add_argument("--name", nargs="*", default=None, help="row names for --policy (default: the ids)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--dataset", help="a datasets.load_dataset path: a hub dataset (openai/gsm8k) or json/parquet"
    )
    src.add_argument("--prompts", help="a local prompt file (JSONL, JSON, Parquet)")
    p.add_argument("--dataset-name", help="the dataset's configuration (e.g. main for openai/gsm8k)")
    p.add_argument("--data-files", help="data_files for --dataset json/parquet")
    p.add_argument(
        "--split", default="test", help="the split (default: test; slices such as test[:200] work)"
    )
    p.add_argument(
        "--columns", nargs="*", default=[], metavar="SRC:DST", help="rename columns, e.g. question:prompt"
    )
    p.add_argument("--chat", action="store_true", help="render string prompts with the chat template")
    p.add_argument("--system-prompt", help="system message before each rendered prompt")
    p.add_argument("--reward", required=True, help="dotted path of a reward class or function")
    p.add_argument("--reward-args", default="{}", help="JSON keyword arguments of a reward class")
    p.add_argument("--threshold", type=float, default=1.0, help="a sample is correct at reward >= this")
    p.add_argument("--n-prompts", type=int, default=None, help="the first N prompts (default: all)")
    p.add_argument("--max-prompt-length", type=int, default=None, help="prompt token limit (overflow policy)")
    p.add_argument("--prompt-overflow", choices=OVERFLOW_CHOICES, default="error")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--no-greedy", action="store_true", help="no greedy accuracy row")
    p.add_argument("--samples", type=int, default=0, help="k sampled responses per prompt: mean@k, pass@k")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled responses")
    p.add_argument("--reference", help="reference policy for the KL column (with --samples)")
    p.add_argument("--dtype", default="float32", help="dtype the policies are loaded in")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def reward_from(spec: str, args_json: str, parser: argparse.ArgumentParser):
    """A reward from a dotted path: a class is built with ``--reward-args``, a function used as it is."""
    try:
        kwargs = json.loads(args_json)
    except json.JSONDecodeError as e:
        parser.error(f"--reward-args is not JSON ({e})")
    if not isinstance(kwargs, dict):
        parser.error("--reward-args must be a JSON object")
    try:
        obj = import_object(spec)
    except ImportError as e:
        parser.error(f"--reward {spec!r} cannot be imported ({e})")
    if isinstance(obj, type):
        return obj(**kwargs)
    if kwargs:
        parser.error(f"--reward-args given, but --reward {spec!r} is not a class")
    return obj


def prompt_module(args, tokenizer_source: str, parser: argparse.ArgumentParser):
    from alignlit.data import PromptDataModule

    try:
        columns = columns_from_pairs(args.columns)
    except ValueError as e:
        parser.error(str(e))
    source: dict = {"train_file": args.prompts}
    if args.dataset:
        spec = {"path": args.dataset, "split": args.split}
        spec.update({k: v for k, v in (("name", args.dataset_name), ("data_files", args.data_files)) if v})
        source = {"dataset": spec}
    return PromptDataModule(
        **source, columns=columns, chat=args.chat, system_prompt=args.system_prompt,
        max_prompt_length=args.max_prompt_length, overflow=args.prompt_overflow, tokenizer=tokenizer_source,
        max_examples=args.n_prompts,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None):
    from alignlit.eval.verifiable import evaluate_verifiable, format_verifiable
    from alignlit.models import load_policy

    parser = build_parser()
    args = parser.parse_args(argv)
    names = args.name or list(args.policy)
    if len(names) != len(args.policy):
        parser.error(f"{len(args.policy)} --policy but {len(names)} --name")
    if args.no_greedy and args.samples < 1:
        parser.error("--no-greedy needs --samples k >= 1 (nothing else to evaluate)")
    if args.reference and args.samples < 1:
        parser.error(
            "--reference (the KL column) needs --samples k >= 1: KL is measured on sampled responses"
        )
    reward = reward_from(args.reward, args.reward_args, parser)
    dm = prompt_module(args, args.policy[0], parser)
    dm.setup("validate")
    prompts = dm.train_prompts
    reference = load_policy(args.reference, dtype=args.dtype)[0].eval() if args.reference else None
    results = []
    for name, source in zip(names, args.policy):
        policy, tokenizer = load_policy(source, dtype=args.dtype)
        if tokenizer.get_vocab() != dm.tokenizer.get_vocab():
            parser.error(
                f"{source}: its tokenizer differs from {args.policy[0]}'s, which rendered the prompts"
            )
        results.append(
            evaluate_verifiable(
                policy.eval(),
                tokenizer,
                prompts,
                reward,
                name=name,
                greedy=not args.no_greedy,
                k=args.samples,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                threshold=args.threshold,
                reference=reference,
                seed=args.seed,
                batch_size=args.batch_size,
                progress=not args.no_progress,
            )
        )
    print(format_verifiable(results))
    counts = getattr(reward, "counts", None)
    if counts:
        print(f"alignlit eval: reward counts {dict(counts)}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "results": [r.as_dict() for r in results],
            "prompts": len(prompts),
            "source": dm.train_source,
            "reward": args.reward,
            "max_new_tokens": args.max_new_tokens,
            "data": dm.drops(),
        }
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"alignlit eval: results -> {out}")
    return results
