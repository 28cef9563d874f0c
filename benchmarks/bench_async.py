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
    python benchmarks/bench_async.py --stages grpo-long grpo-long-partial --staleness 0 1 --test-prompts 100 \
        --rollouts 20 --name async_long                          # the long shape (LONG below)
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
from harness import Cells, command_line, quickstart_stages, write_results
from harness import prepare as harness_prepare
from harness.async_runs import PHASES, SYNC_BASE, collect, format_table, plot, table

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "grpo": ("configs/quickstart/grpo.yaml", []),
    "ppo": ("configs/quickstart/ppo.yaml", []),
    # one pass over each rollout (DeepSeekMath's GRPO, mu = 1): half the trainer's work per step
    "grpo-1epoch": ("configs/quickstart/grpo.yaml", ["--model.init_args.minibatches.epochs=1"]),
    # partial rollouts (configs/async/grpo-partial.yaml's segments of 12 of the 24 new tokens): each rollout
    # generated ahead in segments, every segment from the newest weights the staleness bound allows (k >= 1 only;
    # its speed-up is against grpo's k = 0)
    "grpo-partial": ("configs/quickstart/grpo.yaml", ["--model.init_args.rollout.partial=12"]),
}
LONG = {
    "prompt_words": 100,
    "prompts": 4,
    "group": 8,
    "max_new_tokens": 128,
    "vocab": 512,
    "test_prompts": 100,
}
"""The long shape (``--stages grpo-long ...``): the step of ``bench_vs_trl.py --prompt-words 100 --group 8
--rollout-prompts 4 --max-new-tokens 128`` as an ``alignlit fit`` run. A 3M-parameter random Llama with
512 positions (``harness.vs_trl.MODEL``; the quickstart policy has 128) samples responses that run to
~105 of the 128 new tokens after ~140-token prompts (a 100-symbol context before each simulated-task
prompt), so generation is most of the step; the reward is the simulated task's gold reward of the
response (``harness.vs_trl.reward_fn``, which strips the context), so ``gold`` is the training reward
on held-out prompts. One pass over each rollout in minibatches of 16 (TRL's ``num_iterations: 1``, as in
``bench_vs_trl.py``)."""
LONG_OVERRIDES = [
    "--model.init_args.policy={long}/policy", "--model.init_args.reward=harness.vs_trl.reward_fn",
    "--model.init_args.gold=null", "--model.init_args.ptx=null",
    "--data.init_args.train_file={long}/prompts_train.jsonl", "--data.init_args.val_file=null",
    f"--data.init_args.batch_size={LONG['prompts']}", f"--model.init_args.rollout.samples_per_prompt={LONG['group']}",
    f"--model.init_args.rollout.sampling.max_new_tokens={LONG['max_new_tokens']}",
    f"--model.init_args.minibatches.size={LONG['prompts'] * LONG['group'] // 2}", "--model.init_args.minibatches.epochs=1",
]  # fmt: skip
CONFIGS["grpo-long"] = ("configs/quickstart/grpo.yaml", LONG_OVERRIDES)
# partial rollouts at the long shape: two segments of 64 new tokens
CONFIGS["grpo-long-partial"] = (
    "configs/quickstart/grpo.yaml",
    [*LONG_OVERRIDES, f"--model.init_args.rollout.partial={LONG['max_new_tokens'] // 2}"],
)


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


def prepare_long(work: Path) -> Path:
    """The long shape's assets under ``work/long``: simulated-task prompts with their context (train, test), the
    sim tokenizer and the random policy (:data:`LONG`); the cell ``long`` of ``Cells(work)``, made again for
    other settings or when the policy is gone."""
    from alignlit.data.tokenizer import load_tokenizer
    from alignlit.models import export_pretrained, make_tiny_llama
    from alignlit.sim import make_data, write_tokenizer
    from harness.vs_trl import MODEL, with_context

    root = work / "long"

    def make() -> dict:
        make_data(
            root / "sim", seed=0, n_sft=10, n_pairs=10, n_prompts=400, n_val=10, n_test=LONG["test_prompts"]
        )
        for split in ("train", "test"):
            lines = (root / "sim" / f"prompts_{split}.jsonl").read_text().splitlines()
            prompts = [
                with_context(json.loads(line)["prompt"], LONG["prompt_words"], i)
                for i, line in enumerate(lines)
            ]
            (root / f"prompts_{split}.jsonl").write_text(
                "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
            )
        write_tokenizer(str(root / "sim"), vocab_size=LONG["vocab"])
        tokenizer = load_tokenizer(root / "sim" / "tokenizer")
        policy = make_tiny_llama(tokenizer, seed=0, max_position_embeddings=512, **MODEL)
        export_pretrained(policy, tokenizer, root / "policy", stage="bench")
        return {"root": str(root)}

    policy = root / "policy" / "config.json"
    Cells(work).run("long", make, spec={"long": LONG, "model": MODEL}, valid=lambda _: policy.exists())
    return root


def fit(args, stage: str, engine: str, k: int, seed: int, threads: int = 1) -> dict:
    """One training run; its record (timings from the history, the export's path). ``threads``: torch
    threads of the trainer (and of an in-process engine); the HF worker always has one."""
    run = Path(args.work) / f"{stage}-{engine}-k{k}-s{seed}" if threads == 1 else (
        Path(args.work) / f"{stage}-{engine}-k{k}-t{threads}-s{seed}"
    )  # fmt: skip
    config, overrides = CONFIGS[stage]
    env = {**args.env, "OMP_NUM_THREADS": str(threads)}
    if stage.startswith("grpo-long"):
        long = prepare_long(Path(args.work))
        overrides = [o.format(long=long) for o in overrides]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), env.get("PYTHONPATH")]))
        env["BENCH_SIM_DIR"] = str(long / "sim")
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
    if engine == "vllm":  # vLLM's engine (in-process at k = 0, its own process at k >= 1): `threads` threads
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"

    def measure() -> dict:
        wall, cpu = run_alignlit(argv, Path(args.root), run / "fit.log", env)
        history = [h for h in json.loads((run / "curves.json").read_text()) if "time/train_s" in h]
        steps = [
            {
                "seconds": h["time/rollout_s"] + h["time/train_s"],
                "samples": h.get("rollout/samples", 0.0),
                "wait": h.get("async/wait_s", h["time/rollout_s"]),
                "staleness": h.get("async/staleness_max", 0.0),
                "token_staleness": h.get("async/token_staleness_mean"),  # partial rollouts: per token
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
            "reward_curve": [h.get("reward/raw") for h in history],
            "token_staleness_mean": (
                sum(s["token_staleness"] for s in steady) / len(steady)
                if all(s["token_staleness"] is not None for s in steady) else None
            ),
        }  # fmt: skip
        return record

    return Cells(run).run(
        "fit", measure, spec={"argv": argv}, valid=lambda _: (run / "policy" / "config.json").exists()
    )


def evaluate(args, record: dict) -> dict:
    """Gold reward and KL to SFT of a run's export on the test prompts: the cell ``eval_test`` of the run's
    folder, computed again for another prompt count or another export."""
    export = Path(record["policy"]) / "config.json"
    return Cells(Path(record["policy"]).parent).run(
        "eval_test",
        lambda: evaluate_now(args, record),
        spec={"prompts": args.test_prompts, "policy": export.stat().st_mtime},
    )


def evaluate_now(args, record: dict) -> dict:
    from alignlit.data import parse_prompt, read_records
    from alignlit.eval.gold import evaluate_policy
    from alignlit.models import load_policy
    from alignlit.rollout import SamplingParams
    from alignlit.sim import load_sim

    root = Path(args.root)
    if record["stage"].startswith("grpo-long"):  # the long shape: its own prompts, start policy and reward
        from harness import vs_trl

        long = prepare_long(Path(args.work))
        os.environ["BENCH_SIM_DIR"] = str(long / "sim")
        test, start, reward, new_tokens = (
            long / "prompts_test.jsonl",
            long / "policy",
            vs_trl.reward_fn,
            LONG["max_new_tokens"],
        )
    else:
        task, _ = load_sim(root / "data/sim")
        test, start, reward, new_tokens = (
            root / "data/sim/prompts_test.jsonl",
            root / "out/quickstart/sft",
            task.gold_rewards,
            24,
        )
    prompts = [parse_prompt(r) for r in read_records(test)][: args.test_prompts]
    sft, _ = load_policy(start)
    policy, tokenizer = load_policy(record["policy"])
    sft.eval(), policy.eval()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=record["seed"])
    result = evaluate_policy(policy, tokenizer, prompts, reward, reference=sft, sampling=sampling,
                             batch_size=100, name=f"{record['stage']} k={record['k']}")  # fmt: skip
    return {"prompts": len(prompts), **result.as_dict()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=".", help="folder with data/sim and out/quickstart/{sft,reward}")
    p.add_argument("--work", default="out/bench_async", help="run folders (relative to --root)")
    p.add_argument("--results", default=str(ROOT / "benchmarks/results"))
    p.add_argument("--name", default="async", help="results file name (<results>/<name>.{json,md,png})")
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
        if not (k == 0 and stage in SYNC_BASE)  # partial rollouts need k >= 1
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


def report(args, records: list[dict]) -> dict:
    """Write ``<results>/<name>{,_tiny}.{json,md,png}`` from the runs' records; the rows."""
    rows = table(records)
    name = f"{args.name}_tiny" if args.tiny else args.name
    text = format_table(rows)
    command = command_line([__file__, *sys.argv[1:]])
    write_results(name, {"rows": rows, "runs": records}, command=command, table=text,
                  plot=lambda path: plot(rows, path), results_dir=args.results)  # fmt: skip
    print(text)
    return {"rows": rows}


if __name__ == "__main__":
    main()
