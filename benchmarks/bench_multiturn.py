"""Multi-turn GRPO with the hint environment vs single-turn GRPO at equal generated tokens (simulated task).

Arms (both GRPO from the quickstart SFT policy, reward = the episode's return, KL loss 0.04, the
grpo-multiturn.yaml settings otherwise):

- ``multi``: :class:`alignlit.sim.SimHintEnvironment` with 2 attempts: a wrong first answer gets the hint
  (``copy <answer>``) and a second try; each hint costs ``--turn-cost``. Episode gold =
  g(x, final answer) - cost · (turns - 1).
- ``single``: the same environment with 1 attempt (the single-turn task; gold = g(x, y)), trained until it
  has generated as many model tokens as the ``multi`` run of the same seed (equal generated tokens).

Protocol: each learning rate of ``--lrs`` is trained with the first seed and scored on ``--val-prompts``
prompts of prompts_val (each arm in its own setting); the best lr per arm is trained with every seed in
``--seeds`` and reported on ``--test-prompts`` prompts of prompts_test (T = 1, seed 0): final gold ±
s.e. across seeds, turns per episode, first answers right, hints used (second answers right after a
hint), and, as controls, the SFT policy and the single-turn policy evaluated inside the environment. The
test prompts and gold never enter training or selection. Writes ``benchmarks/results/multiturn.{md,json,png}``.

    python benchmarks/bench_multiturn.py --sim-dir data/sim --sft out/quickstart/sft
"""

from __future__ import annotations

import argparse
import json
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

RESULTS = Path(__file__).resolve().parent / "results"


def environment(args, arm: str) -> SimHintEnvironment:
    attempts = 2 if arm == "multi" else 1
    return SimHintEnvironment(args.sim_dir, attempts=attempts, turn_cost=args.turn_cost, hint="answer")


class TokenBudget(L.Callback):
    """Stops training once the run has generated ``budget`` model tokens (None: count only)."""

    def __init__(self, budget: int | None):
        self.budget, self.tokens, self.rollouts = budget, 0, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        last = module.history[-1]
        self.tokens += round(last["episode/model_tokens"] * last["rollout/samples"])
        self.rollouts += 1
        if self.budget is not None and self.tokens >= self.budget:
            trainer.should_stop = True


def train(args, arm: str, lr: float, seed: int, budget: int | None, out: Path):
    L.seed_everything(seed, verbose=False)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    loop = RolloutLoop(
        sampling=sampling,
        samples_per_prompt=args.n,
        seed=seed,
        environment=environment(args, arm),
        max_turns=2 if arm == "multi" else 1,
        max_episode_tokens=64 if arm == "multi" else 24,
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
    rollouts = args.rollouts if budget is None else 10 * args.rollouts
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=rollouts,
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
    return (
        module.policy,
        module.tokenizer,
        {
            "tokens": counter.tokens,
            "rollouts": counter.rollouts,
            "fit_s": time.perf_counter() - start,
            "budget": budget,
        },
    )


@torch.no_grad()
def evaluate(args, policy, tokenizer, prompts: list[str], arm: str) -> dict[str, float]:
    """One episode per prompt at T = 1 (seed 0) in the arm's environment: final gold and turn statistics."""
    env = environment(args, arm)
    engine = HFEngine(tokenizer, policy, micro_batch_size=100)
    rollout, stats = run_episodes(
        engine,
        tokenizer,
        env,
        prompts,
        1,
        SamplingParams(temperature=1.0, max_new_tokens=24, seed=0),
        max_turns=2 if arm == "multi" else 1,
        max_episode_tokens=64 if arm == "multi" else 24,
    )
    gold = SimEpisodeGold(args.sim_dir, turn_cost=args.turn_cost)(prompts, rollout.texts)
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
        "first_right": sum(first_right) / len(prompts),
        "hinted": hinted / len(prompts),
        "second_right_after_hint": (sum(second_right) / len(second_right)) if second_right else float("nan"),
        "model_tokens": sum(stats.model_tokens) / len(prompts),
    }


def prompts_of(path: str, count: int) -> list[str]:
    return [r.fields["prompt"] for r in read_records(path)][:count]


def mean_se(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sim-dir", default="data/sim")
    parser.add_argument("--sft", default="out/quickstart/sft")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lrs", type=float, nargs="+", default=[2e-5, 1e-4])
    parser.add_argument("--rollouts", type=int, default=12, help="rollouts of the multi-turn arm")
    parser.add_argument("--batch", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--n", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--turn-cost", type=float, default=0.1)
    parser.add_argument("--val-prompts", type=int, default=100)
    parser.add_argument("--test-prompts", type=int, default=200)
    parser.add_argument("--out", default="out/bench_multiturn")
    parser.add_argument("--name", default="multiturn")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    val = prompts_of(f"{args.sim_dir}/prompts_val.jsonl", args.val_prompts)
    test = prompts_of(f"{args.sim_dir}/prompts_test.jsonl", args.test_prompts)
    report: dict = {"args": vars(args), "selection": {}, "runs": [], "controls": {}}

    sft, tokenizer = load_policy(args.sft)
    sft.eval()
    for arm in ("multi", "single"):
        report["controls"][f"sft_in_{arm}"] = evaluate(args, sft, tokenizer, test, arm)

    chosen, budgets, trained = {}, {}, {}
    for arm in ("multi", "single"):  # selection on validation prompts, first seed
        scores = {}
        for lr in args.lrs:
            budget = budgets.get((args.seeds[0], lr)) if arm == "single" else None
            policy, tok, info = train(
                args, arm, lr, args.seeds[0], budget, out / f"{arm}-lr{lr}-s{args.seeds[0]}"
            )
            trained[(arm, lr, args.seeds[0])] = (policy, tok, info)
            if arm == "multi":
                budgets[(args.seeds[0], lr)] = info["tokens"]
            scores[lr] = evaluate(args, policy, tok, val, arm)["gold"]
            print(f"selection {arm} lr={lr}: val gold {scores[lr]:.3f} ({info})", flush=True)
        chosen[arm] = max(scores, key=scores.get)
        report["selection"][arm] = {"val_gold": {str(k): v for k, v in scores.items()}, "lr": chosen[arm]}

    def run(arm, seed, budget):  # the selection's first-seed run is reused
        key = (arm, chosen[arm], seed)
        if key in trained and trained[key][2]["budget"] == budget:
            return trained[key]
        return train(args, arm, chosen[arm], seed, budget, out / f"{arm}-s{seed}")

    for seed in args.seeds:
        multi_policy, tok, info = run("multi", seed, None)
        row = {"arm": "multi", "seed": seed, **info, **evaluate(args, multi_policy, tok, test, "multi")}
        report["runs"].append(row)
        print(row, flush=True)
        single_policy, tok, info = run("single", seed, row["tokens"])
        row = {"arm": "single", "seed": seed, **info, **evaluate(args, single_policy, tok, test, "single")}
        control = evaluate(args, single_policy, tok, test, "multi")
        row["in_environment"] = control
        report["runs"].append(row)
        print(row, flush=True)

    lines = [
        f"Multi-turn vs single-turn GRPO at equal generated tokens: {len(args.seeds)} seeds, {len(test)} test prompts "
        f"(T = 1), turn cost {args.turn_cost}; lr chosen on {len(val)} validation prompts "
        f"(multi {chosen['multi']:g}, single {chosen['single']:g}).",
        "",
        "| policy | evaluated | final gold | turns/episode | first answer right (symbols) | hinted | right after hint | model tokens trained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, key in (("SFT", "sft_in_single"), ("SFT", "sft_in_multi")):
        c = report["controls"][key]
        where = "single-turn" if key.endswith("single") else "with hints"
        lines.append(
            f"| {name} | {where} | {c['gold']:.3f} ± {c['gold_se']:.3f} (prompts) | {c['turns']:.2f} | {c['first_right']:.3f} "
            f"| {c['hinted']:.3f} | {c['second_right_after_hint']:.3f} | 0 |"
        )
    for arm, where, pick in (
        ("single", "single-turn", lambda r: r),
        ("single", "with hints", lambda r: r["in_environment"]),
        ("multi", "with hints", lambda r: r),
    ):
        rows = [r for r in report["runs"] if r["arm"] == arm]
        stats = {
            k: mean_se([pick(r)[k] for r in rows])
            for k in ("gold", "turns", "first_right", "hinted", "second_right_after_hint")
        }
        tokens = mean_se([r["tokens"] for r in rows])[0]
        report.setdefault("summary", {})[f"{arm}-trained, {where}"] = {k: v[0] for k, v in stats.items()}
        lines.append(
            f"| GRPO {arm}-turn | {where} | {stats['gold'][0]:.3f} ± {stats['gold'][1]:.3f} | {stats['turns'][0]:.2f} "
            f"| {stats['first_right'][0]:.3f} | {stats['hinted'][0]:.3f} | {stats['second_right_after_hint'][0]:.3f} "
            f"| {tokens:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(table + "\n")
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, means, errs = [], [], []
    for label in ("SFT\nsingle-turn", "SFT\nwith hints"):
        c = report["controls"]["sft_in_single" if "single" in label else "sft_in_multi"]
        labels.append(label), means.append(c["gold"]), errs.append(c["gold_se"])
    for arm, where, pick in (
        ("single", "single-turn", lambda r: r),
        ("single", "with hints", lambda r: r["in_environment"]),
        ("multi", "with hints", lambda r: r),
    ):
        m, se = mean_se([pick(r)["gold"] for r in report["runs"] if r["arm"] == arm])
        labels.append(f"GRPO {arm}\n{where}"), means.append(m), errs.append(0 if math.isnan(se) else se)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(labels)), means, yerr=errs, capsize=4, color=["#bbb", "#bbb", "#6a9", "#9c8", "#37a"])
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("final gold on test prompts (T = 1)")
    ax.set_title("multi-turn (hints) vs single-turn GRPO at equal generated tokens")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
