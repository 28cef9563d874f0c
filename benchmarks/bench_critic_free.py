"""Critic-free policy gradients vs PPO-max on the simulated task (the issue-13 comparison).

Arms, each a run of a shipped config through ``alignlit fit`` from the paper-scale SFT policy:

- ``grpo``: configs/paper/grpo.yaml (group-normalised advantages, sequence-mean-token-mean loss,
  k3 KL loss term);
- ``dr_grpo``: grpo.yaml with ``advantage: dr_grpo`` and the constant normaliser
  ``aggregation: seq_mean_token_sum_norm``;
- ``rloo``: configs/paper/rloo.yaml (leave-one-out baseline, KL in the reward, token mean);
- ``reinforce_pp_baseline``: grpo.yaml with ``advantage: reinforce_pp_baseline``, token mean;
- ``ppo-max``: configs/paper/ppo.yaml (critic, PPO-max + ChatGLM-RLHF).

Every arm samples the same number of responses: ``--responses-per-rollout`` per rollout (PPO: that
many prompts, one response each; the others: ``responses / n`` prompts, ``n`` responses each) for
``--rollouts`` rollouts, and trains on the same reward: the learned reward model (``rm``) and, as a
second column, the simulated gold reward itself (``gold``). Every arm keeps the SFT loss of ppo.yaml;
PPO-max also samples one reference response per new prompt from the SFT policy (its baseline reward).

Protocol: for each (arm, reward), each setting of the ``--grid`` is trained with the first seed and
scored by its last ``val/gold`` (held-out gold on ``--val-prompts`` prompts of prompts_val, logged by
the run); the best setting is then trained with every seed in ``--seeds`` and reported on
``--n-prompts`` prompts of prompts_test (T = 1, seed 0): gold ± s.e. (across seeds when there are
several, else over prompts), KL to the SFT policy, length, fit wall time. Prints a Markdown table and
writes ``benchmarks/results/<name>.{md,json,png}``. Finished runs are reused when their overrides
are unchanged (the JSON next to each run records them), so an interrupted benchmark continues.

Needs data/sim, out/paper/sft and out/paper/reward; ``--prepare`` creates the missing ones
with the paper-scale commands (``alignlit sim make-data --out data/sim``, ``alignlit fit --config
configs/paper/sft.yaml``, ``alignlit fit --config configs/quickstart/reward.yaml --config configs/paper/reward.yaml``).

    python benchmarks/bench_critic_free.py --prepare                        # full run (see README)
    python benchmarks/bench_critic_free.py --rewards rm --seeds 0 --grid    # one seed, no selection
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import config_args, fit_once, paper_stages, write_results
from harness import prepare as harness_prepare

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = "paper"  # the scale: config_args(name, CONFIGS) is the paper-scale stack of run `name`
ARMS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo.yaml", []),
    "dr_grpo": (
        "grpo.yaml",
        ["--model.init_args.advantage=dr_grpo", "--model.init_args.aggregation=seq_mean_token_sum_norm"],
    ),
    "rloo": ("rloo.yaml", []),
    "reinforce_pp_baseline": (
        "grpo.yaml",
        ["--model.init_args.advantage=reinforce_pp_baseline", "--model.init_args.aggregation=token_mean"],
    ),
    "ppo-max": ("ppo.yaml", []),
}
PANELS = (
    ("reward/raw", "training reward"),
    ("val/gold", "held-out gold (prompts_val)"),
    ("kl/ref", "KL(π‖π0) per response"),
    ("response/length", "response length (tokens)"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS), help="arms to run")
    p.add_argument(
        "--rewards", nargs="*", default=["rm", "gold"], choices=["rm", "gold"], help="training rewards"
    )
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2], help="seeds of the reported runs")
    p.add_argument(
        "--grid",
        nargs="*",
        default=["model.init_args.optim.lr=1.0e-5,2.0e-5,5.0e-5"],
        help="settings chosen on prompts_val: key=v1,v2,... (their product); none: the configs as shipped",
    )
    p.add_argument("--rollouts", type=int, default=100, help="rollouts per run (default: 100)")
    p.add_argument("--responses-per-rollout", type=int, default=50, help="sampled responses per rollout")
    p.add_argument("--n", type=int, default=5, help="responses per prompt of the critic-free arms")
    p.add_argument("--val-prompts", type=int, default=200, help="prompts_val prompts scored by the runs")
    p.add_argument("--n-prompts", type=int, default=500, help="prompts_test prompts of the report")
    p.add_argument("--sim", default="data/sim", help="`alignlit sim make-data` directory")
    p.add_argument("--sft", default="out/paper/sft", help="SFT policy: start point and KL reference")
    p.add_argument("--reward-model", default="out/paper/reward", help="the learned reward model")
    p.add_argument("--prepare", action="store_true", help="create missing --sim, --sft, --reward-model")
    p.add_argument("--prepare-steps", type=int, default=None, help="cap SFT/RM training steps (a smoke test)")
    p.add_argument("--out", default="out/bench_critic_free", help="working directory of the runs")
    p.add_argument("--results", default="benchmarks/results", help="where the table, JSON and PNG go")
    p.add_argument("--name", default="critic_free", help="file name of the table, JSON and PNG")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--set", nargs="*", default=[], help="extra CLI overrides for every run (key=value)")
    return p


def prepare(args) -> None:
    """The paper-scale shared stages (harness.paper_stages) for whichever of --sim, --sft, --reward-model
    is missing (with --prepare; else an error saying how to make them)."""
    sim, sft, rm = Path(args.sim), Path(args.sft), Path(args.reward_model)
    hint = (
        "run `python benchmarks/bench_critic_free.py --prepare` (or the paper-scale stages: "
        "`alignlit sim make-data --out data/sim`, `alignlit fit --config configs/quickstart/sft.yaml --config "
        "configs/paper/sft.yaml`, `alignlit fit --config configs/quickstart/reward.yaml --config "
        "configs/paper/reward.yaml`)"
    )
    stages = paper_stages(sim, sft, rm, Path(args.out) / "prepare", args.prepare_steps)
    harness_prepare(stages, make=args.prepare, hint=hint)


def settings(grid: list[str]) -> list[list[str]]:
    """The product of ``key=v1,v2`` lists as CLI overrides (one empty setting without a grid)."""
    axes = []
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise SystemExit(f"--grid {item!r}: expected key=v1,v2,...")
        axes.append([f"--{key.removeprefix('--')}={v}" for v in values.split(",")])
    return [list(combo) for combo in itertools.product(*axes)]


def tag(setting: list[str]) -> str:
    """A directory name for a setting: ``lr2.0e-5_coef0.1`` from its last key components and values."""
    parts = [(k.split(".")[-1], v) for k, _, v in (s.partition("=") for s in setting)]
    return "_".join(f"{k}{v}" for k, v in parts).replace("/", "-") or "default"


def run(arm: str, reward: str, setting: list[str], seed: int, args) -> dict:
    """Fit one arm through the CLI (or reuse a finished run with the same overrides)."""
    from alignlit.cli import main as alignlit_main

    config, arm_overrides = ARMS[arm]
    work = Path(args.out) / reward / arm / tag(setting) / f"seed{seed}"
    sim, responses = Path(args.sim), args.responses_per_rollout
    if arm == "ppo-max":
        shape = [f"--data.init_args.batch_size={responses}"]
    else:
        if responses % args.n:
            raise SystemExit(f"--responses-per-rollout {responses} is not a multiple of --n {args.n}")
        shape = [
            f"--data.init_args.batch_size={responses // args.n}",
            f"--model.init_args.rollout.samples_per_prompt={args.n}",
        ]
    scoring = (
        [
            "--model.init_args.reward.class_path=alignlit.sim.SimGoldReward",
            f"--model.init_args.reward.init_args.sim_dir={sim}",
        ]
        if reward == "gold"
        else [f"--model.init_args.reward={args.reward_model}"]
    )
    # the CLI reads an integer limit of 1 as the float 1.0, i.e. every batch: keep the limit >= 2
    eval_batch = min(50, max(1, args.val_prompts // 2))
    argv = [
        "fit", *config_args(config, CONFIGS), f"--seed_everything={seed}",
        f"--model.init_args.rollout.seed={seed}", f"--model.init_args.policy={args.sft}", *scoring,
        f"--model.init_args.ptx.file={sim / 'sft_train.jsonl'}", f"--model.init_args.ptx.val_file={sim / 'sft_val.jsonl'}",
        f"--model.init_args.gold.init_args.sim_dir={sim}", f"--model.init_args.export_dir={work / 'policy'}",
        f"--model.init_args.curves_file={work / 'curves.png'}", f"--data.init_args.train_file={sim / 'prompts_train.jsonl'}",
        f"--data.init_args.val_file={sim / 'prompts_val.jsonl'}", f"--data.init_args.eval_batch_size={eval_batch}",
        f"--trainer.limit_val_batches={max(1, args.val_prompts // eval_batch)}", "--trainer.max_epochs=1",
        f"--trainer.limit_train_batches={args.rollouts}", f"--trainer.val_check_interval={max(1, args.rollouts // 4)}",
        f"--trainer.logger.init_args.save_dir={work / 'logs'}", "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]", *shape, *arm_overrides, *setting,
        *[f"--{kv}" if not kv.startswith("--") else kv for kv in args.set],
    ]  # fmt: skip
    record = {"arm": arm, "reward": reward, "setting": setting, "seed": seed}
    done = fit_once(work, argv, record, run=alignlit_main)
    return {**done, "history": json.loads((work / "curves.json").read_text())}


def final_val_gold(history: list[dict]) -> float:
    values = [h["val/gold"] for h in history if "val/gold" in h]
    if not values:
        raise SystemExit("a run logged no val/gold: it needs `gold` and validation batches")
    return values[-1]


@torch.no_grad()
def evaluate(policy_dir: str, prompts: list[str], task, reference) -> dict:
    """Gold, KL to the SFT policy and length of ``policy_dir`` on the test prompts (T = 1, seed 0)."""
    from alignlit.eval.gold import evaluate_policy
    from alignlit.models import load_policy
    from alignlit.rollout import SamplingParams

    policy, tokenizer = load_policy(policy_dir)
    result = evaluate_policy(
        policy.eval(),
        tokenizer,
        prompts,
        task.gold_rewards,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=24, seed=0),
        reference=reference,
        batch_size=128,
    )
    return {
        "gold": result.gold,
        "gold_stderr": result.gold_stderr,
        "kl": result.kl_to_reference,
        "length": result.length,
    }


def summarise(evals: list[dict], fits: list[float]) -> dict:
    """Mean over seeds; the s.e. across seeds with several, else the s.e. over prompts of the one run."""
    golds = torch.tensor([e["gold"] for e in evals], dtype=torch.float64)
    stderr = float(golds.std() / math.sqrt(len(golds))) if len(golds) > 1 else evals[0]["gold_stderr"]
    mean = {k: sum(e[k] for e in evals) / len(evals) for k in ("gold", "kl", "length")}
    return {**mean, "gold_se": stderr, "seeds": len(evals), "fit_s": sum(fits) / len(fits) if fits else None}


def format_table(rows: dict[str, dict[str, dict]], rewards: list[str]) -> str:
    head = "| arm |" + "".join(f" gold ({r}) | ± s.e. | KL to SFT | length | fit (s) |" for r in rewards)
    lines = [head, "|---|" + "---:|" * 5 * len(rewards)]
    for arm, by_reward in rows.items():
        cells = []
        for r in rewards:
            s = by_reward.get(r)
            if s is None:
                cells.append(" | | | | |")
                continue
            fit = "" if s["fit_s"] is None else f"{s['fit_s']:.0f}"
            cells.append(
                f" {s['gold']:.3f} | {s['gold_se']:.3f} | {s['kl']:.3f} | {s['length']:.1f} | {fit} |"
            )
        lines.append(f"| {arm} |" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from alignlit.data import parse_prompt, read_records
    from alignlit.eval.plots import plot_curves
    from alignlit.models import load_policy
    from alignlit.sim import load_sim

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.seeds:
        raise SystemExit("--seeds needs at least one seed")
    if args.rollouts < 2 or args.val_prompts < 2:
        raise SystemExit("--rollouts and --val-prompts must be >= 2 (the CLI reads a limit of 1 as 100%)")
    prepare(args)
    task, _ = load_sim(args.sim)
    prompts = [parse_prompt(r) for r in read_records(Path(args.sim) / "prompts_test.jsonl")][: args.n_prompts]
    reference = load_policy(args.sft)[0].eval()
    sft = evaluate(args.sft, prompts, task, reference)
    rows: dict[str, dict[str, dict]] = {"sft": {r: summarise([sft], []) for r in args.rewards}}
    runs, histories = [], {}
    grid = settings(args.grid)
    for reward, arm in itertools.product(args.rewards, args.arms):
        sweep = [(s, run(arm, reward, s, args.seeds[0], args)) for s in grid]
        scores = [final_val_gold(r["history"]) for _, r in sweep]
        best, first = sweep[scores.index(max(scores))]
        chosen = [first] + [run(arm, reward, best, seed, args) for seed in args.seeds[1:]]
        evals = [evaluate(r["policy"], prompts, task, reference) for r in chosen]
        rows.setdefault(arm, {})[reward] = {
            **summarise(evals, [r["fit_s"] for r in chosen]),
            "setting": best,
            "val_gold_by_setting": {tag(s): v for (s, _), v in zip(sweep, scores)},
        }
        histories[f"{arm} ({reward})"] = first["history"]
        runs += [{k: v for k, v in r.items() if k != "history"} | {"test": e} for r, e in zip(chosen, evals)]
        print(format_table(rows, args.rewards), flush=True)

    table = format_table(rows, args.rewards)
    note = (
        f"\n{len(prompts)} prompts_test prompts, T = 1, seed 0; {args.rollouts} rollouts x "
        f"{args.responses_per_rollout} responses per run (critic-free arms: n = {args.n}); settings chosen on "
        f"{args.val_prompts} prompts_val prompts over {args.grid or 'nothing'}; seeds {args.seeds}; "
        f"RM = {args.reward_model}; KL to {args.sft}."
    )
    print("\n" + table + note)
    payload = {"rows": rows, "runs": runs, "args": vars(args), "histories": histories}
    draw = lambda path: plot_curves(histories, path, panels=PANELS, title="critic-free vs PPO-max")  # noqa: E731
    out = write_results(args.name, payload, table=table + "\n" + note, plot=draw, results_dir=args.results)
    print(f"wrote {', '.join(map(str, out.values()))}")
    return rows


if __name__ == "__main__":
    main()
