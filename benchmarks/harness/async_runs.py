"""The tables of ``benchmarks/bench_async.py`` (asynchronous rollouts against the synchronous loop): the
phases read from a run's history, one row per (stage, engine, k, trainer threads) with speed-ups and the
overlap ceiling, its markdown and plot, and ``--collect``'s finished runs."""

from __future__ import annotations

import statistics
from pathlib import Path

from harness import Cells, mean_std, pm

PHASES = {
    "rollout_s": "time/rollout_s", "train_s": "time/train_s", "generate_s": "rollout/generate_s",
    "score_s": "rollout/score_s", "sync_s": "rollout/sync_s", "old_logp_s": "time/old_logp_s",
    "ref_logp_s": "time/ref_logp_s",
}  # fmt: skip

SYNC_BASE = {"grpo-partial": "grpo", "grpo-long-partial": "grpo-long"}
"""Stages without a synchronous run of their own (partial rollouts need k >= 1): the stage whose k = 0 runs are
their speed-up's base and overlap ceiling."""


def seed_mean_curve(runs: list[dict]) -> list[float] | None:
    """The runs' training reward per rollout (``reward_curve``), averaged over seeds; None when a run has none."""
    curves = [r.get("reward_curve") for r in runs]
    if not curves or any(c is None for c in curves):
        return None
    return [sum(values) / len(values) for values in zip(*curves, strict=False)]


def reward_lag(curve: list[float] | None, base: list[float] | None) -> float | None:
    """How many rollouts ``curve`` (training reward per rollout) trails ``base`` (k = 0's): the mean gap
    ``mean(base - curve)`` over their common rollouts divided by ``base``'s least-squares slope per rollout.
    0 when they learn at the same pace, 1 when ``curve`` is ``base`` one rollout later (on a straight line).
    None without both curves or when ``base`` does not rise."""
    if not curve or not base:
        return None
    n = min(len(curve), len(base))
    slope = statistics.linear_regression(range(n), base[:n]).slope if n > 1 else 0.0
    if slope <= 0:
        return None
    return (statistics.fmean(base[:n]) - statistics.fmean(curve[:n])) / slope


def table(records: list[dict]) -> list[dict]:
    """One row per (stage, engine, k, trainer threads): means (± std) over its seeds. The speed-up is against
    k = 0 with one thread, ``speedup_vs_sync_threads`` against k = 0 with the most trainer threads run
    (``sync_threads``; None without such a run); ``ceiling`` is the speed-up of a perfect overlap of that synchronous run's two
    phases, (rollout + train) / max(rollout, train) per step, what k >= 1 can reach at best; ``reward_lag``
    is how many rollouts its seed-mean training reward trails k = 0's (:func:`reward_lag`)."""
    rows = []
    for stage, engine, k, threads in sorted(
        {(r["stage"], r["engine"], r["k"], r["threads"]) for r in records}
    ):
        runs = [
            r
            for r in records
            if (r["stage"], r["engine"], r["k"], r["threads"]) == (stage, engine, k, threads)
        ]
        sync = SYNC_BASE.get(stage, stage)
        base = [r for r in records if (r["stage"], r["engine"], r["k"], r["threads"]) == (sync, engine, 0, 1)]
        synced = [
            r for r in records if (r["stage"], r["engine"], r["k"]) == (sync, engine, 0) and r["threads"] > 1
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
        curve = seed_mean_curve(runs)
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
            "reward_curve": curve, "reward_lag": reward_lag(curve, seed_mean_curve(base)) if k else None,
            "staleness_histogram": dict(sorted(histogram.items())),
            "token_staleness_mean": mean_std([r["token_staleness_mean"] for r in runs])[0]
            if all(r.get("token_staleness_mean") is not None for r in runs) else None,
        })  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| stage | engine | k | trainer threads | samples/s (steady) | speed-up vs k = 0 | vs k = 0 on all threads | "
        "overlap ceiling | samples/s (whole run) | trainer waits | generate / score / train s per step | cores used | "
        "gold (test) | KL to SFT | seeds | training reward behind k = 0 (rollouts) | staleness of trained steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
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
            + ("" if r.get("reward_lag") is None else f"{r['reward_lag']:.1f}")
            + " | "
            + ", ".join(f"{s}: {c}" for s, c in r["staleness_histogram"].items())
            + (
                ""
                if r.get("token_staleness_mean") is None
                else f" (per token: {r['token_staleness_mean']:.2f})"
            )
            + " |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [r for r in rows if r.get("reward_curve") and r["threads"] == 1]
    fig, axes = plt.subplots(
        1,
        3 if curves else 2,
        figsize=(19 if curves else 13, 3.8),
        width_ratios=[1.4, 1, 1][: 3 if curves else 2],
    )
    for r in curves:
        axes[2].plot(
            range(1, len(r["reward_curve"]) + 1), r["reward_curve"], label=f"{r['stage']} k = {r['k']}"
        )
    if curves:
        axes[2].set(xlabel="rollout", ylabel="training reward (seed mean)", title="learning per rollout")
        axes[2].legend(fontsize=7)
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
    for ax in axes[:2]:
        ax.set_xticks(sorted({r["k"] for r in rows}))
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside the crowded axes
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def collect(args) -> list[dict]:
    """The finished runs under ``--work`` (each run folder's ``fit`` cell and its ``eval_test`` cell) that
    ``--collect`` tabulates."""
    records = []
    for run in sorted(path.parent.parent for path in Path(args.work).glob("*/cells/fit.json")):
        record, evaluation = Cells(run).latest("fit"), Cells(run).latest("eval_test") or {}
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
