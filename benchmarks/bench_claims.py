"""The source papers' claims, tested on the simulated task (README "The seeds' claims, tested").

Every arm is one ``alignlit fit`` of a shipped quickstart config with the overrides in ``arms()``, from the
shared stages of ``bench_quality.py`` (data, SFT, the reward model, 4 ranked SFT samples per training
prompt) plus two of its own: the same samples ranked by the gold reward (``samples-gold``: the offline
pairs of an oracle labeller) and a reward model trained without length balancing (``reward-unbalanced``).
Hyperparameters are the quality table's validation choices (``benchmarks/results/quality_selection.md``:
PPO-max ``kl.coef`` 0.1, DPO β 0.3, online DPO learning rate 5e-5, RRHF rank weight 0.1); nothing here
is selected on test prompts. Each arm runs with ``--seeds`` and is evaluated on ``--test-prompts``
prompts of ``prompts_test`` (T = 1, sampling seed = the seed): gold reward, the reward model's score
of the same responses (the proxy), KL to the SFT policy (Monte Carlo), length.

Claims (``CLAIMS``):

- ``overopt`` (Secrets of RLHF I; Gao et al. 2022's picture): PPO-max, vanilla PPO and GRPO trained
  ``--long`` times the quickstart's 30 rollouts, the policy exported every ``--snapshot-every`` rollouts
  (``alignlit.callbacks.ExportEvery``) and each snapshot evaluated: gold and proxy against KL.
- ``online-dpo`` (RLHF-Workflow): offline DPO on the 1500 prompts' ranked SFT samples vs online iterative
  DPO on 3 x 500 prompts (as many labels), with the reward model and with the gold reward as labeller;
  online DPO with a length penalty (λ = ``--length-penalty`` per token).
- ``rrhf`` (RRHF Table 2): RRHF vs PPO-max at the quickstart's length, gold and wall time.
- ``chatglm`` (ChatGLM-RLHF §3.3–3.4): PPO-max with the reward-variance prompt filter (ε: the 25th
  percentile of the reward model's variance over the 4 SFT samples of the training prompts, from the
  shared samples) and PPO-max against a reward model trained without length balancing, each against
  PPO-max as shipped; both reward models' accuracy against gold preferences (``pairs_gold_val``).

Writes ``<results>/claims.{json,md}`` and ``claims_overopt.png``. Cells are cached under ``--work`` like
``bench_quality.py`` (a rerun skips finished runs and evaluations).

    python benchmarks/bench_claims.py --work out/bench_claims
    python benchmarks/bench_claims.py --claims overopt --seeds 0      # one claim, one seed
    python benchmarks/bench_claims.py --tiny                           # the pipeline at toy size
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quality as bq
from harness import stamp  # benchmarks/ is on sys.path when a script runs

ROOT = bq.ROOT
QUICKSTART_ROLLOUTS = 30


@dataclass(frozen=True)
class Arm:
    """One trained row: ``config`` with ``setting`` (keys as in ``bench_quality.GRIDS``)."""

    name: str
    label: str
    config: str
    setting: dict = field(default_factory=dict)
    snapshots: bool = False  # export every --snapshot-every rollouts (the long runs)


PPO_MAX = {"kl.coef": 0.1}
DPO = {"loss_args": {"beta": 0.3, "label_smoothing": 0.0}}
ONLINE_DPO = {"optim.lr": 5e-5}
GOLD = {"class_path": "alignlit.sim.SimGoldReward", "init_args": {"sim_dir": "data/sim"}}


def arms(args) -> dict[str, list[Arm]]:
    long = {"trainer.limit_train_batches": QUICKSTART_ROLLOUTS * args.long}
    ppo_max = Arm("ppo-max", "PPO-max (as shipped, 30 rollouts)", "ppo", PPO_MAX)  # in two claims, run once
    return {
        "overopt": [
            Arm("ppo-max-long", "PPO-max, long", "ppo", {**PPO_MAX, **long}, snapshots=True),
            Arm("ppo-vanilla-long", "vanilla PPO, long", "ppo-vanilla", dict(long), snapshots=True),
            Arm("grpo-long", "GRPO, long", "grpo", dict(long), snapshots=True),
        ],
        "online-dpo": [
            Arm("dpo-rm", "offline DPO, RM labels", "dpo", DPO),
            Arm("online-dpo-rm", "online DPO, RM labels", "online-dpo", ONLINE_DPO),
            Arm(
                "dpo-gold",
                "offline DPO, gold labels",
                "dpo",
                {**DPO, "data.init_args.train_file": "GOLD_PAIRS"},
            ),
            Arm("online-dpo-gold", "online DPO, gold labels", "online-dpo", {**ONLINE_DPO, "reward": GOLD}),
            Arm(
                "online-dpo-rm-lp",
                f"online DPO, RM labels, length penalty {args.length_penalty:g}",
                "online-dpo",
                {**ONLINE_DPO, "length_penalty": args.length_penalty},
            ),
        ],
        "rrhf": [
            ppo_max,
            Arm("rrhf", "RRHF", "rrhf", {"rank_weight": 0.1}),
        ],
        "chatglm": [
            ppo_max,
            Arm(
                "ppo-max-filter",
                "PPO-max + reward-variance prompt filter",
                "ppo",
                {**PPO_MAX, "prompt_filter": "EPS"},
            ),
            Arm(
                "ppo-max-unbalanced-rm",
                "PPO-max, RM trained without length balancing",
                "ppo",
                {**PPO_MAX, "reward": "PREFIX/reward-unbalanced"},
            ),
        ],
    }


class ClaimsBench(bq.Bench):
    """``bench_quality.Bench`` with two more shared stages and one directory per arm and seed."""

    def __init__(self, args):
        super().__init__(args, [])
        self.extra = self.root / self.prefix

    def fit_args(self, config_name: str, seed: int, setting: dict | None = None) -> list[str]:
        """``bench_quality``'s, with the arm's callbacks kept under ``--tiny`` too."""
        setting = dict(setting or {})
        callbacks = setting.pop("trainer.callbacks", None)
        argv = super().fit_args(config_name, seed, setting)
        return argv + ([f"--trainer.callbacks={json.dumps(callbacks)}"] if callbacks else [])

    def run_dir(self, method: str, setting: dict, seed: int) -> Path:
        return self.work / "runs" / method / f"seed{seed}"

    def prepare_run_dir(self, path: Path) -> None:
        super().prepare_run_dir(path)
        for d in ("samples-gold", "reward-unbalanced"):
            link = path / self.prefix / d
            if not link.is_symlink():
                link.symlink_to(self.root / self.prefix / d, target_is_directory=True)

    def shared_extra(self) -> dict:
        """The oracle-ranked samples and the unbalanced reward model (after :meth:`shared`)."""
        done_file = self.work / "shared_extra.json"
        times = bq.read_json(done_file)
        reward = [
            *self.fit_args("reward.yaml", 0),
            "--data.init_args.length_balance=false",
            f"--model.init_args.export_dir={self.prefix}/reward-unbalanced",
        ]
        steps = [
            (
                "samples-gold",
                self.sample_args("samples-gold", "gold", sim=True),
                self.extra / "samples-gold" / "pairs.jsonl",
            ),
            ("reward-unbalanced", reward, self.extra / "reward-unbalanced" / "alignlit.json"),
        ]
        for name, argv, result in steps:
            if times.get(name, {}).get("stamp") == self.shared_stamp and result.exists():
                continue
            print(f"bench_claims: shared stage {name}: alignlit {' '.join(argv)}", flush=True)
            elapsed = bq.run_alignlit(name, argv, self.root, self.work / "logs" / f"{name}.log")
            times[name] = {"s": elapsed, "stamp": self.shared_stamp}
            done_file.write_text(json.dumps(times, indent=1) + "\n")
        return times

    # evaluation with the proxy reward

    def evaluate_policy_dir(self, policy_dir: Path | None, seed: int, cell_file: Path, stamp: float) -> dict:
        """Gold, proxy (the reward model's score), KL to SFT and length of ``policy_dir`` (None: the SFT
        policy) on the test prompts, cached in ``cell_file`` for the policy finished at ``stamp``."""
        from alignlit.eval.gold import evaluate_policy
        from alignlit.models import load_policy
        from alignlit.rollout import SamplingParams
        from alignlit.rollout.reward_protocol import resolve_reward, score_texts
        from alignlit.sim import load_sim

        prompts = self.prompts("test")
        cached = bq.read_json(cell_file)
        if cached.get("stamp") == stamp and cached.get("prompts") == len(prompts):
            return cached
        task, _ = load_sim(self.root / "data" / "sim")
        rm = resolve_reward(str(self.root / self.prefix / "reward"), batch_size=256)
        proxy: list[float] = []

        def gold_and_proxy(ps, rs):
            proxy.extend(score_texts(rm, list(ps), list(rs)).tolist())
            return task.gold_rewards(ps, rs)

        sft, tokenizer = load_policy(self.root / self.prefix / "sft")
        sft.eval()
        policy, policy_tokenizer = (sft, tokenizer) if policy_dir is None else load_policy(policy_dir)
        policy.eval()
        start = time.perf_counter()
        result = evaluate_policy(
            policy,
            policy_tokenizer,
            prompts,
            gold_and_proxy,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=self.args.max_new_tokens, seed=seed),
            reference=sft,
            batch_size=self.args.batch_size,
        )
        record = {
            **result.as_dict(),
            "proxy": statistics.mean(proxy),
            "prompt_gold": result.prompt_gold,
            "prompts": len(prompts),
            "seed": seed,
            "eval_s": time.perf_counter() - start,
            "stamp": stamp,
        }
        bq.write_cell(cell_file, record)
        return record


def resolve_setting(setting: dict, bench: ClaimsBench, epsilon: float | None) -> dict:
    out = {}
    for k, v in setting.items():
        if v == "GOLD_PAIRS":
            v = f"{bench.prefix}/samples-gold/pairs.jsonl"
        elif v == "EPS":
            v = {"k": 4, "epsilon": epsilon, "seed": 0, "batch_size": 256}
        elif isinstance(v, str) and v.startswith("PREFIX/"):
            v = f"{bench.prefix}/{v.removeprefix('PREFIX/')}"
        out[k] = v
    return out


def filter_epsilon(ranked: Path, quantile: float = 0.25) -> tuple[float, dict]:
    """ε of the prompt filter: the ``quantile`` of the per-prompt unbiased variance of the reward model's
    scores of the shared SFT samples (training prompts only)."""
    from alignlit.data import read_records

    variances = sorted(
        statistics.variance(r.fields["scores"]) for r in read_records(ranked) if len(r.fields["scores"]) > 1
    )
    eps = variances[int(quantile * (len(variances) - 1))]
    return eps, {
        "prompts": len(variances),
        "quantile": quantile,
        "epsilon": eps,
        "median": statistics.median(variances),
    }


def aggregate(records: list[dict], sft_records: dict[int, dict]) -> dict:
    """Mean and std over seeds; the ``*_vs_sft`` columns are paired with the SFT record of the same
    sampling seed (the same test prompts, the same seed)."""
    from alignlit.eval.gold import win_rate

    sft = {seed: r["prompt_gold"] for seed, r in sft_records.items()}

    out = {"seeds": [r["seed"] for r in records]}
    columns = {
        "gold": [r["gold"] for r in records],
        "proxy": [r["proxy"] for r in records],
        "kl": [r["kl_to_reference"] for r in records],
        "length": [r["length"] for r in records],
        "wall_s": [r.get("wall_s") for r in records],
        "win_vs_sft": [win_rate(r["prompt_gold"], sft[r["seed"]]) for r in records if r["seed"] in sft],
        "gold_vs_sft": [r["gold"] - sft_records[r["seed"]]["gold"] for r in records if r["seed"] in sft],
        "proxy_vs_sft": [r["proxy"] - sft_records[r["seed"]]["proxy"] for r in records if r["seed"] in sft],
    }
    for key, values in columns.items():
        out[key], out[f"{key}_std"] = bq.mean_std(values)
    return out


def table_md(rows: list[dict]) -> str:
    lines = [
        "| claim | arm | gold | gold − SFT (paired) | proxy − SFT (paired) | KL to SFT | length | wall s | seeds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['claim']} | {r['label']} | {bq.pm(r['gold'], r['gold_std'])} | {bq.pm(r['gold_vs_sft'], r['gold_vs_sft_std'])} | "
            f"{bq.pm(r['proxy_vs_sft'], r['proxy_vs_sft_std'])} | {bq.pm(r['kl'], r['kl_std'], 2)} | {bq.pm(r['length'], r['length_std'], 1)} | "
            f"{bq.pm(r['wall_s'], r['wall_s_std'], 0)} | {len(r['seeds'])} |"
        )
    return "\n".join(lines)


def curves_md(curves: dict[str, list[dict]]) -> str:
    lines = [
        "| arm | rollouts | gold | gold − SFT (paired) | proxy − SFT (paired) | KL to SFT | length |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, points in curves.items():
        for p in points:
            lines.append(
                f"| {arm} | {p['rollouts']} | {bq.pm(p['gold'], p['gold_std'])} | "
                f"{bq.pm(p['gold_vs_sft'], p['gold_vs_sft_std'])} | {bq.pm(p['proxy_vs_sft'], p['proxy_vs_sft_std'])} | "
                f"{bq.pm(p['kl'], p['kl_std'], 2)} | {bq.pm(p['length'], p['length_std'], 1)} |"
            )
    return "\n".join(lines)


def plot_overopt(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    """Gold and proxy reward against sqrt(KL to SFT) along each long run (Gao et al. 2022's axes), as
    differences from the SFT policy's on the same prompts and sampling seed (mean ± std over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm, points in curves.items():
        x = [max(p["kl"], 0.0) ** 0.5 for p in points]
        for ax, key in zip(axes, ("gold_vs_sft", "proxy_vs_sft")):
            ax.errorbar(
                x,
                [p[key] for p in points],
                yerr=[p[f"{key}_std"] or 0 for p in points],
                marker="o",
                label=arm,
                capsize=2,
            )
            for xi, p in zip(x, points):
                ax.annotate(
                    str(p["rollouts"]), (xi, p[key]), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    for ax, key in zip(axes, ("gold reward − SFT's (test)", "proxy: reward-model score − SFT's (test)")):
        ax.set_xlabel("sqrt(KL to SFT)")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims", nargs="*", default=["overopt", "online-dpo", "rrhf", "chatglm"])
    p.add_argument("--configs", default=str(ROOT / "configs" / "quickstart"))
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument(
        "--long", type=int, default=3, help="length of the long runs, times the quickstart's 30 rollouts"
    )
    p.add_argument("--snapshot-every", type=int, default=15, help="rollouts between the long runs' snapshots")
    p.add_argument(
        "--length-penalty", type=float, default=0.05, help="λ of online DPO's length-penalised arm"
    )
    p.add_argument("--test-prompts", type=int, default=500)
    p.add_argument("--val-prompts", type=int, default=200)
    p.add_argument("--sample-prompts", type=int, default=1500, help="training prompts of the offline pairs")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--work", default="out/bench_claims")
    p.add_argument("--results", default=None, help="default: benchmarks/results (--tiny: WORK/results)")
    p.add_argument("--tiny", action="store_true", help="toy sizes: the pipeline in minutes")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per evaluated policy otherwise
    if args.tiny:
        args.test_prompts, args.sample_prompts, args.long, args.snapshot_every = 16, 48, 1, 1
    args.suite, args.grid_limit, args.max_val_kl = "quality", None, None
    results = Path(
        args.results or (Path(args.work) / "results" if args.tiny else ROOT / "benchmarks" / "results")
    )
    bench = ClaimsBench(args)
    shared = bench.shared()
    extra = bench.shared_extra()
    epsilon, filter_report = filter_epsilon(bench.root / bench.prefix / "samples" / "ranked.jsonl")
    print(f"bench_claims: prompt filter ε = {epsilon:.4g} ({filter_report})", flush=True)

    sft_records = {
        s: bench.evaluate_policy_dir(
            None, s, bench.work / "runs" / "sft" / f"seed{s}" / "eval_test.json", shared["stamp"]
        )
        for s in args.seeds
    }
    sft_row = {
        "claim": "all",
        "name": "sft",
        "label": "SFT",
        **aggregate(list(sft_records.values()), sft_records),
    }
    rows, curves, seen = [sft_row], {}, {}
    for claim in args.claims:
        for arm in arms(args)[claim]:
            if arm.name in seen:
                rows.append({**seen[arm.name], "claim": claim})
                continue
            method = bq.Method(arm.name, arm.label, "fit", arm.config)
            bench.methods[arm.name] = method
            setting = resolve_setting(arm.setting, bench, epsilon)
            if arm.snapshots:
                every = {"every_n_batches": args.snapshot_every, "dirpath": "snapshots"}
                setting["trainer.callbacks"] = [
                    {"class_path": "alignlit.callbacks.ExportEvery", "init_args": every}
                ]
            records, points = [], {}
            for s in args.seeds:
                export, run = bench.fit(method, setting, s)
                run_dir = bench.run_dir(arm.name, setting, s)
                rec = bench.evaluate_policy_dir(export, s, run_dir / "eval_test.json", run["stamp"])
                rec["wall_s"] = run["fit_s"]
                kept = re.search(
                    r"prompt filter kept (\d+) of (\d+) prompts", (run_dir / "fit.log").read_text()
                )
                if kept:
                    rec["prompt_filter_kept"] = [int(kept[1]), int(kept[2])]
                records.append(rec)
                if arm.snapshots:
                    index = [
                        json.loads(line)
                        for line in (run_dir / "snapshots" / "snapshots.jsonl").read_text().splitlines()
                    ]
                    last = {r["batch"]: r for r in index}  # a rerun appends: the last line of each batch
                    for batch, snap in sorted(last.items()):
                        cell = run_dir / "snapshots" / f"eval_test_{batch:05d}.json"
                        srec = bench.evaluate_policy_dir(run_dir / snap["path"], s, cell, run["stamp"])
                        srec["fit_s"] = snap["fit_s"]
                        points.setdefault(batch, []).append(srec)
                    points.setdefault(0, []).append(sft_records[s])
                print(
                    f"bench_claims: {arm.name} seed {s}: gold {rec['gold']:.3f} KL {rec['kl_to_reference']:.2f}",
                    flush=True,
                )
            row = {
                "claim": claim,
                "name": arm.name,
                "label": arm.label,
                "setting": bq.slug(setting),
                **aggregate(records, sft_records),
            }
            if any("prompt_filter_kept" in r for r in records):
                row["prompt_filter_kept"] = [r.get("prompt_filter_kept") for r in records]
            seen[arm.name] = row
            rows.append(row)
            if points:
                curves[arm.label] = [
                    {"rollouts": b, **aggregate(recs, sft_records)} for b, recs in sorted(points.items())
                ]

    reward_models = {}
    if "chatglm" in args.claims:
        from alignlit.data import read_records
        from alignlit.eval.score import evaluate_pairs

        pairs = read_records(bench.root / "data" / "sim" / "pairs_gold_val.jsonl")
        for name in ("reward", "reward-unbalanced"):
            reward_models[name] = evaluate_pairs(
                str(bench.root / bench.prefix / name), pairs, batch_size=256, max_length=None
            )

    results.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python benchmarks/bench_claims.py", *(sys.argv[1:] if argv is None else argv)])
    note = (
        f"{args.test_prompts} prompts_test prompts, T = 1; mean ± std over seeds {args.seeds}; configs "
        f"{Path(args.configs).name}; {time.strftime('%Y-%m-%d')}; `{command}`"
    )
    rm_md = "\n".join(
        ["| reward model | accuracy vs gold (pairs_gold_val) | reward–length corr |", "|---|---:|---:|"]
        + [f"| {k} | {v['accuracy']:.3f} | {v['reward_length_corr']:.3f} |" for k, v in reward_models.items()]
    )
    md = "\n\n".join(
        [table_md(rows), curves_md(curves) if curves else "", rm_md if reward_models else "", note]
    )
    (results / "claims.md").write_text(md + "\n")
    (results / "claims.json").write_text(
        json.dumps(
            stamp(
                {
                    "setup": {
                        **{k: v for k, v in vars(args).items()},
                        "date": time.strftime("%Y-%m-%d"),
                        "command": command,
                    },
                    "shared_stage_s": shared,
                    "shared_extra_s": extra,
                    "prompt_filter": filter_report,
                    "rows": rows,
                    "curves": curves,
                    "reward_models": reward_models,
                }
            ),
            indent=1,
        )
        + "\n"
    )
    if curves:
        plot_overopt(
            curves,
            results / "claims_overopt.png",
            f"long runs, {args.test_prompts} test prompts, mean ± std over seeds {args.seeds}",
        )
    print(md)
    return {"rows": rows, "curves": curves, "reward_models": reward_models}


if __name__ == "__main__":
    main()
