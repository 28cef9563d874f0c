"""Asynchronous rollouts (``rollout.max_staleness``) against the synchronous loop, on the simulated task.

For GRPO and PPO (``configs/quickstart/{grpo,ppo}.yaml`` as shipped, the learned reward model) and each
staleness ``k`` of ``--staleness`` (0 = the synchronous loop), one ``alignlit fit`` per seed with the
trainer on one torch thread (``OMP_NUM_THREADS=1``) and the rollout engine on another (the HF worker's
``rollout.worker_threads: 1``; vLLM unbound, one OpenMP thread): the two of them share the machine's two
cores. ``--sync-threads 2`` adds the synchronous loop with two threads (both cores as intra-op threads),
the other way to use the second core. No validation, no checkpoints, so the clock measures training.
Reported per (stage, engine, k, trainer threads):

- samples/s in the steady state (the steps after the first ``k + 1``, whose rollouts the pipeline filled
  before training started), and over the whole run (every step, the worker's start included), from the
  per-step ``time/rollout_s`` + ``time/train_s`` the stage logs; the speed-up against ``k = 0`` and the
  *overlap ceiling*, (rollout + train) / max(rollout, train) of the synchronous run's steps: the speed-up
  a perfect overlap of its two phases would give;
- the share of the trainer's time spent waiting for a rollout (``async/wait_s``; at ``k = 0`` the whole
  rollout time is waiting), the seconds per step of each phase, and the cores the run used (CPU seconds
  of the run and its workers / wall seconds, startup included);
- the staleness of every trained step (a histogram: with pinned versions, step ``j``'s samples are
  exactly ``min(j, k)`` versions old);
- gold reward and KL to SFT of the exported policy on ``--test-prompts`` prompts of ``prompts_test``
  (T = 1, sampling seed = the run's seed), mean ± std over the seeds.

Runs in ``--root`` (needs ``data/sim`` and ``out/quickstart/{sft,reward}``; ``--prepare`` makes them with
the quickstart commands). Writes ``<results>/async.{md,json,png}``; every run's JSON stays under
``--work`` and a rerun skips the finished ones (``--max-minutes`` splits a campaign into chunks).

    python benchmarks/bench_async.py --prepare                   # GRPO and PPO, k = 0 1 2 4, HF engine
    python benchmarks/bench_async.py --engines hf vllm --staleness 0 1
    python benchmarks/bench_async.py --tiny                      # 4 rollouts each, 50 test prompts
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import mean_std, pm, quickstart_stages, read_json, stamp
from harness import prepare as harness_prepare

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "grpo": ("configs/quickstart/grpo.yaml", []),
    "ppo": ("configs/quickstart/ppo.yaml", []),
    # one pass over each rollout (DeepSeekMath's GRPO, mu = 1): half the trainer's work per step
    "grpo-1epoch": ("configs/quickstart/grpo.yaml", ["--model.init_args.minibatches.epochs=1"]),
}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children (and theirs, once reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_alignlit(argv: list[str], cwd: Path, log: Path, env: dict) -> tuple[float, float]:
    """Run ``alignlit ARGV``; its wall-clock seconds and the CPU seconds it (and its workers) used."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start, cpu = time.perf_counter(), cpu_seconds()
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "alignlit.cli", *argv], cwd=cwd, stdout=f,
                              stderr=subprocess.STDOUT, env=env)  # fmt: skip
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"alignlit {' '.join(argv[:3])} failed (log {log}):\n{tail}")
    return time.perf_counter() - start, cpu_seconds() - cpu


def prepare(root: Path, env: dict) -> None:
    """The quickstart's data, SFT policy and reward model, unless they exist."""

    def run(argv: list[str]) -> None:
        print(f"prepare: alignlit {' '.join(argv)}", flush=True)
        run_alignlit(argv, root, root / "out/bench_async/logs" / f"prepare_{argv[0]}.log", env)

    harness_prepare(quickstart_stages(root), run)


PHASES = {
    "rollout_s": "time/rollout_s", "train_s": "time/train_s", "generate_s": "rollout/generate_s",
    "score_s": "rollout/score_s", "sync_s": "rollout/sync_s", "old_logp_s": "time/old_logp_s",
    "ref_logp_s": "time/ref_logp_s",
}  # fmt: skip


def fit(args, stage: str, engine: str, k: int, seed: int, threads: int = 1) -> dict:
    """One training run; its record (timings from the history, the export's path). ``threads``: torch
    threads of the trainer (and of an in-process engine); the HF worker always has one."""
    run = Path(args.work) / f"{stage}-{engine}-k{k}-s{seed}" if threads == 1 else (
        Path(args.work) / f"{stage}-{engine}-k{k}-t{threads}-s{seed}"
    )  # fmt: skip
    record_file = run / "run.json"
    if (cached := read_json(record_file)) and cached.get("rollouts") == args.rollouts:
        return cached
    config, overrides = CONFIGS[stage]
    argv = [
        "fit", "--config", str(ROOT / config), *overrides, f"--seed_everything={seed}",
        f"--model.init_args.rollout.seed={seed}",
        f"--model.init_args.rollout.engine={engine}", f"--model.init_args.rollout.max_staleness={k}",
        "--model.init_args.rollout.worker_threads=1", f"--trainer.limit_train_batches={args.rollouts}",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
        f"--trainer.default_root_dir={run}", f"--model.init_args.curves_file={run / 'curves.png'}",
        f"--model.init_args.export_dir={run / 'policy'}",
    ]  # fmt: skip
    env = {**args.env, "OMP_NUM_THREADS": str(threads)}
    if engine == "vllm":  # vLLM's engine (in-process at k = 0, its own process at k >= 1): `threads` threads
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    wall, cpu = run_alignlit(argv, Path(args.root), run / "fit.log", env)
    history = [h for h in json.loads((run / "curves.json").read_text()) if "time/train_s" in h]
    steps = [
        {
            "seconds": h["time/rollout_s"] + h["time/train_s"],
            "samples": h.get("rollout/samples", 0.0),
            "wait": h.get("async/wait_s", h["time/rollout_s"]),
            "staleness": h.get("async/staleness_max", 0.0),
            **{name: h.get(key, 0.0) for name, key in PHASES.items()},
        }
        for h in history
    ]
    steady = steps[k + 1 :] or steps
    seconds = sum(s["seconds"] for s in steady)
    record = {
        "stage": stage, "engine": engine, "k": k, "threads": threads, "seed": seed, "rollouts": args.rollouts,
        "wall_s": wall, "cpu_s": cpu, "cores_used": cpu / wall,
        "samples_per_s": sum(s["samples"] for s in steady) / seconds,
        "samples_per_s_all": sum(s["samples"] for s in steps) / sum(s["seconds"] for s in steps),
        "wait_share": sum(s["wait"] for s in steady) / seconds,
        "first_step_s": steps[0]["seconds"],
        "phases_s": {name: sum(s[name] for s in steady) / len(steady) for name in PHASES},
        "staleness": [s["staleness"] for s in steps], "policy": str(run / "policy"),
    }  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    return record


def evaluate(args, record: dict) -> dict:
    """Gold reward and KL to SFT of a run's export on the test prompts (cached in the run's folder)."""
    cell = Path(record["policy"]).parent / "eval_test.json"
    if (cached := read_json(cell)) and cached.get("prompts") == args.test_prompts:
        return cached
    from alignlit.data import parse_prompt, read_records
    from alignlit.eval.gold import evaluate_policy
    from alignlit.models import load_policy
    from alignlit.rollout import SamplingParams
    from alignlit.sim import load_sim

    root = Path(args.root)
    task, _ = load_sim(root / "data/sim")
    prompts = [parse_prompt(r) for r in read_records(root / "data/sim/prompts_test.jsonl")][
        : args.test_prompts
    ]
    sft, _ = load_policy(root / "out/quickstart/sft")
    policy, tokenizer = load_policy(record["policy"])
    sft.eval(), policy.eval()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=record["seed"])
    result = evaluate_policy(policy, tokenizer, prompts, task.gold_rewards, reference=sft, sampling=sampling,
                             batch_size=100, name=f"{record['stage']} k={record['k']}")  # fmt: skip
    out = {"prompts": len(prompts), **result.as_dict()}
    cell.write_text(json.dumps(out) + "\n")
    return out


def machine() -> str:
    """The CPU model and core count, and the torch build."""
    import platform

    import torch

    model = platform.processor() or "CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        model = names[0] if names else model
    return f"{os.cpu_count()} cores ({model}), torch {torch.__version__}"


def table(records: list[dict]) -> list[dict]:
    """One row per (stage, engine, k, trainer threads): means (± std) over its seeds. The speed-up is against
    k = 0 with one thread, ``speedup_vs_sync_threads`` against k = 0 with the most trainer threads run
    (``sync_threads``; None without such a run); ``ceiling`` is the speed-up of a perfect overlap of that synchronous run's two
    phases, (rollout + train) / max(rollout, train) per step, what k >= 1 can reach at best."""
    rows = []
    for stage, engine, k, threads in sorted(
        {(r["stage"], r["engine"], r["k"], r["threads"]) for r in records}
    ):
        runs = [
            r
            for r in records
            if (r["stage"], r["engine"], r["k"], r["threads"]) == (stage, engine, k, threads)
        ]
        base = [
            r for r in records if (r["stage"], r["engine"], r["k"], r["threads"]) == (stage, engine, 0, 1)
        ]
        synced = [
            r for r in records if (r["stage"], r["engine"], r["k"]) == (stage, engine, 0) and r["threads"] > 1
        ]
        sync_threads = max((r["threads"] for r in synced), default=None)
        rate, rate_std = mean_std([r["samples_per_s"] for r in runs])
        base_rate, _ = mean_std([r["samples_per_s"] for r in base])
        sync_rate, _ = mean_std([r["samples_per_s"] for r in synced if r["threads"] == sync_threads])
        rollout = mean_std([r["phases_s"]["rollout_s"] for r in base])[0]
        train = mean_std([r["phases_s"]["train_s"] for r in base])[0]
        histogram: dict[int, int] = {}
        for r in runs:
            for s in r["staleness"]:
                histogram[int(s)] = histogram.get(int(s), 0) + 1
        gold = [r["eval"]["gold"] for r in runs if "eval" in r]
        kl = [r["eval"]["kl_to_reference"] for r in runs if "eval" in r]
        rows.append({
            "stage": stage, "engine": engine, "k": k, "threads": threads, "seeds": [r["seed"] for r in runs],
            "samples_per_s": rate, "samples_per_s_std": rate_std,
            "samples_per_s_all": mean_std([r["samples_per_s_all"] for r in runs])[0],
            "speedup": rate / base_rate if base_rate else None,
            "speedup_vs_sync_threads": rate / sync_rate if sync_rate else None, "sync_threads": sync_threads,
            "ceiling": (rollout + train) / max(rollout, train) if base and k else None,
            "wait_share": mean_std([r["wait_share"] for r in runs])[0],
            "first_step_s": mean_std([r["first_step_s"] for r in runs])[0],
            "cores_used": mean_std([r["cores_used"] for r in runs])[0],
            "phases_s": {name: mean_std([r["phases_s"][name] for r in runs])[0] for name in PHASES},
            "gold": mean_std(gold), "kl": mean_std(kl), "gold_seeds": len(gold),
            "staleness_histogram": dict(sorted(histogram.items())),
        })  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| stage | engine | k | trainer threads | samples/s (steady) | speed-up vs k = 0 | vs k = 0 on all threads | "
        "overlap ceiling | samples/s (whole run) | trainer waits | generate / score / train s per step | cores used | "
        "gold (test) | KL to SFT | seeds | staleness of trained steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        phases = r["phases_s"]
        vs_sync = r.get("speedup_vs_sync_threads")
        lines.append(
            f"| {r['stage']} | {r['engine']} | {r['k']} | {r['threads']} | "
            f"{pm(r['samples_per_s'], r['samples_per_s_std'], 1)} | "
            + ("" if r["speedup"] is None else f"{r['speedup']:.2f}×")
            + " | "
            + ("" if vs_sync is None else f"{vs_sync:.2f}× ({r['sync_threads']} threads)")
            + " | "
            + ("" if r["ceiling"] is None else f"{r['ceiling']:.2f}×")
            + f" | {r['samples_per_s_all']:.1f} | {100 * r['wait_share']:.0f}% | "
            f"{phases['generate_s']:.3f} / {phases['score_s']:.3f} / {phases['train_s']:.3f} | {r['cores_used']:.2f} | "
            f"{pm(*r['gold'])} | {pm(*r['kl'], 2)} | {r['gold_seeds']} | "
            + ", ".join(f"{s}: {c}" for s, c in r["staleness_histogram"].items())
            + " |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), width_ratios=[1.4, 1])
    for stage, engine in sorted({(r["stage"], r["engine"]) for r in rows}):
        mine = [r for r in rows if (r["stage"], r["engine"]) == (stage, engine) and r["threads"] == 1]
        (line,) = axes[0].plot([r["k"] for r in mine], [r["samples_per_s"] for r in mine], marker="o",
                               label=f"{stage} ({engine})")  # fmt: skip
        base = [r for r in mine if r["k"] == 0]
        ceiling = [r["ceiling"] for r in mine if r["ceiling"]]
        if base and ceiling:
            ks = [r["k"] for r in mine]
            axes[0].hlines(base[0]["samples_per_s"] * ceiling[0], min(ks), max(ks), colors=line.get_color(),
                           linestyles=":", label=f"{stage} ({engine}): perfect overlap")  # fmt: skip
        for sync in [
            r for r in rows if (r["stage"], r["engine"], r["k"]) == (stage, engine, 0) and r["threads"] > 1
        ]:
            ks = [r["k"] for r in mine] or [0]
            axes[0].hlines(sync["samples_per_s"], min(ks), max(ks), colors=line.get_color(), linestyles="--",
                           label=f"{stage} ({engine}): k = 0, {sync['threads']} threads")  # fmt: skip
        golds = [(r["k"], *r["gold"]) for r in mine if r["gold"][0] is not None]
        axes[1].errorbar([g[0] for g in golds], [g[1] for g in golds], yerr=[g[2] or 0 for g in golds],
                         marker="o", capsize=3, label=f"{stage} ({engine})")  # fmt: skip
    axes[0].set(xlabel="max_staleness k", ylabel="samples/s (steady state)", title="throughput")
    axes[1].set(
        xlabel="max_staleness k", ylabel="gold reward (test prompts)", title="quality at equal samples"
    )
    for ax in axes:
        ax.set_xticks(sorted({r["k"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside the crowded axes
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=".", help="folder with data/sim and out/quickstart/{sft,reward}")
    p.add_argument("--work", default="out/bench_async", help="run folders (relative to --root)")
    p.add_argument("--results", default=str(ROOT / "benchmarks/results"))
    p.add_argument("--stages", nargs="+", default=["grpo", "ppo"], choices=sorted(CONFIGS))
    p.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"])
    p.add_argument("--staleness", nargs="+", type=int, default=[0, 1, 2, 4])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument(
        "--seeds-for",
        nargs="+",
        type=int,
        default=None,
        help="the k run with every seed, the others with the first seed only (default: every k)",
    )
    p.add_argument(
        "--sync-threads",
        nargs="*",
        type=int,
        default=[2],
        help="also run k = 0 with these many trainer threads (the synchronous loop on more cores)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no new run after this many minutes (a chunk; rerun to go on: finished runs are kept)",
    )
    p.add_argument("--rollouts", type=int, default=30)
    p.add_argument("--test-prompts", type=int, default=500)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--tiny", action="store_true", help="4 rollouts, 50 test prompts, one seed")
    p.add_argument(
        "--collect",
        action="store_true",
        help="run nothing: tabulate every finished and evaluated run under --work of --stages and --engines "
        "with --rollouts rollouts and --test-prompts test prompts (campaigns run as several commands)",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.rollouts, args.test_prompts, args.seeds = 4, 50, args.seeds[:1]
    args.work = str(Path(args.root) / args.work)
    args.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if args.collect:
        return report(args, collect(args))
    if args.prepare:
        prepare(Path(args.root), args.env)
    records = []
    seeds_for = args.staleness if args.seeds_for is None else args.seeds_for
    plan = [
        (stage, engine, k, threads, seed)
        for stage in args.stages for engine in args.engines
        for k, threads in [(k, 1) for k in args.staleness] + [(0, t) for t in args.sync_threads if t != 1]
        for seed in (args.seeds if k in seeds_for else args.seeds[:1])
    ]  # fmt: skip
    began = time.perf_counter()
    for i, (stage, engine, k, threads, seed) in enumerate(plan, 1):
        if args.max_minutes is not None and time.perf_counter() - began > 60 * args.max_minutes:
            print(
                f"stopped after {args.max_minutes} minutes: {len(plan) - i + 1} run(s) left, rerun to go on"
            )
            return {"rows": [], "left": len(plan) - i + 1}
        start = time.perf_counter()
        record = fit(args, stage, engine, k, seed, threads)
        record["eval"] = evaluate(args, record)
        records.append(record)
        print(f"[{i}/{len(plan)}] {stage} {engine} k={k} threads={threads} seed={seed}: "
              f"{record['samples_per_s']:.1f} samples/s (steady), gold {record['eval']['gold']:.3f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    return report(args, records)


def collect(args) -> list[dict]:
    """The finished runs under ``--work`` (``run.json`` and its ``eval_test.json``) that ``--collect`` tabulates."""
    records = []
    for run_file in sorted(Path(args.work).glob("*/run.json")):
        record = read_json(run_file)
        evaluation = read_json(run_file.parent / "eval_test.json")
        if (
            record.get("rollouts") == args.rollouts
            and record.get("stage") in args.stages
            and record.get("engine") in args.engines
            and evaluation.get("prompts") == args.test_prompts
        ):
            records.append({**record, "eval": evaluation})
    if not records:
        raise SystemExit(f"--collect: no finished run with {args.rollouts} rollouts under {args.work}")
    return records


def report(args, records: list[dict]) -> dict:
    """Write ``<results>/async{,_tiny}.{json,md,png}`` from the runs' records; the rows."""
    rows = table(records)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    name = "async_tiny" if args.tiny else "async"
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "machine": machine(),
    }
    (results / f"{name}.json").write_text(
        json.dumps(stamp({**meta, "rows": rows, "runs": records}), indent=1) + "\n"
    )
    text = format_table(rows)
    (results / f"{name}.md").write_text(f"{meta['date']}, `{meta['command']}`, {meta['machine']}\n\n{text}\n")
    plot(rows, results / f"{name}.png")
    print(text)
    return {"rows": rows}


if __name__ == "__main__":
    main()
