"""Multi-turn GRPO with the hint environment vs single-turn GRPO at equal generated tokens (simulated task).

Both arms start from one SFT policy that has seen second turns: ``--sft``, trained on the single-turn
demonstrations plus multi-turn ones (``alignlit sim make-multiturn-data``: a wrong first answer, its EOS, the
environment's hint, a demonstration of the right answer; ``configs/quickstart/sft-multiturn.yaml``). Arms
(reward = the episode's return, KL loss 0.04, the grpo-multiturn.yaml settings otherwise):

- ``multi``: :class:`alignlit.sim.SimHintEnvironment` with 2 attempts: a wrong first answer gets the hint
  (``--hint``, default ``copy <answer>``) and a second try; each hint costs ``--turn-cost``. Episode gold =
  g(x, final answer) - cost · (turns - 1).
- ``single``: the same environment with 1 attempt (the single-turn task; gold = g(x, y)), trained until it
  has generated as many model tokens as the ``multi`` run of the same seed and lr (equal generated tokens).

Protocol: each learning rate of ``--lrs`` is trained with the first seed and scored on ``--val-prompts``
prompts of prompts_val (each arm in its own setting); the best lr per arm is trained with every seed in
``--seeds`` and reported on ``--test-prompts`` prompts of prompts_test (T = 1, seed 0): final gold ± s.e.
across seeds, the paired multi − single difference per seed, turns per episode, first answers right,
hinted episodes, second answers right after a hint; as controls the SFT policies and the single-turn
policy evaluated inside the environment. Test prompts and gold never enter training or selection (a run's
policy is saved and evaluated on test only once its lr is chosen). Every run and evaluation is a cell under
``--out`` (:class:`Campaign`): a rerun reads back the finished ones with the same settings, so a campaign can be
split into chunks. Writes ``benchmarks/results/<name>.{md,json,png}``.

    python benchmarks/bench_multiturn.py --sim-dir data/sim --sft out/quickstart/sft-multiturn \\
        --sft-single out/quickstart/sft
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from pathlib import Path

import lightning as L
import torch

from alignlit.data import PromptDataModule
from alignlit.data.records import read_records
from alignlit.models import load_policy
from alignlit.modules import Minibatches, Optim, PolicyGradientModule
from alignlit.rollout import EpisodeReturn, HFEngine, RolloutLoop, SamplingParams, run_episodes
from alignlit.sim import SimEpisodeGold, SimHintEnvironment
from harness import Cells, write_results  # benchmarks/ is on sys.path when a script runs

RESULTS = Path(__file__).resolve().parent / "results"
STATS = ("gold", "turns", "first_right", "hinted", "second_right_after_hint", "model_tokens")


def environment(args, arm: str) -> SimHintEnvironment:
    attempts = 2 if arm == "multi" else 1
    return SimHintEnvironment(
        args.sim_dir,
        attempts=attempts,
        turn_cost=args.turn_cost,
        hint=args.hint,
        correctness=args.correctness,
    )


def limits(arm: str) -> dict[str, int]:
    return (
        {"max_turns": 2, "max_episode_tokens": 64}
        if arm == "multi"
        else {"max_turns": 1, "max_episode_tokens": 24}
    )


class TokenBudget(L.Callback):
    """Stops training once the run has generated ``budget`` model tokens (None: count only)."""

    def __init__(self, budget: int | None):
        self.budget, self.tokens, self.rollouts = budget, 0, 0
        self.turns: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        last = module.progress.history[-1]
        self.tokens += round(last["episode/model_tokens"] * last["rollout/samples"])
        self.rollouts += 1
        self.turns.append(last["episode/turns"])
        if self.budget is not None and self.tokens >= self.budget:
            trainer.should_stop = True


def train(args, arm: str, lr: float, seed: int, budget: int | None, out: Path) -> dict:
    L.seed_everything(seed, verbose=False)
    loop = RolloutLoop(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=24),
        samples_per_prompt=args.n,
        seed=seed,
        environment=environment(args, arm),
        **limits(arm),
    )
    module = PolicyGradientModule(
        policy=args.sft,
        reward=EpisodeReturn(),
        advantage="grpo",
        aggregation="seq_mean_token_mean",
        kl_loss_coef=0.04,
        kl_loss_estimator="k3",
        rollout=loop,
        minibatches=Minibatches(size=16, epochs=2),
        optim=Optim(lr=lr, min_lr_ratio=1.0),
        max_grad_norm=1.0,
    )
    counter = TokenBudget(budget)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=args.rollouts if budget is None else 10 * args.rollouts,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[counter],
        default_root_dir=out,
    )
    dm = PromptDataModule(
        train_file=f"{args.sim_dir}/prompts_train.jsonl", batch_size=args.batch, val_fraction=0.0
    )
    start = time.perf_counter()
    trainer.fit(module, dm)
    module.policy.save_pretrained(str(out / "policy"))
    module.tokenizer.save_pretrained(str(out / "policy"))
    return {
        "tokens": counter.tokens,
        "rollouts": counter.rollouts,
        "train_turns": counter.turns,
        "fit_s": time.perf_counter() - start,
        "budget": budget,
    }


@torch.no_grad()
def evaluate(args, policy_dir: str, prompts: list[str], arm: str) -> dict[str, float]:
    """One episode per prompt at T = 1 (seed 0) in the arm's environment: final gold and turn statistics."""
    policy, tokenizer = load_policy(policy_dir)
    policy.eval()
    env = environment(args, arm)
    engine = HFEngine(tokenizer, policy, micro_batch_size=100)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=0)
    rollout, stats = run_episodes(engine, tokenizer, env, prompts, 1, sampling, **limits(arm))
    gold = SimEpisodeGold(args.sim_dir, turn_cost=args.turn_cost, correctness=args.correctness)(
        prompts, rollout.texts
    )
    first_right, second_right, hinted = [], [], 0
    for prompt, turns in zip(prompts, stats.turn_texts):
        env.reset(prompt, seed=0)
        first_right.append(env.right(turns[0]))
        if len(turns) > 1:
            hinted += 1
            second_right.append(env.right(turns[1]))
    return {
        "gold": float(gold.mean()),
        "gold_se": float(gold.std() / math.sqrt(len(gold))),
        "turns": sum(stats.turns) / len(prompts),
        "tool_calls": sum(stats.tool_calls) / len(prompts),
        "first_right": sum(first_right) / len(prompts),
        "hinted": hinted / len(prompts),
        "second_right_after_hint": (sum(second_right) / len(second_right)) if second_right else float("nan"),
        "model_tokens": sum(stats.model_tokens) / len(prompts),
    }


def prompts_of(path: str, count: int) -> list[str]:
    return [r.fields["prompt"] for r in read_records(path)][:count]


def mean_se(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


class Campaign:
    """The campaign's cells, in ``Cells(--out)``: a cell whose spec (what it computes: the task and environment
    settings, the arm, lr, seed and token budget of a run, the policy and prompts of an evaluation) is unchanged is
    read back, so a stopped campaign resumes and a changed setting computes again.

    - ``train-<arm>-lr<lr>-s<seed>``: a training run (its policy in ``--out/<arm>-lr<lr>-s<seed>/policy``; run
      again when the policy is gone); the single-turn run's budget is the multi-turn run's tokens.
    - ``eval-<arm>-lr<lr>-s<seed>-<split>``: that policy's episodes on the ``val`` or ``test`` prompts in its own
      environment; ``...-test-in-multi``: the single-turn policy inside the multi-turn environment.
    - ``control-<sft|sft_single>-<arm>``: an SFT policy on the test prompts in the arm's environment.
    """

    def __init__(self, args, val: list[str], test: list[str]):
        self.args, self.out, self.cells = args, Path(args.out), Cells(args.out)
        self.prompts = {"val": val, "test": test}
        self.task = {k: getattr(args, k) for k in ("sim_dir", "hint", "turn_cost", "correctness")}

    def trained(self, arm: str, lr: float, seed: int) -> dict:
        args = self.args
        budget = None if arm == "multi" else self.trained("multi", lr, seed)["tokens"]
        folder = self.out / f"{arm}-lr{lr:g}-s{seed}"
        spec = {**self.task, "sft": args.sft, "rollouts": args.rollouts, "batch": args.batch, "n": args.n,
                "arm": arm, "lr": lr, "seed": seed, "budget": budget}  # fmt: skip
        done = self.cells.run(
            f"train-{folder.name}",
            lambda: train(args, arm, lr, seed, budget, folder),
            spec=spec,
            valid=lambda _: (folder / "policy" / "config.json").exists(),
        )
        return done | {"dir": str(folder)}

    def evaluated(self, key: str, policy: str, split: str, arm: str) -> dict:
        prompts = self.prompts[split]
        spec = {**self.task, "arm": arm, "policy": policy,
                "written": (Path(policy) / "config.json").stat().st_mtime,  # a retrained policy: again
                "prompts": {"split": split, "count": len(prompts),
                            "sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest()}}  # fmt: skip
        return self.cells.run(key, lambda: evaluate(self.args, policy, prompts, arm), spec=spec)

    def controls(self) -> dict:
        return {
            f"{name}_in_{arm}": self.evaluated(f"control-{name}-{arm}", path, "test", arm)
            for name, path in (("sft", self.args.sft), ("sft_single", self.args.sft_single))
            for arm in (("single", "multi") if path else ())
        }

    def select(self, arm: str) -> dict:
        """The lr of ``arm`` with the best validation gold (first seed)."""
        scores = {}
        for lr in self.args.lrs:
            info = self.trained(arm, lr, self.args.seeds[0])
            key = f"eval-{arm}-lr{lr:g}-s{self.args.seeds[0]}-val"
            scores[lr] = self.evaluated(key, f"{info['dir']}/policy", "val", arm)["gold"]
            print(
                f"selection {arm} lr={lr:g}: val gold {scores[lr]:.3f} (tokens {info['tokens']})", flush=True
            )
        chosen = max(scores, key=scores.get)
        return {"val_gold": {f"{k:g}": v for k, v in scores.items()}, "lr": chosen}

    def tested(self, arm: str, lr: float, seed: int) -> dict:
        info = self.trained(arm, lr, seed)
        policy, name = f"{info['dir']}/policy", f"eval-{arm}-lr{lr:g}-s{seed}-test"
        row = {"arm": arm, "seed": seed, "lr": lr, **info} | self.evaluated(name, policy, "test", arm)
        if arm == "single":  # the single-turn policy inside the environment (a control)
            row["in_environment"] = self.evaluated(f"{name}-in-multi", policy, "test", "multi")
        print({k: row[k] for k in ("arm", "seed", "lr", "tokens", "rollouts", "gold", "turns")}, flush=True)
        return row


def run_campaign(args, val: list[str], test: list[str], *, select_only: bool = False) -> dict:
    """The controls, the lr selection per arm, then every seed of each arm at its chosen lr: each a cell."""
    campaign = Campaign(args, val, test)
    report: dict = {"args": vars(args), "selection": {}, "runs": [], "controls": {}}
    report["controls"] = {} if select_only else campaign.controls()
    report["selection"] = {arm: campaign.select(arm) for arm in ("multi", "single")}
    if not select_only:
        lrs = {arm: report["selection"][arm]["lr"] for arm in ("multi", "single")}
        report["runs"] = [
            campaign.tested(arm, lrs[arm], s) for s in args.seeds for arm in ("multi", "single")
        ]
    return report


def summarise(args, report: dict, val: list[str], test: list[str]) -> str:
    multi = {r["seed"]: r for r in report["runs"] if r["arm"] == "multi"}
    single = {r["seed"]: r for r in report["runs"] if r["arm"] == "single"}
    lrs = {arm: report["selection"][arm]["lr"] for arm in ("multi", "single")}
    diff = mean_se([multi[s]["gold"] - single[s]["gold"] for s in multi])
    diff_env = mean_se([multi[s]["gold"] - single[s]["in_environment"]["gold"] for s in multi])
    report["summary"] = {
        "multi_minus_single": {"mean": diff[0], "se": diff[1]},
        "multi_minus_single_with_hints": {"mean": diff_env[0], "se": diff_env[1]},
    }
    lines = [
        f"Multi-turn vs single-turn GRPO at equal generated tokens: {len(args.seeds)} seeds, {len(test)} test "
        f"prompts (T = 1), hint `{args.hint}`, turn cost {args.turn_cost}, {args.correctness} correctness; {args.rollouts} rollouts of "
        f"{args.batch} prompts x {args.n} episodes for the multi-turn arm; lr chosen on {len(val)} validation "
        f"prompts (multi {lrs['multi']:g}, single {lrs['single']:g}). Both arms start from `{args.sft}`.",
        "",
        "| policy | evaluated | final gold | turns/episode | first answer right | hinted | right after hint "
        "| model tokens/episode | model tokens trained |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"sft": "SFT: both arms' start", "sft_single": "SFT: single-turn demos only"}
    for key, c in report["controls"].items():
        name, arm = key.rsplit("_in_", 1)
        where = "single-turn" if arm == "single" else "with hints"
        lines.append(
            f"| {names[name]} | {where} | {c['gold']:.3f} ± {c['gold_se']:.3f} (prompts) | {c['turns']:.2f} "
            f"| {c['first_right']:.3f} | {c['hinted']:.3f} | {c['second_right_after_hint']:.3f} "
            f"| {c['model_tokens']:.1f} | 0 |"
        )
    for arm, where, pick in (
        ("single", "single-turn", lambda r: r),
        ("single", "with hints", lambda r: r["in_environment"]),
        ("multi", "with hints", lambda r: r),
    ):
        rows = [r for r in report["runs"] if r["arm"] == arm]
        stats = {k: mean_se([pick(r)[k] for r in rows]) for k in STATS}
        tokens = mean_se([r["tokens"] for r in rows])[0]
        report["summary"][f"{arm}-trained, {where}"] = {k: v[0] for k, v in stats.items()} | {
            "gold_se_seeds": stats["gold"][1]
        }
        lines.append(
            f"| GRPO {arm}-turn | {where} | **{stats['gold'][0]:.3f} ± {stats['gold'][1]:.3f}** "
            f"| {stats['turns'][0]:.2f} | {stats['first_right'][0]:.3f} | {stats['hinted'][0]:.3f} "
            f"| {stats['second_right_after_hint'][0]:.3f} | {stats['model_tokens'][0]:.1f} | {tokens:.0f} |"
        )
    per_seed = ", ".join(f"{multi[s]['gold'] - single[s]['gold']:+.3f}" for s in sorted(multi))
    lines += [
        "",
        f"Paired by seed, multi-turn − single-turn final gold: {diff[0]:+.3f} ± {diff[1]:.3f} (s.e. over seeds; "
        f"per seed {per_seed}); multi-turn − single-turn policy evaluated with hints: {diff_env[0]:+.3f} ± "
        f"{diff_env[1]:.3f}.",
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, means, errs, colours = [], [], [], []
    for key, c in report["controls"].items():
        name, arm = key.rsplit("_in_", 1)
        start = "SFT (start)" if name == "sft" else "SFT, single-turn\ndemos only"
        labels.append(f"{start}\n{'single' if arm == 'single' else 'with hints'}")
        means.append(c["gold"]), errs.append(c["gold_se"]), colours.append("#bbb")
    for arm, where, pick, colour in (
        ("single", "single-turn", lambda r: r, "#6a9"),
        ("single", "with hints", lambda r: r["in_environment"], "#9c8"),
        ("multi", "with hints", lambda r: r, "#37a"),
    ):
        m, se = mean_se([pick(r)["gold"] for r in report["runs"] if r["arm"] == arm])
        labels.append(f"GRPO {arm}\n{where}"), means.append(m), colours.append(colour)
        errs.append(0 if math.isnan(se) else se)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(range(len(labels)), means, yerr=errs, capsize=4, color=colours)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("final gold on test prompts (T = 1)")
    ax.set_title("multi-turn (hints) vs single-turn GRPO at equal generated tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sim-dir", default="data/sim")
    parser.add_argument("--sft", default="out/quickstart/sft-multiturn", help="both arms start here")
    parser.add_argument("--sft-single", default=None, help="a single-turn SFT policy, evaluated as a control")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-4])
    parser.add_argument("--rollouts", type=int, default=12, help="rollouts of the multi-turn arm")
    parser.add_argument("--batch", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--n", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--hint", default="answer", choices=("answer", "length", "none"))
    parser.add_argument("--turn-cost", type=float, default=0.1)
    parser.add_argument(
        "--correctness", default="exact", choices=("exact", "partial"), help="how the final answer is scored"
    )
    parser.add_argument("--val-prompts", type=int, default=200)
    parser.add_argument("--test-prompts", type=int, default=200)
    parser.add_argument("--out", default="out/bench_multiturn")
    parser.add_argument("--name", default="multiturn")
    parser.add_argument("--select-only", action="store_true", help="stop after the lr selection")
    args = parser.parse_args()
    torch.set_num_threads(2)
    val = prompts_of(f"{args.sim_dir}/prompts_val.jsonl", args.val_prompts)
    test = prompts_of(f"{args.sim_dir}/prompts_test.jsonl", args.test_prompts)
    report = run_campaign(args, val, test, select_only=args.select_only)
    if args.select_only:
        return
    table = summarise(args, report, val, test)
    print(table)
    write_results(args.name, report, table=table, plot=lambda path: plot(report, path), results_dir=RESULTS)


if __name__ == "__main__":
    main()
