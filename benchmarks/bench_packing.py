"""When does the packed forward pay? Packed vs padded rows, by the share of tokens packing removes.

alignlit's packed forward (:mod:`alignlit.models.packing`) runs the real tokens of a batch as one
sequence, a prompt shared by several rows once; it removes padding and repeated prompts from the
matmuls but adds gathers, scatters and Python. This measures, on random batches of rollouts
(left-padded prompts, right-padded responses, ``n`` samples per prompt) whose padding and prompt
sharing vary, the time of :func:`alignlit.models.forward.response_token_logprobs` packed and padded
(``packing=True`` / ``False``), both as a no-grad forward (old/reference log-probs) and as a forward
and backward (an update), alternating the two paths ``--repeats`` times (medians), and relates the
speed-up to the batch's *saving*: ``1 - packed tokens / padded tokens``
(:func:`alignlit.models.packing.packing_saving`). The smallest saving from which packing is faster,
per model size, is what ``ForwardSettings(packing="auto")`` uses
(:data:`alignlit.models.forward_settings.MIN_PACKING_SAVING`). Prints a table and writes
``benchmarks/results/packing.json``.

    python benchmarks/bench_packing.py
    python benchmarks/bench_packing.py --sizes bench --repeats 9
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see bench_vs_trl.py)

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from alignlit.models.forward import response_token_logprobs
from alignlit.models.packing import packing_saving, prompt_lengths
from harness import (  # benchmarks/ is on sys.path when a script runs
    code_stamp,
    measurement_cells,
    write_results,
)

SIZES = {  # name: (hidden, layers, heads, intermediate, vocab)
    "quickstart": (128, 4, 2, 512, 512),
    "bench": (256, 4, 4, 640, 512),
    "wide": (512, 4, 8, 1536, 32000),
}
CASES = [  # (samples per prompt n, prompt spread, response spread): spread = shortest / longest
    (1, 1.0, 1.0), (1, 0.8, 0.9), (1, 0.5, 0.75), (1, 0.5, 0.4), (1, 0.3, 0.15),
    (2, 1.0, 1.0), (2, 0.8, 0.75), (2, 0.5, 0.4),
    (4, 1.0, 1.0), (4, 0.8, 0.75), (4, 0.5, 0.4),
    (8, 1.0, 1.0), (8, 0.5, 0.4),
]  # fmt: skip


def model_of(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, intermediate, vocab = SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=64, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def rollout_batch(case, rows: int, prompt: int, response: int, vocab: int, seed: int):
    """(prompt_ids, prompt_mask, response_ids, response_mask) of ``rows`` samples, ``n`` per prompt."""
    n, prompt_spread, response_spread = case
    g = torch.Generator().manual_seed(seed)
    prompts = rows // n
    p_len = torch.randint(max(1, int(prompt * prompt_spread)), prompt + 1, (prompts,), generator=g)
    r_len = torch.randint(max(1, int(response * response_spread)), response + 1, (rows,), generator=g)
    prompt_ids = torch.randint(3, vocab, (prompts, prompt), generator=g).repeat_interleave(n, 0)
    prompt_mask = (torch.arange(prompt) >= prompt - p_len[:, None]).repeat_interleave(n, 0)
    response_ids = torch.randint(3, vocab, (rows, response), generator=g)
    response_mask = torch.arange(response) < r_len[:, None]
    return prompt_ids * prompt_mask, prompt_mask, response_ids * response_mask, response_mask


def saving_of(batch) -> float:
    prompt_ids, prompt_mask, response_ids, response_mask = batch
    ids = torch.cat([prompt_ids, response_ids], 1)
    attention = torch.cat([prompt_mask, response_mask], 1)
    scored = torch.cat([torch.zeros_like(prompt_mask), response_mask], 1)
    # the packed forward keeps the left-padded layout's prompt lengths (real prompt tokens of each row)
    return packing_saving(ids, attention, prompt_lengths(attention, scored))


def timed(model, batch, packing: bool, backward: bool) -> float:
    start = time.perf_counter()
    if backward:
        model.zero_grad(set_to_none=True)
        out = response_token_logprobs(model, *batch, packing=packing, with_entropy=True)
        out.logprobs.sum().backward()
    else:
        with torch.no_grad():
            response_token_logprobs(model, *batch, packing=packing)
    return time.perf_counter() - start


THETAS = (0.0, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5)


def regret_table(results: list[dict], sizes: list[str]) -> dict[float, dict[str, tuple[float, float]]]:
    """For each threshold θ: per model size, the time the rule "packed from saving >= θ" spends over every
    measured batch and part beyond the faster path of each (a share of it), and the worst batch's."""
    table = {}
    for theta in THETAS:
        row = {}
        for size in sizes:
            spent = best = worst = 0.0
            for r in (r for r in results if r["size"] == size):
                for part in ("forward", "update"):
                    p = r[part]
                    t = p["packed_s"] if r["saving"] >= theta else p["padded_s"]
                    b = min(p["packed_s"], p["padded_s"])
                    spent, best, worst = spent + t, best + b, max(worst, t / b - 1)
            row[size] = (spent / best - 1, worst)
        table[theta] = row
    return table


def measure(model, size: str, k: int, case, args) -> dict:
    """One cell: case ``k``'s batch, forward and update, packed and padded (median of ``--repeats``)."""
    batch = rollout_batch(case, args.rows, args.prompt, args.response, SIZES[size][4], seed=k)
    row = {
        "size": size,
        "n": case[0],
        "prompt_spread": case[1],
        "response_spread": case[2],
        "saving": saving_of(batch),
    }
    for part, backward in (("forward", False), ("update", True)):
        for packing in (True, False):  # warm-up
            timed(model, batch, packing, backward)
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for packing in (True, False):
                times[packing].append(timed(model, batch, packing, backward))
        packed, padded = statistics.median(times[True]), statistics.median(times[False])
        row[part] = {"packed_s": packed, "padded_s": padded, "speedup": padded / packed}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="quickstart,bench,wide", help=f"comma-separated subset of {list(SIZES)}"
    )
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=24, help="longest prompt")
    parser.add_argument("--response", type=int, default=48, help="longest response")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=None, help="measured cells (default out/bench/packing)")
    parser.add_argument("--out", default="benchmarks/results/packing.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [s for s in args.sizes.split(",") if s]
    cells, spec = measurement_cells("packing", args.work), {"config": vars(args), "code": code_stamp()}
    results = []
    for size in sizes:
        model = model_of(size)
        for k, case in enumerate(CASES):
            compute = functools.partial(measure, model, size, k, case, args)
            row = cells.run(f"{size}-case{k}", compute, spec)  # a cut run resumes at this cell
            results.append(row)
            print(
                f"{size:<10} n={case[0]} spreads {case[1]:.2f}/{case[2]:.2f} saving {row['saving']:5.2f}: forward x"
                f"{row['forward']['speedup']:.2f}, update x{row['update']['speedup']:.2f}",
                flush=True,
            )
    thresholds = {}
    for size in sizes:
        rows = sorted((r for r in results if r["size"] == size), key=lambda r: r["saving"])
        for part in ("forward", "update"):
            # the smallest saving from which every measured batch was faster packed
            faster = [r["saving"] for r in rows if r[part]["speedup"] >= 1.0]
            slower = [r["saving"] for r in rows if r[part]["speedup"] < 1.0]
            above = [s for s in faster if not slower or s > max(slower)]
            thresholds[f"{size}/{part}"] = min(above) if above else None
    print("\nsmallest saving from which packing was faster in every batch:", json.dumps(thresholds))
    print("\n| model | n | saving | forward packed/padded ms | x | update packed/padded ms | x |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(results, key=lambda r: (r["size"], r["saving"])):
        f, u = r["forward"], r["update"]
        print(
            f"| {r['size']} | {r['n']} | {r['saving']:.2f} | {1e3 * f['packed_s']:.1f} / {1e3 * f['padded_s']:.1f} | "
            f"{f['speedup']:.2f} | {1e3 * u['packed_s']:.1f} / {1e3 * u['padded_s']:.1f} | {u['speedup']:.2f} |"
        )
    regret = regret_table(results, sizes)
    print(
        "\ntime lost to a threshold (packed from saving >= θ, else padded) over every batch and part, against the"
    )
    print("faster path of each: total (worst batch)")
    for theta, row in regret.items():
        print(
            f"θ = {theta:.2f}: "
            + " | ".join(f"{s} +{100 * t:.1f}% ({100 * w:.0f}%)" for s, (t, w) in row.items())
        )
    out = Path(args.out)
    payload = {
        "benchmark": "packing",
        "config": vars(args),
        "sizes": {
            s: dict(zip(("hidden", "layers", "heads", "intermediate", "vocab"), SIZES[s])) for s in sizes
        },
        "results": results,
        "thresholds": thresholds,
        "regret": {f"{t:.2f}": row for t, row in regret.items()},
    }
    write_results(out.stem, payload, results_dir=out.parent)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
