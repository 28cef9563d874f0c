"""Online iterative DPO and online RRHF vs their offline counterparts on the simulated task.

Arms, all from the paper-scale SFT policy against the paper-scale reward model (RM), on the same prompt
budget: ``--iterations`` x ``--prompts-per-iteration`` training prompts with ``--n`` samples each,
every sample scored once by the RM (the "preference labels"):

- ``online-dpo``: configs/paper/online-dpo.yaml, one iteration per training step (RLHF-Workflow §3);
- ``online-dpo-lp``: the same with the length penalty ``r - λ|y|`` (tokens), ``λ`` chosen on prompts_val
  from ``--lp-grid``;
- ``offline-dpo`` / ``offline-dpo-lp``: configs/paper/dpo.yaml on best-vs-worst pairs of ``--n``
  samples of the SFT policy for the same prompts (raw / with the chosen ``λ``), as many optimizer steps
  as the online run took;
- ``online-rrhf``: configs/paper/online-rrhf.yaml, ``--rrhf-resamples`` resamples of
  ``--rrhf-prompts`` prompts, ``--resample-every`` updates each (RRHF §5);
- ``offline-rrhf``: configs/paper/rrhf.yaml on the same SFT samples, as many steps as online RRHF;
- ``best-of-n``: the SFT policy's best of ``--n`` samples selected by the RM (no training).

Every policy is evaluated on ``--n-prompts`` prompts of prompts_test with ``--eval-samples`` samples per
prompt (T = 1, seed 0): gold reward (± s.e. over prompts), KL to the SFT policy, mean length (tokens),
the RM's per-prompt reward-length correlation (RLHF-Workflow Fig. 5), and the wall time of its
training (sampling and scoring included). Online DPO is also evaluated after every iteration (gold per
iteration, the curve). ``λ`` is chosen by the last ``val/gold`` each run logs on ``--val-prompts``
prompts of prompts_val. Prints a Markdown table and writes ``benchmarks/results/<name>.{md,json,png}``;
finished runs are reused when their command is unchanged (``harness.fit_once``), and the SFT samples of the
offline arms and every evaluation are cells under ``--out/cells`` (``harness.Cells``, read back while what
they read is unchanged), so an interrupted benchmark continues.

Needs data/sim, out/paper/sft and out/paper/reward; ``--prepare`` creates the missing ones with
the paper-scale commands (``alignlit sim make-data --out data/sim``, ``alignlit fit --config
configs/paper/sft.yaml``, ``alignlit fit --config configs/quickstart/reward.yaml --config configs/paper/reward.yaml``).

    python benchmarks/bench_online.py --prepare                     # the full benchmark
    python benchmarks/bench_online.py --arms online-dpo offline-dpo --lp-grid
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Cells, config_args, fit_once, paper_stages, write_results
from harness import prepare as harness_prepare

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = "paper"  # the scale: config_args(name, CONFIGS) is the paper-scale stack of run `name`
ARMS = (
    "online-dpo",
    "online-dpo-lp",
    "offline-dpo",
    "offline-dpo-lp",
    "online-rrhf",
    "offline-rrhf",
    "best-of-n",
)
PANELS = (
    ("val/gold", "gold during training (prompts_val)"),
    ("test/gold", "gold per iteration (prompts_test)"),
    ("test/length", "length per iteration (tokens)"),
    ("test/corr", "RM corr(reward, length) per iteration"),
    ("response/length", "training samples' length"),
    ("length/reward_corr", "training corr(reward, length)"),
)
SAMPLING = dict(temperature=1.0, max_new_tokens=24)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS, help="arms to run")
    p.add_argument("--iterations", type=int, default=3, help="online DPO iterations (default: 3)")
    p.add_argument("--prompts-per-iteration", type=int, default=1600, help="fresh prompts per iteration")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default: 4)")
    p.add_argument(
        "--lp-grid", nargs="*", type=float, default=[0.01, 0.03, 0.1], help="λ candidates (per token)"
    )
    p.add_argument("--rrhf-resamples", type=int, default=60, help="online RRHF resamples (default: 60)")
    p.add_argument("--rrhf-prompts", type=int, default=80, help="prompts per resample (default: 80)")
    p.add_argument("--resample-every", type=int, default=5, help="RRHF updates per resample (default: 5)")
    p.add_argument("--val-prompts", type=int, default=200, help="prompts_val prompts scored by the runs")
    p.add_argument("--n-prompts", type=int, default=500, help="prompts_test prompts of the report")
    p.add_argument("--eval-samples", type=int, default=4, help="samples per test prompt (default: 4)")
    p.add_argument("--sim", default="data/sim", help="`alignlit sim make-data` directory")
    p.add_argument("--sft", default="out/paper/sft", help="SFT policy: start point and KL reference")
    p.add_argument("--reward-model", default="out/paper/reward", help="the reward model")
    p.add_argument("--prepare", action="store_true", help="create missing --sim, --sft, --reward-model")
    p.add_argument("--prepare-steps", type=int, default=None, help="cap SFT/RM training steps (a smoke test)")
    p.add_argument("--out", default="out/bench_online", help="working directory of the runs")
    p.add_argument("--results", default="benchmarks/results", help="where the table, JSON and PNG go")
    p.add_argument("--name", default="online", help="file name of the table, JSON and PNG")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--set", nargs="*", default=[], help="extra CLI overrides for every fit (key=value)")
    return p


def prepare(args) -> None:
    """The paper-scale shared stages (harness.paper_stages) for whichever of --sim, --sft, --reward-model
    is missing (with --prepare; else an error saying how to make them)."""
    sim, sft, rm = Path(args.sim), Path(args.sft), Path(args.reward_model)
    hint = (
        "run `python benchmarks/bench_online.py --prepare` (or the paper-scale stages: "
        "`alignlit sim make-data --out data/sim`, `alignlit fit --config configs/quickstart/sft.yaml --config "
        "configs/paper/sft.yaml`, `alignlit fit --config configs/quickstart/reward.yaml --config "
        "configs/paper/reward.yaml`)"
    )
    stages = paper_stages(sim, sft, rm, Path(args.out) / "prepare", args.prepare_steps)
    harness_prepare(stages, make=args.prepare, hint=hint)


def fit(work: Path, argv: list[str], args, extra_s: float = 0.0) -> dict:
    """``alignlit fit`` with ``argv`` (or reuse a finished run with the same command); wall time in ``fit_s``."""
    from alignlit.cli import main as alignlit_main

    argv = ["fit", *argv, f"--model.init_args.export_dir={work / 'policy'}"]
    argv += [f"--{kv}" if not kv.startswith("--") else kv for kv in args.set]
    return fit_once(work, argv, extra_s=extra_s, run=alignlit_main)


def online_common(work: Path, args, config: str) -> list[str]:
    sim = Path(args.sim)
    eval_batch = min(50, max(1, args.val_prompts // 2))  # the CLI reads a limit of 1 as 100%: keep it >= 2
    return [
        *config_args(config, CONFIGS), "--seed_everything=0", f"--model.init_args.policy={args.sft}",
        f"--model.init_args.reward={args.reward_model}", f"--model.init_args.gold.init_args.sim_dir={sim}",
        f"--model.init_args.curves_file={work / 'curves.png'}", f"--data.init_args.train_file={sim / 'prompts_train.jsonl'}",
        f"--data.init_args.val_file={sim / 'prompts_val.jsonl'}", f"--data.init_args.eval_batch_size={eval_batch}",
        f"--trainer.limit_val_batches={max(2, args.val_prompts // eval_batch)}",
        f"--trainer.logger.init_args.save_dir={work / 'logs'}", f"--model.init_args.rollout.samples_per_prompt={args.n}",
    ]  # fmt: skip


def online_dpo(args, penalty: float) -> dict:
    work = Path(args.out) / ("online-dpo" if penalty == 0 else f"online-dpo-lp{penalty:g}")
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(work / "ckpt"), "every_n_train_steps": 1, "save_top_k": -1},
    }
    argv = [
        *online_common(work, args, "online-dpo.yaml"), f"--model.init_args.length_penalty={penalty}", f"--model.init_args.data_dir={work / 'data'}",
        f"--data.init_args.batch_size={args.prompts_per_iteration}", f"--trainer.limit_train_batches={args.iterations}",
        f"--trainer.callbacks=[{json.dumps(checkpoint)}]",
    ]  # fmt: skip
    done = fit(work, argv, args)
    history = json.loads((work / "curves.json").read_text())
    checkpoints = {}
    for path in (work / "ckpt").glob("*.ckpt"):
        saved = torch.load(path, weights_only=True)
        checkpoints[saved["online_dpo_state"]["rollout"]["rollouts"]] = (str(path), saved["global_step"])
    labels = sum(h["pairs/new"] for h in history if "pairs/new" in h)
    return {**done, "history": history, "checkpoints": checkpoints, "penalty": penalty, "pairs": labels}


def online_rrhf(args) -> dict:
    work = Path(args.out) / "online-rrhf"
    argv = [
        *online_common(work, args, "online-rrhf.yaml"), f"--data.init_args.batch_size={args.rrhf_prompts}", f"--trainer.limit_train_batches={args.rrhf_resamples}",
        f"--trainer.val_check_interval={max(1, args.rrhf_resamples // 4)}", f"--model.init_args.minibatches.steps={args.resample_every}",
        "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
    ]  # fmt: skip
    return {**fit(work, argv, args), "history": json.loads((work / "curves.json").read_text())}


def sft_samples(args, prompts: list[str]) -> tuple[list, float]:
    """``--n`` scored samples of the SFT policy per prompt (seed 0), written as ranked JSONL: the cell
    ``sft-samples``, read back for the same policy, reward model, ``--n`` and prompts."""
    from alignlit.data.pairs_from_rm import read_ranked, write_jsonl
    from alignlit.models import load_policy, load_reward_model
    from alignlit.rollout import SamplingParams
    from alignlit.rollout.sampling import sample_ranked

    out = Path(args.out) / "offline" / "ranked.jsonl"
    digest = hashlib.sha256("\0".join(prompts).encode()).hexdigest()
    spec = {"sft": args.sft, "rm": args.reward_model, "n": args.n, "sampling": SAMPLING, "prompts": digest}

    def sample() -> dict:
        start = time.perf_counter()
        policy, tokenizer = load_policy(args.sft)
        rm = load_reward_model(args.reward_model, batch_size=128)
        groups, _ = sample_ranked(
            policy.eval(), tokenizer, prompts, n=args.n, sampling=SamplingParams(**SAMPLING, seed=0),
            scorer=lambda p, r: rm.score(p, r).tolist(), batch_size=128,
        )  # fmt: skip
        write_jsonl([g.to_record() for g in groups], out)
        return {"seconds": time.perf_counter() - start, "groups": len(groups)}

    record = Cells(args.out).run("sft-samples", sample, spec, valid=lambda _: out.exists())
    return read_ranked(out), record["seconds"]


def offline_dpo(args, groups, sample_s: float, penalty: float, steps: int) -> dict:
    from alignlit.data.pairs_from_rm import best_worst_pairs, write_jsonl

    work = Path(args.out) / ("offline-dpo" if penalty == 0 else f"offline-dpo-lp{penalty:g}")
    pairs, _ = best_worst_pairs(groups, length_penalty=penalty)
    write_jsonl(pairs, work / "pairs.jsonl")
    argv = [
        *config_args("dpo.yaml", CONFIGS), "--seed_everything=0", f"--model.init_args.policy={args.sft}",
        f"--data.init_args.train_file={work / 'pairs.jsonl'}", f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={steps}", f"--trainer.logger.init_args.save_dir={work / 'logs'}",
    ]  # fmt: skip
    return {**fit(work, argv, args, extra_s=sample_s), "pairs": len(pairs), "penalty": penalty}


def offline_rrhf(args, sample_s: float, steps: int) -> dict:
    work = Path(args.out) / "offline-rrhf"
    argv = [
        *config_args("rrhf.yaml", CONFIGS), "--seed_everything=0", f"--model.init_args.policy={args.sft}",
        f"--data.init_args.train_file={Path(args.out) / 'offline' / 'ranked.jsonl'}", f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={steps}", f"--trainer.logger.init_args.save_dir={work / 'logs'}",
    ]  # fmt: skip
    return fit(work, argv, args, extra_s=sample_s)


class Evaluator:
    """Gold, KL to the SFT policy, length and the RM's reward-length correlation on fixed prompts; each
    evaluation a cell (:meth:`cell`) under ``--out``, the models loaded only when one is computed."""

    def __init__(self, args, prompts: list[str]):
        self.args, self.prompts = args, prompts
        self.cells = Cells(args.out)
        exported = {p: (Path(p) / "config.json").stat().st_mtime for p in (args.sft, args.reward_model)}
        self.spec = {"sim": args.sim, "sft": args.sft, "rm": args.reward_model, "exported": exported,
                     "prompts": len(prompts), "eval_samples": args.eval_samples, "sampling": SAMPLING}  # fmt: skip

    def cell(self, key: str, compute, **spec) -> dict:
        """``compute()``'s evaluation, read back while the prompts, models and ``spec`` are unchanged."""
        return self.cells.run(key, compute, {**self.spec, **spec})

    @functools.cached_property
    def task(self):
        from alignlit.sim import load_sim

        return load_sim(self.args.sim)[0]

    @functools.cached_property
    def sft(self) -> tuple:
        from alignlit.models import load_policy

        policy, tokenizer = load_policy(self.args.sft)
        return policy.eval(), tokenizer

    reference = property(lambda self: self.sft[0])
    tokenizer = property(lambda self: self.sft[1])

    @functools.cached_property
    def rm(self):
        from alignlit.models import load_reward_model

        return load_reward_model(self.args.reward_model, batch_size=128)

    def policy(self, path: str, checkpoint: str | None = None):
        from alignlit.models import load_policy

        policy = load_policy(path)[0]
        if checkpoint is not None:
            state = torch.load(checkpoint, weights_only=True)["state_dict"]
            policy.load_state_dict(
                {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}
            )
        return policy.eval()

    @torch.no_grad()
    def __call__(self, policy) -> dict:
        from alignlit.eval.gold import kl_to_reference
        from alignlit.modules.online_dpo import length_reward_correlation
        from alignlit.rollout import HFEngine, SamplingParams

        n = self.args.eval_samples
        rollout = HFEngine(self.tokenizer, policy, micro_batch_size=128).generate(
            self.prompts, n, SamplingParams(**SAMPLING, seed=0)
        )
        gold = torch.tensor(self.task.gold_rewards(rollout.prompts, rollout.texts), dtype=torch.float64)
        per_prompt = gold.view(-1, n).mean(-1)  # (B,)
        lengths = rollout.response_lengths.view(-1, n)
        corr, used, _ = length_reward_correlation(
            self.rm.score(rollout.prompts, rollout.texts).view(-1, n), lengths
        )
        return {
            "gold": float(per_prompt.mean()),
            "gold_se": float(per_prompt.std() / len(per_prompt) ** 0.5),
            "kl": float(kl_to_reference(rollout, self.reference, temperature=1.0).mean()),
            "length": float(lengths.float().mean()),
            "corr": corr if used else None,
        }

    def best_of_n(self) -> dict:
        from alignlit.eval.gold import best_of_n
        from alignlit.rollout import SamplingParams

        result = best_of_n(
            self.reference, self.tokenizer, self.prompts, self.task.gold_rewards, n=self.args.n,
            sampling=SamplingParams(**SAMPLING, seed=0), select_fn=lambda p, r: self.rm.score(p, r).tolist(),
            batch_size=128,
        )  # fmt: skip
        return {"gold": result.gold, "gold_se": result.gold_stderr, "kl": result.kl_to_reference,
                "length": result.length, "corr": None}  # fmt: skip


def last_val_gold(history: list[dict]) -> float:
    values = [h["val/gold"] for h in history if "val/gold" in h]
    if not values:
        raise SystemExit("a run logged no val/gold: it needs `gold` and validation batches")
    return values[-1]


def format_table(rows: dict[str, dict]) -> str:
    lines = [
        "| arm | setting | pairs | gold | ± s.e. | KL to SFT | length | corr(RM, length) | wall (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, r in rows.items():
        corr = "" if r.get("corr") is None else f"{r['corr']:.3f}"
        kl = "" if r.get("kl") is None else f"{r['kl']:.3f}"
        wall = "" if r.get("fit_s") is None else f"{r['fit_s']:.0f}"
        lines.append(
            f"| {arm} | {r.get('setting', '')} | {r.get('pairs', '')} | {r['gold']:.3f} | {r['gold_se']:.3f} | "
            f"{kl} | {r['length']:.1f} | {corr} | {wall} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from alignlit.data import parse_prompt, read_ranked, read_records
    from alignlit.eval.plots import plot_curves

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if min(args.iterations, args.rrhf_resamples, args.val_prompts) < 2:
        raise SystemExit(
            "--iterations, --rrhf-resamples and --val-prompts must be >= 2 (a limit of 1 reads as 100%)"
        )
    prepare(args)
    test = [parse_prompt(r) for r in read_records(Path(args.sim) / "prompts_test.jsonl")][: args.n_prompts]
    evaluate = Evaluator(args, test)
    sft = evaluate.cell("eval-sft", lambda: evaluate(evaluate.reference))
    rows: dict[str, dict] = {"sft": {**sft, "setting": "", "fit_s": None}}
    curves: dict[str, list[dict]] = {}
    runs: dict[str, dict] = {}
    if "best-of-n" in args.arms:
        rows[f"best-of-{args.n} (RM)"] = evaluate.cell("eval-best-of-n", evaluate.best_of_n, n=args.n)

    def report(arm: str, run: dict, setting: str = "") -> None:
        at = (Path(run["policy"]) / "config.json").stat().st_mtime  # a policy exported again: evaluated again
        result = evaluate.cell(
            f"eval-{arm}", lambda: evaluate(evaluate.policy(run["policy"])), trained=run["argv"], at=at
        )
        rows[arm] = {**result, "setting": setting, "fit_s": run["fit_s"]}
        rows[arm]["pairs"] = int(run["pairs"]) if "pairs" in run else ""
        runs[arm] = {k: v for k, v in run.items() if k != "history"}
        print(format_table(rows), flush=True)

    def per_iteration(arm: str, run: dict) -> None:
        curve = [{"rollout": 0.0, **{f"test/{k}": v for k, v in sft.items() if v is not None}}]
        for t, (path, _) in sorted(run["checkpoints"].items()):
            result = evaluate.cell(
                f"eval-{arm}-rollout{int(t)}", lambda p=path: evaluate(evaluate.policy(args.sft, p)),
                trained=run["argv"], checkpoint=path, at=Path(path).stat().st_mtime,
            )  # fmt: skip
            curve.append(
                {"rollout": float(t), **{f"test/{k}": v for k, v in result.items() if v is not None}}
            )
        curves[arm] = curve + run["history"]
        runs[arm] = {**runs.get(arm, {}), "per_iteration": curve}

    online, chosen = None, None
    if {"online-dpo", "offline-dpo", "offline-dpo-lp", "offline-rrhf"} & set(args.arms):
        online = online_dpo(args, 0.0)
        report("online-dpo", online)
        per_iteration("online-dpo", online)
    if {"online-dpo-lp", "offline-dpo-lp"} & set(args.arms) and args.lp_grid:
        sweep = [online_dpo(args, lam) for lam in args.lp_grid]
        scores = [last_val_gold(r["history"]) for r in sweep]
        chosen = sweep[scores.index(max(scores))]
        tried = ", ".join(f"{lam:g}: {v:.3f}" for lam, v in zip(args.lp_grid, scores))
        report("online-dpo-lp", chosen, f"λ={chosen['penalty']:g} (val gold {tried})")
        per_iteration("online-dpo-lp", chosen)
    if online is not None and {"offline-dpo", "offline-dpo-lp", "offline-rrhf"} & set(args.arms):
        data = Path(args.out) / "online-dpo" / "data"
        prompts = [g.prompt for path in sorted(data.glob("iter_*.ranked.jsonl")) for g in read_ranked(path)]
        groups, sample_s = sft_samples(args, prompts)
        steps = max(step for _, step in online["checkpoints"].values())
        if "offline-dpo" in args.arms:
            report("offline-dpo", offline_dpo(args, groups, sample_s, 0.0, steps))
        if "offline-dpo-lp" in args.arms and chosen is not None:
            run = offline_dpo(args, groups, sample_s, chosen["penalty"], steps)
            report("offline-dpo-lp", run, f"λ={chosen['penalty']:g}")
    if {"online-rrhf", "offline-rrhf"} & set(args.arms):
        rrhf = online_rrhf(args)
        report("online-rrhf", rrhf)
        curves["online-rrhf"] = rrhf["history"]
        if "offline-rrhf" in args.arms and online is not None:
            report("offline-rrhf", offline_rrhf(args, sample_s, args.rrhf_resamples * args.resample_every))

    table = format_table(rows)
    note = (
        f"\n{len(test)} prompts_test prompts x {args.eval_samples} samples, T = 1, seed 0 (s.e. over prompts); "
        f"online DPO: {args.iterations} iterations x {args.prompts_per_iteration} prompts x n = {args.n}; "
        f"online RRHF: {args.rrhf_resamples} resamples x {args.rrhf_prompts} prompts, {args.resample_every} updates "
        f"each; offline arms: n = {args.n} SFT samples of online DPO's prompts, as many updates as the online run; "
        f"λ chosen on {args.val_prompts} prompts_val prompts; RM = {args.reward_model}; KL to {args.sft}; "
        "wall time includes sampling and scoring."
    )
    print("\n" + table + note)
    payload = {"rows": rows, "runs": runs, "args": vars(args), "curves": curves}
    draw = lambda path: plot_curves(curves, path, panels=PANELS, title="online vs offline (paper scale)")  # noqa: E731
    out = write_results(
        args.name, payload, table=table + "\n" + note, plot=draw if curves else None, results_dir=args.results
    )
    print(f"wrote {', '.join(map(str, out.values()))}")
    return rows


if __name__ == "__main__":
    main()
