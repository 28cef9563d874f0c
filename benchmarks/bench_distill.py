"""On-policy distillation against GRPO with the verifier, from the same SFT policy, on the simulated task.

The teacher is the quickstart's RLVR policy (the ``grpo-verifiable`` run: ``configs/verifiable/grpo.yaml`` on
``configs/quickstart/grpo.yaml``, trained from the SFT policy with its own seed, ``--teacher-seed``), the
student the SFT policy. Three arms, each the same number
of rollouts of 80 responses (10 prompts × 8) and the same optimiser, clipping and aggregation:

- ``distill``: ``configs/quickstart/distill.yaml``, the per-token advantage ``log π_T(y_t) − log π_old(y_t)``
  (the negative reverse KL on the student's own samples); the verifier's reward is logged, not trained on;
- ``gkd``: the same samples trained on GKD's generalised JSD (β = 0.5) over the full vocabulary
  (``jsd_coef: 1``, ``teacher_coef: 0``): no policy-gradient term;
- ``grpo``: the ``grpo-verifiable`` run, GRPO against the answer check; the teacher is attached
  with ``teacher_coef: 0`` only so that the reverse KL to it is logged along the run as for the others.

Protocol: the learning rate of each arm is chosen on ``--val-prompts`` prompts of ``prompts_val`` (seed 0, the
config's own rate times 1, 2 and 4, highest mean gold); the chosen rate is trained with every seed and
evaluated on ``--test-prompts`` prompts of ``prompts_test`` (T = 1, sampling seed = the seed): gold reward, the
share of answers the check accepts, KL to SFT and KL to the teacher (Monte Carlo on the policy's samples),
length and the fit's wall time. Along each run the student's training samples give the reverse KL to the
teacher and the verifier's pass rate per rollout, and 100 validation prompts give the gold every 10 rollouts:
``distill_curves.png`` plots them against rollouts and against wall time (mean ± std over seeds).

Every run and evaluation leaves its JSON under ``--work``; a rerun continues where it stopped.

    python benchmarks/bench_distill.py                    # the measurement (about 25 min on 2 idle cores)
    python benchmarks/bench_distill.py --tiny             # the pipeline at toy size (a few minutes)

Writes ``<results>/distill.{md,json}`` and ``distill_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Cells, config_args, run_alignlit, write_results

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = "quickstart"  # the scale: config_args(name, CONFIGS) is the quickstart stack of run `name`
TEACHER = "out/quickstart/teacher"
ARMS = {
    # name: (label, config, overrides of model.init_args)
    "distill": ("on-policy distillation (reverse KL)", "distill.yaml", {"teacher": TEACHER}),
    "gkd": (
        "GKD (generalised JSD, β = 0.5)",
        "distill.yaml",
        {"teacher": TEACHER, "teacher_coef": 0.0, "jsd_coef": 1.0, "jsd_beta": 0.5},
    ),
    "grpo": (
        "GRPO with the verifier",
        "grpo-verifiable.yaml",
        {"teacher": TEACHER, "teacher_coef": 0.0, "task_coef": 1.0},
    ),
}
LR_FACTORS = (1.0, 2.0, 4.0)
BASE_LR = 2.5e-5  # both configs' optim.lr
TINY_DATA = ["--n-sft", "2000", "--n-pairs", "400", "--n-prompts", "200", "--n-val", "64", "--n-test", "64"]


def quiet_trainer(seed: int) -> list[str]:
    """Every run: its seed, no checkpoints (a run is redone, not resumed), no progress bar."""
    return [f"--seed_everything={seed}", "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
            "--trainer.enable_progress_bar=false"]  # fmt: skip


def online_seed(seed: int) -> list[str]:
    """An online run's own seeds: ``seed_everything`` does not reach them. The rollouts are sampled with
    ``rollout.seed + i`` and the prompts shuffled with ``data.seed``, both 0 by default, so without these two
    every seed would train the same run (measured: two runs differing only in ``seed_everything`` ended with
    weights equal to 1.5e-8)."""
    return [f"--model.init_args.rollout.seed={seed}", f"--data.init_args.seed={seed}"]


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work).resolve()
        self.root = self.work / "root"  # data, SFT and the teacher, laid out as in a checkout
        self.rollouts = 3 if args.tiny else args.rollouts
        self.val_every = 1 if args.tiny else 10

    def shared(self) -> dict:
        """Data, the SFT policy and the teacher, once; their wall times."""
        steps = [
            ("make-data", ["sim", "make-data", "--out", "data/sim", *(TINY_DATA if self.args.tiny else [])]),
            ("sft", ["fit", *config_args("sft.yaml", CONFIGS), *quiet_trainer(0),
                     *(["--trainer.max_steps=6"] if self.args.tiny else [])]),
            ("teacher", ["fit", *config_args("grpo-verifiable.yaml", CONFIGS), *quiet_trainer(self.args.teacher_seed), *online_seed(self.args.teacher_seed),
                         f"--model.init_args.export_dir={TEACHER}",
                         f"--trainer.limit_train_batches={3 if self.args.tiny else 60}"]),
        ]  # fmt: skip
        self.root.mkdir(parents=True, exist_ok=True)
        times, after = (
            {},
            None,
        )  # each stage a cell after the one before it (a stage that ran reruns the later)
        for name, argv in steps:

            def stage(name=name, argv=argv) -> dict:
                print(f"bench_distill: {name}: alignlit {' '.join(argv)}", flush=True)
                seconds = run_alignlit(name, argv, self.root, self.work / "logs" / f"{name}.log")
                return {"s": seconds, "stamp": time.time()}

            done = Cells(self.work / "shared").run(name, stage, spec={"argv": argv, "after": after})
            times[name], after = done["s"], done["stamp"]
        return times

    def run_dir(self, arm: str, lr: float, seed: int) -> Path:
        return self.work / "runs" / arm / f"lr={lr:g}" / f"seed{seed}"

    def fit(self, arm: str, lr: float, seed: int) -> dict:
        """One training run (``fit`` of ``Cells(run_dir)``: skipped when the same command finished and its
        export exists); its record: wall time, load, history."""
        path = self.run_dir(arm, lr, seed)
        _, config, overrides = ARMS[arm]
        export = path / "export"
        argv = [
            "fit", *config_args(config, CONFIGS), *quiet_trainer(seed), *online_seed(seed),
            f"--trainer.limit_train_batches={self.rollouts}", f"--trainer.val_check_interval={self.val_every}",
            "--trainer.num_sanity_val_steps=-1", f"--trainer.logger.init_args.save_dir={path / 'logs'}",
            *[f"--model.init_args.{k}={v}" for k, v in overrides.items()],
            f"--model.init_args.optim.lr={lr}", f"--model.init_args.export_dir={export}",
        ]  # fmt: skip

        def train() -> dict:
            load = os.getloadavg()[0]
            print(f"bench_distill: {arm} lr={lr:g} seed {seed} (load {load:.2f})", flush=True)
            fit_s = run_alignlit(f"{arm} seed {seed}", argv, self.root, path / "fit.log")
            history = json.loads(next((path / "logs").rglob("policy_gradient_curves.json")).read_text())
            return {"arm": arm, "lr": lr, "seed": seed, "fit_s": fit_s, "load_at_start": load, "argv": argv,
                    "history": history, "export": str(export)}  # fmt: skip

        return Cells(path).run(
            "fit", train, spec={"argv": argv}, valid=lambda _: (export / "config.json").exists()
        )

    def evaluate(self, arm: str, lr: float, seed: int, split: str) -> dict:
        """Gold, pass rate, KL to SFT and to the teacher, length on ``split`` prompts (sampling seed = seed): the
        cell ``eval_<split>`` of ``Cells(run_dir)``, computed again for another prompt count or export."""
        count = self.args.val_prompts if split == "val" else self.args.test_prompts
        export = (
            self.run_dir(arm, lr, seed) / "export" / "config.json"
        )  # when the evaluated policy was written
        spec = {"prompts": count, "policy": export.stat().st_mtime}
        return Cells(self.run_dir(arm, lr, seed)).run(
            f"eval_{split}", lambda: self.evaluate_now(arm, lr, seed, split, count), spec=spec
        )

    def evaluate_now(self, arm: str, lr: float, seed: int, split: str, count: int) -> dict:
        import torch

        from alignlit.data import parse_prompt, read_records
        from alignlit.eval.gold import chunked_rollouts, kl_to_reference
        from alignlit.models import load_policy
        from alignlit.rollout import SamplingParams
        from alignlit.rollout.reward_protocol import score_texts
        from alignlit.sim import load_sim

        sim = self.root / "data" / "sim"
        prompts = [parse_prompt(r) for r in read_records(sim / f"prompts_{split}.jsonl")][:count]
        task, _ = load_sim(sim)
        policy, tokenizer = load_policy(self.run_dir(arm, lr, seed) / "export")
        sft, _ = load_policy(self.root / "out/quickstart/sft")
        teacher, _ = load_policy(self.root / TEACHER)
        for m in (policy, sft, teacher):
            m.eval()
        sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed)
        gold, lengths, kl_sft, kl_teacher = [], [], [], []
        with torch.no_grad():
            for rollout in chunked_rollouts(
                policy, tokenizer, prompts, n=1, sampling=sampling, batch_size=128
            ):
                gold += score_texts(task.gold_rewards, rollout.prompts, rollout.texts).tolist()
                lengths += rollout.response_lengths.float().tolist()
                kl_sft += kl_to_reference(rollout, sft, temperature=1.0).tolist()
                kl_teacher += kl_to_reference(rollout, teacher, temperature=1.0).tolist()
        record = {
            "arm": arm, "lr": lr, "seed": seed, "split": split, "prompts": len(prompts),
            "gold": statistics.mean(gold), "pass_rate": sum(g >= 1 - 1e-9 for g in gold) / len(gold),
            "kl_to_sft": statistics.mean(kl_sft), "kl_to_teacher": statistics.mean(kl_teacher),
            "length": statistics.mean(lengths),
        }  # fmt: skip
        return record

    def reference_rows(self) -> dict:
        """The SFT policy's and the teacher's own test numbers (sampling seeds as the arms')."""
        import shutil

        rows = {}
        for name, src in (("sft", self.root / "out/quickstart/sft"), ("teacher", self.root / TEACHER)):
            records = []
            for seed in self.args.seeds:
                export = self.run_dir(name, 0.0, seed) / "export"

                # the cell ``export``: the policy copied, again once its source changes
                def copy(src=src, export=export) -> dict:
                    shutil.rmtree(export, ignore_errors=True)
                    shutil.copytree(src, export)
                    return {"export": str(export)}

                Cells(export.parent).run(
                    "export",
                    copy,
                    spec={"from": str(src), "written": (src / "config.json").stat().st_mtime},
                    valid=lambda _, export=export: (export / "config.json").exists(),
                )
                records.append(self.evaluate(name, 0.0, seed, "test"))
            rows[name] = records
        return rows

    def main(self) -> dict:
        shared = self.shared()
        chosen, val = {}, {}
        for arm in self.args.arms:
            lrs = [BASE_LR * f for f in (LR_FACTORS[:1] if self.args.tiny else LR_FACTORS)]
            val[arm] = []
            for lr in lrs:
                self.fit(arm, lr, 0)
                val[arm].append(self.evaluate(arm, lr, 0, "val"))
            chosen[arm] = max(val[arm], key=lambda r: r["gold"])["lr"]
        test, fits = {}, {}
        for arm in self.args.arms:
            fits[arm] = [self.fit(arm, chosen[arm], s) for s in self.args.seeds]
            test[arm] = [self.evaluate(arm, chosen[arm], s, "test") for s in self.args.seeds]
        refs = self.reference_rows()
        return {"shared_s": shared, "chosen_lr": chosen, "val": val, "test": test, "refs": refs,
                "fits": {a: [{k: v for k, v in f.items() if k != "argv"} for f in fs] for a, fs in fits.items()}}  # fmt: skip


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def pm(values, digits=3) -> str:
    mean, std = mean_std(values)
    if mean is None:
        return ""
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def curves(fits: list[dict], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Rollout index, mean and std over seeds of ``key`` along the runs, and the mean seconds of training up to
    each point: the logged rollout and train times summed, less the teacher's scoring where the teacher is
    attached only to log the KL (``teacher_coef`` and ``jsd_coef`` 0: the GRPO arm)."""
    per_seed = []
    for f in fits:
        logging_only = ARMS[f["arm"]][2].get("teacher_coef") == 0.0 and not ARMS[f["arm"]][2].get("jsd_coef")
        points, clock = {}, 0.0
        for h in f["history"]:
            clock += float(h.get("time/rollout_s", 0.0)) + float(h.get("time/train_s", 0.0))
            clock -= float(h.get("time/teacher_logp_s", 0.0)) if logging_only else 0.0
            if key in h:
                points[int(h["rollout"])] = (float(h[key]), clock)
        per_seed.append(points)
    steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    means = [statistics.mean(p[s][0] for p in per_seed) for s in steps]
    stds = [statistics.stdev(p[s][0] for p in per_seed) if len(per_seed) > 1 else 0.0 for s in steps]
    clocks = [statistics.mean(p[s][1] for p in per_seed) for s in steps]
    return steps, means, stds, clocks


def report(result: dict, args, results: Path) -> None:
    """``distill.{md,json}`` and ``distill_curves.png`` (harness.write_results: command, machine, commit)."""
    rows = [("SFT (the student at the start)", result["refs"]["sft"], None, None),
            ("teacher: GRPO with the verifier, 60 rollouts", result["refs"]["teacher"], None, None)]  # fmt: skip
    for arm in args.arms:
        rows.append((ARMS[arm][0], result["test"][arm], result["chosen_lr"][arm], result["fits"][arm]))
    lines = [
        "# On-policy distillation vs GRPO on the simulated task\n",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}), {args.test_prompts} `prompts_test` prompts, "
        f"T = 1; learning rates chosen on {args.val_prompts} `prompts_val` prompts (seed 0); "
        f"{3 if args.tiny else args.rollouts} rollouts of 80 responses per run. "
        "Wall time is the `alignlit fit` process (validation every 10 rollouts on 100 prompts included); "
        "the machine was shared with other work, so times carry that noise (load at each start in the JSON).\n",
        "| policy | lr | gold reward | answer check pass rate | KL to SFT | KL to teacher | length | fit (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, records, lr, fits in rows:
        fit_s = pm([f["fit_s"] for f in fits], 0) if fits else ""
        lines.append(
            f"| {label} | {'' if lr is None else f'{lr:g}'} | {pm([r['gold'] for r in records])} | "
            f"{pm([r['pass_rate'] for r in records])} | {pm([r['kl_to_sft'] for r in records], 2)} | "
            f"{pm([r['kl_to_teacher'] for r in records], 2)} | {pm([r['length'] for r in records], 1)} | {fit_s} |"
        )
    lines += [
        "",
        "Validation (seed 0, learning rate grid):",
        "",
        "| arm | lr | val gold | val KL to teacher |",
        "|---|---:|---:|---:|",
    ]
    for arm in args.arms:
        for r in result["val"][arm]:
            lines.append(f"| {arm} | {r['lr']:g} | {r['gold']:.3f} | {r['kl_to_teacher']:.2f} |")
    write_results(
        "distill",
        result,
        table="\n".join(lines),
        plot={"distill_curves.png": lambda path: plot(result, args, path)},
        results_dir=results,
    )
    print("\n".join(lines))


def plot(result: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    for arm in args.arms:
        fits = result["fits"][arm]
        for ax, key, title in ((axes[0], "distill/reverse_kl", "reverse KL to the teacher (per token, training samples)"),
                               (axes[1], "reward/raw", "answer check pass rate (training samples)"),
                               (axes[2], "val/gold", "validation gold (100 prompts)")):  # fmt: skip
            steps, means, stds, _ = curves(fits, key)
            ax.plot(steps, means, label=ARMS[arm][0])
            ax.fill_between(
                steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], alpha=0.2
            )
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("rollout")
        steps, means, stds, clocks = curves(fits, "val/gold")
        axes[3].plot(clocks, means, marker="o", label=ARMS[arm][0])
        axes[3].set_title("validation gold against seconds of rollout + update", fontsize=9)
        axes[3].set_xlabel("seconds")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"on-policy distillation vs GRPO, mean ± std over {len(args.seeds)} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    p.add_argument(
        "--rollouts", type=int, default=60, help="rollouts of 80 responses per run (the teacher's too)"
    )
    p.add_argument("--teacher-seed", type=int, default=100)
    p.add_argument("--val-prompts", type=int, default=200)
    p.add_argument("--test-prompts", type=int, default=500)
    p.add_argument("--work", default=None, help="runs and cell results (default out/bench_distill[_tiny])")
    p.add_argument(
        "--results",
        default=None,
        help="where the table, JSON and plot go (default benchmarks/results, --tiny: the work dir)",
    )
    p.add_argument("--tiny", action="store_true", help="toy sizes: the whole pipeline in a few minutes")
    args = p.parse_args(argv)
    args.work = args.work or str(ROOT / "out" / ("bench_distill_tiny" if args.tiny else "bench_distill"))
    if args.tiny:
        args.val_prompts, args.test_prompts = min(args.val_prompts, 32), min(args.test_prompts, 32)
    results = (
        Path(args.results)
        if args.results
        else (Path(args.work) if args.tiny else ROOT / "benchmarks" / "results")
    )
    result = Bench(args).main()
    report(result, args, results)
    return result


if __name__ == "__main__":
    main()
