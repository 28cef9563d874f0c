"""Time and peak memory of the fused LM-head log-probs at a real vocabulary: row chunks vs tiles.

:func:`alignlit.ops.logprobs.linear_logprobs` forward and backward (log-probs, optionally entropies;
gradients of the hidden states and the head) on random float32 inputs shaped like a GRPO step of
Qwen2.5-0.5B at 2048 tokens: ``--rows`` 6144 scored positions (4 completions of 1536 tokens), hidden
896, vocabulary 151,936. Two implementations in one process:

- "row chunks": the code before tiling (``--baseline``, a git revision of
  ``src/alignlit/ops/logprobs.py``, loaded from ``git show`` into a temporary module): chunks of
  ``max(32, 2**21 // V)`` rows, i.e. 32 rows at this vocabulary, each reading the whole head;
- "tiles": today's code with its defaults (and any ``--tiles ROWSxTILE`` given, e.g. ``2048x4096``).

Time is the median of ``--repeats`` runs after one warm-up; peak is the most bytes the CPU allocator
held at once above its level at the start of the warm-up run, profiled (torch.profiler's allocation
events; the gradients of the hidden states and the head, 21 + 544.5 MiB, are part of it on both
sides). Prints a line per cell and writes (after each cell) ``benchmarks/results/fused_head.json``.

    python benchmarks/bench_fused_head.py
    python benchmarks/bench_fused_head.py --rows 2048 --tiles 2048x1024,512x4096
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see bench_vs_trl.py)

import argparse
import functools
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from alignlit.ops.logprobs import LINEAR_CHUNK_ELEMENTS, _tiling, linear_logprobs
from harness import (  # benchmarks/ is on sys.path when a script runs
    allocation_peak,
    code_stamp,
    measurement_cells,
    write_results,
)

BASELINE = "e331e12a0b8567b83f4ce3b8c37f6392dd839090"  # the last row-chunked linear_logprobs


def baseline_module(revision: str):
    source = subprocess.run(
        ["git", "show", f"{revision}:src/alignlit/ops/logprobs.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "logprobs_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("logprobs_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(fn, hidden, weight, labels, entropy: bool, **kwargs):
    def run():
        hidden.grad = weight.grad = None
        logprobs, ent = fn(hidden, weight, labels, with_entropy=entropy, **kwargs)
        total = logprobs.sum() + (ent.sum() if ent is not None else 0)
        total.backward()

    return run


def measured(name: str, run, entropy: bool, args) -> dict:
    """One cell: ``run``'s allocation peak (its first call, the warm-up) and median seconds."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()  # also the warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return {"variant": name, "entropy": entropy, "seconds": statistics.median(times), "runs": times,
            "peak_mb": allocation_peak(prof) / 2**20, "load_average": os.getloadavg()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--rows", type=int, default=6144)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the row-chunked code")
    parser.add_argument("--no-baseline", action="store_true", help="time only the tiled code")
    parser.add_argument(
        "--tiles", default="", help="extra ROWSxTILE settings of the tiled code, comma-separated"
    )
    parser.add_argument("--entropy", default="false,true", help="with_entropy values, comma-separated")
    parser.add_argument("--work", default=None, help="measured cells (default out/bench/fused_head)")
    parser.add_argument("--out", default="benchmarks/results/fused_head.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=generator).requires_grad_()
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=generator)).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), generator=generator)

    rows, tile = _tiling(args.rows, args.vocab, None, None)
    variants = [(f"tiles {rows}x{tile} (default)", linear_logprobs, {})]
    for setting in filter(None, args.tiles.split(",")):
        r, t = (int(x) for x in setting.split("x"))
        variants.append((f"tiles {r}x{t}", linear_logprobs, {"chunk_rows": r, "tile": t}))
    if not args.no_baseline:
        old = baseline_module(args.baseline)
        variants.insert(
            0, (f"row chunks {max(32, (1 << 21) // args.vocab)}x{args.vocab}", old.linear_logprobs, {})
        )

    out = Path(args.out)
    payload = {
        "benchmark": "fused_head",
        "config": vars(args),
        "linear_chunk_elements": LINEAR_CHUNK_ELEMENTS,
        "results": [],
    }
    cells, spec = measurement_cells("fused_head", args.work), {"config": vars(args), "code": code_stamp()}
    for entropy in (x.strip() == "true" for x in args.entropy.split(",")):
        for name, fn, kwargs in variants:
            measure = functools.partial(
                measured, name, step(fn, hidden, weight, labels, entropy, **kwargs), entropy, args
            )
            hidden.grad = weight.grad = None  # freed before the profile: each peak includes the new gradients
            cell = cells.run(f"{name}-entropy={entropy}", measure, spec)  # a cut run resumes at this cell
            payload["results"].append(cell)
            print(
                f"{name:<32} entropy={entropy!s:<5} {cell['seconds']:8.2f} s {cell['peak_mb']:9.1f} MB",
                flush=True,
            )
    write_results(out.stem, payload, results_dir=out.parent)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
