"""alignlit vs TRL, step for step: SFT, reward model, DPO with a cached and with a live reference.

Both sides train the same tiny random Llama (hidden 256, 4 layers, 4 heads of 64, MLP 640, a BPE
vocabulary of 512 trained on the simulated task: 3.3M parameters) on the same simulated data
(``alignlit.sim``, generated in-process and tokenised once, so both sides see the same token ids),
in the same order (no shuffling), with the same batch size, AdamW (torch's fused kernel on both sides,
each library's default; same lr, betas, weight decay, constant schedule, no warmup, no clipping),
float32, no gradient checkpointing, and the same number of torch threads, with ``OMP_WAIT_POLICY=PASSIVE`` (on a machine shared with other jobs, OpenMP's
default spinning made step times vary 20-fold). Each measurement runs in its own subprocess (clean
peak RSS), alternating sides, ``--reps`` repetitions; the median over repetitions is reported.

Per workload and side: examples/s and tokens/s (real and padded) over the timed steps (after
``--warmup`` steps), peak RSS, the first-step loss (both sides must agree: the cheapest correctness
check against an independent implementation), and MFU: training FLOP/s (``6·N·tokens``; ``8·N``
with a live reference, whose forward is ``2·N``) over the machine's float32 matmul peak measured in
the same run (a timed 2048² matmul on the same threads). ``N`` counts the weights that take part in
matmuls (all but the input embedding); tokens are real (non-padding) tokens. Prints a table and
writes ``benchmarks/results/vs_trl.json``.

    python benchmarks/bench_vs_trl.py                       # TRL must be importable (nox -s bench)
    python benchmarks/bench_vs_trl.py --workloads dpo_cached --reps 1 --steps 10
    python benchmarks/bench_vs_trl.py --trl-python /path/to/venv/bin/python
    python benchmarks/bench_vs_trl.py --workloads grpo,rloo     # the online step (see harness/vs_trl.py)

alignlit runs its stage modules (SFTModule, RewardModule, DPOModule) under a Lightning Trainer with
their own collation; TRL runs SFTTrainer, RewardTrainer and DPOTrainer with ``padding_free`` off
(their default) and its defaults otherwise. The online workloads (``grpo``: GRPOTrainer vs
PolicyGradientModule; ``rloo``: RLOOTrainer vs PolicyGradientModule) are described in
``benchmarks/harness/vs_trl.py``: samples/s, the step split into generate / score / log-probs / update,
and a loss check on the same completions.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import (  # benchmarks/ is on sys.path when a script runs
    code_stamp,
    measurement_cells,
    write_results,
)
from harness.vs_trl import (
    MODEL,
    ONLINE_WORKLOADS,
    SIDES,
    TRL_VERSION,
    WORKLOADS,
    alignlit_online_worker,
    alignlit_worker,
    batch_tokens,
    build_assets,
    build_online_assets,
    matmul_peak,
    print_online,
    summarise_online,
    trl_online_worker,
    trl_worker,
)


def worker_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    root = Path(args.assets)
    if args.workload in ONLINE_WORKLOADS:
        worker = alignlit_online_worker if args.worker == "alignlit" else trl_online_worker
        result = worker(args.workload, root, args, "check" if args.check else "timed")
    elif args.worker == "alignlit":
        result = alignlit_worker(args.workload, root, args)
    else:
        result = trl_worker(args.workload, root, args)
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------- driver


def run_worker(python: str, side: str, workload: str, root: Path, args, check: bool = False) -> dict:
    command = [
        python, __file__, "--worker", side, "--workload", workload, "--assets", str(root),
        "--threads", str(args.threads), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--lr", str(args.lr), "--weight-decay", str(args.weight_decay),
        "--max-length", str(args.max_length), "--max-prompt-length", str(args.max_prompt_length),
        *(["--no-packing"] if args.no_packing else []), *(["--no-fused-head"] if args.no_fused_head else []),
        *(["--compile"] if args.compile else []), *(["--profile"] if args.profile else []),
        *(["--no-fused-adamw"] if args.no_fused_adamw else []),
        "--rollouts", str(args.rollouts), "--online-warmup", str(args.online_warmup),
        "--rollout-prompts", str(args.rollout_prompts), "--group", str(args.group),
        "--minibatch", str(args.minibatch), "--max-new-tokens", str(args.max_new_tokens),
        "--online-lr", str(args.online_lr), *(["--check"] if check else []),
        "--prompt-words", str(args.prompt_words), "--hf-generate", args.hf_generate,
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "OMP_WAIT_POLICY": args.omp_wait_policy,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONWARNINGS": "ignore",
        "BENCH_SIM_DIR": str(root / "sim"),
    }
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{side} {workload} worker failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def alternating_runs(workload: str, root: Path, args) -> dict[str, list[dict]]:
    """``--reps`` timed runs of each side, each in its own process, the order alternating per repetition."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for rep in range(args.reps):
        for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
            python = args.trl_python if side == "trl" else sys.executable
            runs[side].append(run_worker(python, side, workload, root, args))
            print(f"  {workload} rep {rep} {side}: {runs[side][-1]['seconds']:.2f} s", flush=True)
    return runs


def check_trl(python: str) -> str:
    proc = subprocess.run(
        [python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"TRL is not importable by {python}: install trl=={TRL_VERSION} beside alignlit "
            "(`nox -s bench` does) or pass --trl-python"
        )
    return proc.stdout.strip()


def summarise(workload: str, side: str, runs: list[dict], tokens, assets: dict, peak: float, args) -> dict:
    timed = tokens[args.warmup :]
    real, padded = sum(t[0] for t in timed), sum(t[1] for t in timed)
    seconds = statistics.median(r["seconds"] for r in runs)
    n = assets["matmul_parameters"]["reward" if workload == "reward" else "policy"]
    flops_per_token = 8 * n if workload == "dpo_live" else 6 * n
    examples = args.batch_size * args.steps
    return {
        "workload": workload,
        "side": side,
        "runs": runs,
        "seconds": seconds,
        "examples_per_s": examples / seconds,
        "real_tokens_per_s": real / seconds,
        "padded_tokens_per_s": padded / seconds,
        "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "first_loss": runs[0]["first_loss"],
        "profile_ms_per_step": runs[0].get("profile_ms_per_step"),
        "tflops": flops_per_token * real / seconds / 1e12,
        "mfu": flops_per_token * real / seconds / peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--batch-size", type=int, default=16, help="examples (pairs) per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--max-prompt-length", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--trl-python", default=sys.executable, help="python that imports TRL (default: this one)"
    )
    parser.add_argument("--no-packing", action="store_true", help="alignlit: padded rows (ForwardSettings)")
    parser.add_argument(
        "--no-fused-head", action="store_true", help="alignlit: full logits (ForwardSettings)"
    )
    parser.add_argument("--compile", action="store_true", help="alignlit: torch.compile the decoder")
    parser.add_argument(
        "--no-fused-adamw",
        action="store_true",
        help="alignlit: torch's per-parameter AdamW loop (Optim(fused=False); the default is the fused "
        "kernel where it applies: the same updates)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler breakdown of the timed steps (slower; not for timing)",
    )
    parser.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of both sides (PASSIVE: idle OpenMP threads sleep instead of spinning; on a "
        "shared machine spinning threads made step times vary 20-fold)",
    )
    parser.add_argument("--loss-tol", type=float, default=1e-5)
    online = parser.add_argument_group("online workloads (grpo, rloo)")
    online.add_argument("--rollouts", type=int, default=6, help="timed rollouts per run")
    online.add_argument("--online-warmup", type=int, default=1, help="untimed rollouts before them")
    online.add_argument("--rollout-prompts", type=int, default=8, help="prompts per rollout")
    online.add_argument("--group", type=int, default=4, help="samples per prompt")
    online.add_argument("--minibatch", type=int, default=16, help="samples per optimizer step")
    online.add_argument("--max-new-tokens", type=int, default=32)
    online.add_argument("--online-lr", type=float, default=1e-5)
    online.add_argument(
        "--prompt-words", type=int, default=0, help="symbols of context before each prompt (long prompts)"
    )
    online.add_argument(
        "--hf-generate", choices=["dynamic", "static-shared"], default="dynamic",
        help="alignlit's HF engine: the default dynamic KV cache, or rollout.hf {kv_cache: static, "
        "share_prompt: true} (each prompt's cache computed once for its samples)",
    )  # fmt: skip
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        default=None,
        help="JSON written (default: benchmarks/results/vs_trl.json, or vs_trl_online.json when every workload "
        "is an online one)",
    )
    parser.add_argument("--work", default=None, help="measured cells (default out/bench/vs_trl)")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {list(WORKLOADS)}")
    trl_version = check_trl(args.trl_python)
    peak = matmul_peak(args.threads)
    load_start = os.getloadavg()
    results, online_results, failures = [], [], []
    spec = {
        "config": {k: v for k, v in vars(args).items() if k != "work"},
        "trl": trl_version,
        "code": code_stamp(),
    }
    cells = measurement_cells("vs_trl", args.work)  # a workload's runs are one cell: a cut run resumes
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = build_assets(root, args)
        if any(w in ONLINE_WORKLOADS for w in workloads):
            assets["online"] = build_online_assets(root, args)
        for workload in workloads:
            if workload in ONLINE_WORKLOADS:
                cell = cells.run(workload, functools.partial(online_runs, workload, root, args), spec)
                result = summarise_online(workload, cell["runs"], cell["checks"], args)
                failures += [f"{workload}: {name} differs by {diff:.3g} (> {args.loss_tol})"
                             for name, diff in result.get("check_diffs", {}).items() if diff > args.loss_tol]  # fmt: skip
                online_results.append(result)
                print_online(online_results[-1:], args)
                continue
            tokens = batch_tokens(workload, assets, args)
            runs = cells.run(workload, functools.partial(alternating_runs, workload, root, args), spec)
            pair = {side: summarise(workload, side, runs[side], tokens, assets, peak, args) for side in SIDES}
            diff = abs(pair["alignlit"]["first_loss"] - pair["trl"]["first_loss"])
            if diff > args.loss_tol:
                failures.append(f"{workload}: first-step losses differ by {diff:.3g} (> {args.loss_tol})")
            results.append({**pair, "ratio": pair["alignlit"]["examples_per_s"] / pair["trl"]["examples_per_s"],
                            "first_loss_diff": diff})  # fmt: skip
    peak = max(peak, matmul_peak(args.threads))
    for r in results:  # MFU against the better of the two peak measurements
        for side in SIDES:
            r[side]["mfu"] = r[side]["tflops"] * 1e12 / peak

    print(
        f"\nmodel: tiny Llama, {assets['parameters'] / 1e6:.2f}M parameters, vocab {assets['vocab']}; TRL {trl_version}"
    )
    if results:
        print_offline(results, args, peak)
    if online_results:
        print_online(online_results, args)
    online_only = all(w in ONLINE_WORKLOADS for w in workloads)
    out = Path(args.out or f"benchmarks/results/{'vs_trl_online' if online_only else 'vs_trl'}.json")
    payload = {
        "benchmark": "vs_trl",
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "workload", "assets", "check")},
        "model": {"parameters": assets["parameters"], "matmul_parameters": assets["matmul_parameters"],
                  "vocab": assets["vocab"], **MODEL},
        "trl": trl_version,
        "machine": {
            "load_average_at_start": load_start,
            "load_average_at_end": os.getloadavg(),
            "matmul_peak_flops": peak,
        },
        "results": results,
        "online_results": online_results,
        "failures": failures,
    }  # fmt: skip
    write_results(out.stem, payload, results_dir=out.parent)
    print(f"wrote {out}")
    if failures:
        raise SystemExit("; ".join(failures))


def online_runs(workload: str, root: Path, args) -> dict:
    """The loss check (one untimed run per side on the driver's completions), then ``--reps`` timed runs
    per side, alternating: one cell."""
    checks = {}
    for side in SIDES:
        python = args.trl_python if side == "trl" else sys.executable
        checks[side] = run_worker(python, side, workload, root, args, check=True)
    return {"checks": checks, "runs": alternating_runs(workload, root, args)}


def print_offline(results: list[dict], args, peak: float) -> None:
    print(
        f"batch {args.batch_size}, max_length {args.max_length}, {args.steps} timed steps after {args.warmup}, "
        f"{args.reps} reps, {args.threads} threads; matmul peak {peak / 1e9:.1f} GFLOP/s"
    )
    header = (
        f"{'workload':<11} {'side':<8} {'ex/s':>7} {'tok/s real':>10} {'tok/s pad':>10} {'CPU ms/step':>11} "
        f"{'RSS MB':>7} {'MFU':>6} {'first loss':>12} {'ratio':>6} {'|Δ loss|':>9}"
    )
    print(header)
    for r in results:
        for side in SIDES:
            s = r[side]
            tail = f"{r['ratio']:>6.2f} {r['first_loss_diff']:>9.1e}" if side == "alignlit" else ""
            print(
                f"{r['alignlit']['workload']:<11} {side:<8} {s['examples_per_s']:>7.1f} "
                f"{s['real_tokens_per_s']:>10.0f} {s['padded_tokens_per_s']:>10.0f} "
                f"{1e3 * s['cpu_seconds'] / args.steps:>11.0f} {s['peak_rss_mb']:>7.0f} "
                f"{100 * s['mfu']:>5.1f}% {s['first_loss']:>12.7f} {tail}"
            )
    if args.profile:
        keys = ("matmul", "attention", "other_ops", "optimizer", "python_framework")
        print(f"\nwhere a step's time goes (torch.profiler, ms per step): {', '.join(keys)}")
        for r in results:
            for side in SIDES:
                p = r[side]["profile_ms_per_step"]
                total = sum(p.values())
                cells = " ".join(f"{p[k]:>7.1f} ({100 * p[k] / total:>3.0f}%)" for k in keys)
                print(f"{r['alignlit']['workload']:<11} {side:<8} {cells}  total {total:.1f}")


if __name__ == "__main__":
    main()
