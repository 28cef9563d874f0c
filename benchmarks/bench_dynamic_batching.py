"""Token-budget dynamic batching: one GRPO update over rows of mixed lengths, fixed row-count minibatches
against ``minibatches.token_budget``.

What runs: a tiny Llama built from a config (``--hidden``, ``--layers``; a BPE tokenizer trained here), a
hand-built rollout of ``--prompts`` x ``--samples`` rows with prompts of 16..48 and responses of
``--min-response``..``--max-response`` tokens (uniform, seeded; random token ids), and
:class:`alignlit.modules.PolicyGradientModule` (GRPO, PPO-clip, token mean) on it:

- **log-probs**: ``make_trajectory``, the no-grad old and reference log-prob passes (split by the budget);
- **update**: ``train_on``, minibatches of ``--size`` rows, each one AdamW step over its forward/backward
  passes: one pass per minibatch padded to the rollout's widths (budget none), or micro-batches of at most
  the budget's padded tokens, each cut to its longest row.

Both sides run in one process, one setting after the other (a fresh module each; ``--repeats`` timings after a
warm-up, medians; each setting a cell of ``--work``, so a stopped run resumes), under the default forward settings
(``packing="auto"``: a batch whose padding is at least a quarter of its tokens already runs packed) and
with packing off (``--packing both``). Reported per setting: micro-batches per step, the padding share of
the update's forwards (``perf/padding_share``; the unbudgeted rows' share of the rollout-wide padded
layout), seconds of the two phases, update tokens/s (real tokens of the update over its seconds) and the
speed-up over the unbudgeted update. Writes ``benchmarks/results/dynamic_batching.{md,json}``.

    python benchmarks/bench_dynamic_batching.py
    python benchmarks/bench_dynamic_batching.py --tiny      # seconds, for tests
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see bench_vs_trl.py)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from alignlit.models import train_bpe_tokenizer
from alignlit.models.forward_settings import use_forward_settings
from alignlit.models.tiny import TinyLlama
from alignlit.modules import Minibatches, PolicyGradientModule
from alignlit.rollout import Experience, RolloutLoop, SamplingParams
from alignlit.rollout.base import Rollout
from harness import RESULTS, Cells, markdown_table, write_results  # benchmarks/ is on sys.path


def rollout_of(args, vocab: int) -> tuple[Rollout, torch.Tensor]:
    """The hand-built rollout (left-padded prompts, right-padded responses) and its rewards."""
    g = torch.Generator().manual_seed(args.seed)
    rows, n = args.prompts * args.samples, args.samples
    prompt, response = 48, args.max_response
    p_len = torch.randint(16, prompt + 1, (args.prompts,), generator=g).repeat_interleave(n)
    r_len = torch.randint(args.min_response, response + 1, (rows,), generator=g)
    prompt_mask = torch.arange(prompt) >= prompt - p_len[:, None]
    prompt_ids = (
        torch.randint(3, vocab, (args.prompts, prompt), generator=g).repeat_interleave(n, 0) * prompt_mask
    )
    response_mask = torch.arange(response) < r_len[:, None]
    response_ids = torch.randint(3, vocab, (rows, response), generator=g) * response_mask
    rollout = Rollout(
        prompts=[f"prompt {i // n}" for i in range(rows)], prompt_index=torch.arange(rows) // n,
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        logprobs=-torch.rand(rows, response, generator=g) * response_mask, texts=[""] * rows,
        finish_reasons=["stop"] * rows, n=n,
    )  # fmt: skip
    return rollout, torch.randn(rows, generator=g)


def tokenizer_dir(work: Path, vocab: int) -> Path:
    out = work / "tokenizer"
    if not (out / "tokenizer.json").exists():
        texts = [
            f"Human: item {i} of {' '.join(str(j) for j in range(i % 17))} Assistant: ok" for i in range(400)
        ]
        train_bpe_tokenizer(texts, vocab_size=vocab, out_dir=out)
    return out


def measure(args, work: Path, budget: int | None, packing) -> dict:
    """Medians of ``--repeats`` timings of the two phases under one setting (a module of its own)."""
    torch.manual_seed(0)
    spec = TinyLlama(
        tokenizer=str(tokenizer_dir(work, args.vocab)), hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.hidden // 64, intermediate_size=3 * args.hidden, max_position_embeddings=512,
    )  # fmt: skip
    module = PolicyGradientModule(
        policy=spec, reward=lambda p, r: [0.0] * len(r), aggregation="token_mean",
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=args.max_response), samples_per_prompt=args.samples),
        minibatches=Minibatches(size=args.size, shuffle=False, token_budget=budget),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-5)
    module.optimizers = lambda: [optimizer]  # the update without a Trainer: its own backward and step
    module.manual_backward = lambda loss: loss.backward()
    rollout, rewards = rollout_of(args, len(module.tokenizer))
    lengths = rollout.prompt_mask.sum(-1) + rollout.response_mask.sum(-1)
    logprob_s, update_s, stats = [], [], {}
    with use_forward_settings(packing=packing):
        for _ in range(args.repeats + 1):  # the first a warm-up
            start = time.perf_counter()
            trajectory, _ = module.make_trajectory(Experience(rollout, rewards))
            mid = time.perf_counter()
            module.updates.stats.reset()
            module.train_on(trajectory)
            end = time.perf_counter()
            logprob_s.append(mid - start)
            update_s.append(end - mid)
            stats = module.updates.stats.metrics()
    steps = -(-len(lengths) // args.size)
    width = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
    return {
        "budget": budget,
        "packing": packing,
        "microbatches_per_step": stats.get("perf/microbatches", 1.0),
        "padding_share": stats.get("perf/padding_share", 1 - float(lengths.sum()) / (len(lengths) * width)),
        "steps": steps,
        "tokens": int(lengths.sum()),
        "logprob_s": statistics.median(logprob_s[1:]),
        "update_s": statistics.median(update_s[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--size", type=int, default=16, help="rows per minibatch (optimiser step)")
    parser.add_argument("--min-response", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--budgets", default="1024,2048,4096", help="token budgets besides none")
    parser.add_argument("--packing", choices=["auto", "off", "both"], default="both")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None, help="cells cache (default: a temporary directory)")
    parser.add_argument("--name", default="dynamic_batching")
    parser.add_argument("--results", default=str(RESULTS), help="where the .md and .json go")
    parser.add_argument("--tiny", action="store_true", help="2 x 2 rows of up to 24 tokens, 1 repeat")
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.samples, args.size, args.max_response, args.repeats = 2, 2, 2, 24, 1
        args.budgets, args.hidden, args.layers, args.name = "64", 64, 1, "dynamic_batching_tiny"
    torch.set_num_threads(args.threads)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_dynamic_batching_"))
    cells = Cells(work)
    budgets = [None, *(int(b) for b in args.budgets.split(",") if b)]
    packings = {"auto": ["auto"], "off": [False], "both": ["auto", False]}[args.packing]
    settings = vars(args) | {"work": None, "results": None}
    rows = []
    for packing in packings:
        for budget in budgets:
            key = f"packing={packing},budget={budget}"
            row = cells.run(
                key, lambda b=budget, p=packing: measure(args, work, b, p), spec=settings | {"key": key}
            )
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["packing"] == row["packing"] and r["budget"] is None)
        row["update_tokens_per_s"] = row["tokens"] / row["update_s"]
        row["update_speedup"] = base["update_s"] / row["update_s"]
        row["logprob_speedup"] = base["logprob_s"] / row["logprob_s"]
    columns = [
        "packing", "budget", "microbatches_per_step", "padding_share", "logprob_s", "update_s",
        "update_tokens_per_s", "update_speedup", "logprob_speedup",
    ]  # fmt: skip
    shown = [{**r, "budget": r["budget"] or "none (rows)", "packing": r["packing"] or "off"} for r in rows]
    table = markdown_table(shown, columns)
    note = (
        f"\n\n{args.prompts} prompts x {args.samples} samples, prompts 16..48 and responses "
        f"{args.min_response}..{args.max_response} tokens, minibatches of {args.size} rows; tiny Llama "
        f"(hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}); medians of {args.repeats} "
        f"repeats after a warm-up, {args.threads} threads. The machine may be shared with other jobs: "
        "compare rows of one run, not runs."
    )
    out = write_results(
        args.name, {"settings": settings, "rows": rows}, table=table + note,
        title="Token-budget dynamic batching: one GRPO update over mixed lengths", results_dir=args.results,
    )  # fmt: skip
    print(table + note)
    print("written:", ", ".join(str(p) for p in out.values()))


if __name__ == "__main__":
    main()
