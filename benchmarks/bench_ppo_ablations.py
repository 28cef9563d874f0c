"""PPO ablations on the simulated task, at paper scale (configs/paper) (the PPO-max and ChatGLM-RLHF comparisons).

Arms, each a run of the shipped config through ``alignlit fit`` with the overrides below, from the
paper-scale SFT policy against the same reward model:

- ``ppo-max``: configs/paper/ppo.yaml (reward normalisation + clipping, token KL penalty, value
  clipping, critic pre-training, reference-baseline reward, SFT loss);
- ``vanilla``: configs/paper/ppo-vanilla.yaml (none of those);
- ``no-ref-baseline``: ppo-max without the reference-baseline reward (ChatGLM eq. 5);
- ``no-sft-loss``: ppo-max without the SFT loss (ChatGLM eq. 6).

Every exported policy is then evaluated like ``bench_quality.py`` (the same 500 held-out test
prompts, T = 1, seed 0): gold reward, KL to the SFT policy, response length; plus greedy gold and
the NLL on the SFT validation demonstrations (capability retention). Stability columns come from the
training curves: the largest KL(π‖π0) and response length seen during training. Prints a Markdown
table, writes ``benchmarks/results/ppo_ablations.{json,md}`` and overlays the arms' training curves
in ``benchmarks/results/ppo_ablations.png`` (``--name`` changes the file name).

The benchmark is a list of cells (benchmarks/harness/): one training cell per arm (reused when
its cell ``<out>/<arm>/cells/fit.json`` holds the same command and the export is complete) and one evaluation cell
per policy (cached under ``<out>/cells/`` with the policy's training command), so a stopped run resumes.

    python benchmarks/bench_ppo_ablations.py                         # RM: out/paper/reward
    python benchmarks/bench_ppo_ablations.py --reward-model gold --name ppo_ablations_gold  # oracle RM
    python benchmarks/bench_ppo_ablations.py --arms ppo-max vanilla --rollouts 40
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Cells, command_line, config_args, fit_once, write_results

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = "paper"  # the scale: config_args(name, CONFIGS) is the paper-scale stack of run `name`
ARMS: dict[str, tuple[str, list[str]]] = {
    "ppo-max": ("ppo.yaml", []),
    "vanilla": ("ppo-vanilla.yaml", []),
    "no-ref-baseline": ("ppo.yaml", ["--model.init_args.reference_baseline=false"]),
    "no-sft-loss": ("ppo.yaml", ["--model.init_args.ptx.coef=0.0"]),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS), help="arms to run")
    p.add_argument("--sim", default="data/sim", help="`alignlit sim make-data` directory")
    p.add_argument("--sft", default="out/paper/sft", help="SFT policy: start point and KL reference")
    p.add_argument(
        "--reward-model",
        default="out/paper/reward",
        help="reward-model directory, or 'gold' to train on the simulated gold reward (oracle)",
    )
    p.add_argument("--rollouts", type=int, default=100, help="rollouts per arm (default: 100)")
    p.add_argument("--out", default="out/bench_ppo", help="working directory of the runs")
    p.add_argument("--results", default="benchmarks/results", help="where the table, JSON and PNG go")
    p.add_argument("--name", default="ppo_ablations", help="file name of the table, JSON and PNG")
    p.add_argument("--n-prompts", type=int, default=500, help="held-out test prompts (default: 500)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--set", nargs="*", default=[], help="extra CLI overrides for every arm (key=value)")
    return p


def run_arm(name: str, args) -> dict:
    """The arm's training cell (harness.fit_once): fit it through the CLI unless the same run finished;
    returns its export directory, command, training history and wall time."""
    from alignlit.cli import main as alignlit_main

    config, overrides = ARMS[name]
    work = Path(args.out) / name
    reward = (
        [
            "--model.init_args.reward.class_path=alignlit.sim.SimGoldReward",
            f"--model.init_args.reward.init_args.sim_dir={args.sim}",
        ]
        if args.reward_model == "gold"
        else [f"--model.init_args.reward={args.reward_model}"]
    )
    argv = [
        "fit",
        *config_args(config, CONFIGS),
        f"--model.init_args.policy={args.sft}",
        *reward,
        f"--model.init_args.export_dir={work / 'policy'}",
        f"--model.init_args.curves_file={work / 'curves.png'}",
        f"--trainer.limit_train_batches={args.rollouts}",
        "--trainer.max_epochs=1",
        f"--trainer.val_check_interval={max(1, args.rollouts // 4)}",
        f"--trainer.logger.init_args.save_dir={work / 'logs'}",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]",
        *overrides,
        *[f"--{kv}" if not kv.startswith("--") else kv for kv in args.set],
    ]
    done = fit_once(work, argv, {"arm": name}, run=alignlit_main)
    return {**done, "history": json.loads((work / "curves.json").read_text())}


@torch.no_grad()
def sft_val_nll(policy, tokenizer, sim: str) -> float:
    """Token-mean NLL of the policy on the SFT validation demonstrations (capability retention),
    encoded as the SFT stage encodes them (48 tokens, prompts up to 24)."""
    from alignlit.data import Truncation, collate_lm, parse_prompt_response, read_records
    from alignlit.losses import masked_nll, shift_for_next_token

    trunc = Truncation(tokenizer, max_length=48, max_prompt_length=24)
    records = read_records(Path(sim) / "sft_val.jsonl")
    data = [e for e in (trunc.encode(*parse_prompt_response(r), r.source) for r in records) if e is not None]
    total, tokens = 0.0, 0
    for start in range(0, len(data), 128):
        batch = collate_lm(data[start : start + 128], pad_id=tokenizer.pad_token_id)
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        loss, metrics = masked_nll(*shift_for_next_token(logits, batch.input_ids, batch.loss_mask))
        total += float(loss) * int(metrics["tokens"])
        tokens += int(metrics["tokens"])
    return total / tokens


def evaluate(name: str, policy_dir: str, args, prompts, task, reference) -> dict:
    from alignlit.eval.gold import evaluate_policy
    from alignlit.models import load_policy
    from alignlit.rollout import SamplingParams

    policy, tokenizer = load_policy(policy_dir)
    policy.eval()
    sampled = evaluate_policy(
        policy,
        tokenizer,
        prompts,
        task.gold_rewards,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=24, seed=0),
        reference=reference,
        name=name,
        batch_size=128,
    )
    greedy = evaluate_policy(
        policy,
        tokenizer,
        prompts,
        task.gold_rewards,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=24),
        name=name,
        batch_size=128,
    )
    return {
        "gold": sampled.gold,
        "gold_stderr": sampled.gold_stderr,
        "gold_greedy": greedy.gold,
        "kl_to_sft": sampled.kl_to_reference,
        "length": sampled.length,
        "sft_val_nll": sft_val_nll(policy, tokenizer, args.sim),
    }


def stability(history: list[dict]) -> dict:
    train = [h for h in history if "reward/raw" in h]
    last = train[-10:]
    return {
        "max_kl_train": max(h["kl/ref"] for h in train),
        "final_kl_train": sum(h["kl/ref"] for h in last) / len(last),
        "max_length_train": max(h["response/length"] for h in train),
        "final_reward_train": sum(h["reward/raw"] for h in last) / len(last),
        "val_gold": [(h["rollout"], h["val/gold"]) for h in history if "val/gold" in h],
    }


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| arm | gold (T=1) | ± s.e. | gold (greedy) | KL to SFT | length | SFT val NLL | RM reward (last 10) "
        "| max KL in training | fit (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kl = "" if r.get("kl_to_sft") is None else f"{r['kl_to_sft']:.3f}"
        train = (
            f"{r['final_reward_train']:.3f} | {r['max_kl_train']:.2f} | {r['fit_s']:.0f}"
            if "fit_s" in r
            else " |  | "
        )
        lines.append(
            f"| {r['arm']} | {r['gold']:.3f} | {r['gold_stderr']:.3f} | {r['gold_greedy']:.3f} | {kl} | "
            f"{r['length']:.1f} | {r['sft_val_nll']:.3f} | {train} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    from alignlit.data import parse_prompt, read_records
    from alignlit.eval.plots import PPO_PANELS, plot_curves
    from alignlit.models import load_policy
    from alignlit.sim import load_sim

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    task, _ = load_sim(args.sim)
    prompts = [parse_prompt(r) for r in read_records(Path(args.sim) / "prompts_test.jsonl")][: args.n_prompts]
    reference = load_policy(args.sft)[0].eval()

    cells = Cells(args.out)
    spec = {"prompts": len(prompts), "sim": args.sim, "reference": args.sft}

    def evaluation(name: str, policy: str, trained) -> dict:
        """An evaluation cell: cached for this policy, its training command and the test prompts."""
        compute = lambda: evaluate(name, policy, args, prompts, task, reference)  # noqa: E731
        exported = (
            (Path(policy) / "config.json").stat().st_mtime
        )  # a policy exported again is evaluated again
        return cells.run(
            f"eval-{name}", compute, {**spec, "policy": policy, "trained": trained, "at": exported}
        )

    rows = [{"arm": "sft", **evaluation("sft", args.sft, None)}]
    histories = {}
    for name in args.arms:
        run = run_arm(name, args)
        histories[name] = run["history"]
        row = {"arm": name, **evaluation(name, run["policy"], run["argv"])}
        row.update(stability(run["history"]), fit_s=run["fit_s"])
        rows.append(row)
        print(format_rows(rows), flush=True)

    table = format_rows(rows)
    note = (
        f"\n{len(prompts)} test prompts, T=1 seed 0 (greedy too); reward: {args.reward_model}; "
        f"{args.rollouts} rollouts per arm; KL to {args.sft}."
    )
    print("\n" + table + note)
    data = {"rows": rows, "reward_model": args.reward_model, "rollouts": args.rollouts, "prompts": len(prompts),
            "histories": histories, "overrides": args.set}  # fmt: skip
    title = f"PPO ablations ({args.rollouts} rollouts, reward: {Path(args.reward_model).name})"
    out = write_results(
        args.name, data, command=command_line([__file__, *(sys.argv[1:] if argv is None else argv)]),
        table=table + "\n" + note, plot=lambda path: plot_curves(histories, path, panels=PPO_PANELS, title=title),
        results_dir=args.results,
    )  # fmt: skip
    print(f"wrote {', '.join(map(str, out.values()))}")
    return rows


if __name__ == "__main__":
    main()
