"""The claims benchmark's machinery (``benchmarks/bench_claims.py`` runs it): the arms of each claim, the
bench (the quality benchmark's :class:`harness.quality.Bench` with the claims' own shared stages and
evaluation), the aggregation, the tables and the over-optimisation plot."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import (  # benchmarks/ is on sys.path when a script runs
    mean_std,
    pm,
    run_alignlit,
)
from harness import quality as bq

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
        """The oracle-ranked samples and the unbalanced reward model (after :meth:`shared`), one cell each
        (``shared-<name>``, read back for the same command and shared stages); their wall times."""
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
        times = {}
        for name, argv, result in steps:

            def run(name=name, argv=argv) -> dict:
                print(f"bench_claims: shared stage {name}: alignlit {' '.join(argv)}", flush=True)
                elapsed = run_alignlit(name, argv, self.root, self.work / "logs" / f"{name}.log")
                return {"s": elapsed, "stamp": self.shared_stamp}

            spec = {"argv": argv, "shared_stamp": self.shared_stamp}
            times[name] = self.cells.run(f"shared-{name}", run, spec, valid=lambda _, r=result: r.exists())
        return times

    # evaluation with the proxy reward

    def evaluate_policy_dir(self, policy_dir: Path | None, seed: int, key: str, stamp: float) -> dict:
        """The evaluation cell ``key``: gold, proxy (the reward model's score), KL to SFT and length of
        ``policy_dir`` (None: the SFT policy) on the test prompts, read back for the same policy (finished at
        ``stamp``), prompts and sampling."""
        spec = {
            "policy": None if policy_dir is None else str(policy_dir),
            "stamp": stamp,
            "prompts": len(self.prompts("test")),
            "seed": seed,
            "max_new_tokens": self.args.max_new_tokens,
        }
        return self.cells.run(key, lambda: self.proxy_evaluation(policy_dir, seed, stamp), spec)

    def proxy_evaluation(self, policy_dir: Path | None, seed: int, stamp: float) -> dict:
        """What :meth:`evaluate_policy_dir` computes."""
        from alignlit.eval.gold import evaluate_policy
        from alignlit.models import load_policy
        from alignlit.rollout import SamplingParams
        from alignlit.rollout.reward_protocol import resolve_reward, score_texts
        from alignlit.sim import load_sim

        prompts = self.prompts("test")
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
        out[key], out[f"{key}_std"] = mean_std(values)
    return out


def table_md(rows: list[dict]) -> str:
    lines = [
        "| claim | arm | gold | gold − SFT (paired) | proxy − SFT (paired) | KL to SFT | length | wall s | seeds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['claim']} | {r['label']} | {pm(r['gold'], r['gold_std'])} | {pm(r['gold_vs_sft'], r['gold_vs_sft_std'])} | "
            f"{pm(r['proxy_vs_sft'], r['proxy_vs_sft_std'])} | {pm(r['kl'], r['kl_std'], 2)} | {pm(r['length'], r['length_std'], 1)} | "
            f"{pm(r['wall_s'], r['wall_s_std'], 0)} | {len(r['seeds'])} |"
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
                f"| {arm} | {p['rollouts']} | {pm(p['gold'], p['gold_std'])} | "
                f"{pm(p['gold_vs_sft'], p['gold_vs_sft_std'])} | {pm(p['proxy_vs_sft'], p['proxy_vs_sft_std'])} | "
                f"{pm(p['kl'], p['kl_std'], 2)} | {pm(p['length'], p['length_std'], 1)} |"
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


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """``bench_claims.py``'s arguments (what :class:`ClaimsBench` and :func:`arms` read)."""
    p = argparse.ArgumentParser(description=description)
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
