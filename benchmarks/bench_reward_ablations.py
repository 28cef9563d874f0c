"""Reward-model ablations on the simulated task: accuracy against the gold reward.

Rows (``ROWS``), each one ``alignlit fit`` command from the shared SFT policy (or an ensemble of such
fits), trained with every seed of ``--seeds``:

- ``bt``: the Bradley-Terry reward model as configured (``reward.yaml``: 120 steps of 32 of the 10,000
  annotator pairs, length balancing on);
- ``bt-no-balance``: the same without length balancing (ChatGLM-RLHF §3.3; the annotators prefer the
  longer answer, so an unbalanced reward model learns length);
- ``bt-l2``: with the score regulariser ``λ_reg·(r_w² + r_l²)`` (ChatGLM-RLHF eq. 2), λ_reg = 0.01;
- ``bt-lm``: with the LM-imitation loss on the chosen response (PPO-max §4), β_lm = 0.1;
- ``pairpref``: the pairwise preference model (``pairpref.yaml``; RLHF-Workflow §2.2);
- ``length-head``: ``reward.yaml`` with a length head that absorbs the annotators' length bias and is
  dropped at use (ODIN-style; ``--model.init_args.length_head=...``, ``RewardModule(length_head=...)``);
- ``scratch``: ``reward.yaml`` from a random initialisation of the SFT policy's architecture instead of
  the SFT policy (what initialising from the SFT policy buys);
- ``more-pairs``: ``reward.yaml`` for one epoch over ``--extra-pairs`` fresh annotator pairs on unused
  training prompts (``alignlit sim make-pairs``); ``more-pairs-length-head``: with the length head;
- ``onpolicy``: one epoch over annotator-labelled pairs of the SFT policy's own samples (2 pairs of its 4
  samples per online training prompt; ``alignlit sample`` + ``alignlit sim label-samples``;
  RLHF-Workflow labels the policy's samples);
- ``ensemble-mean`` / ``ensemble-lcb``: ``RewardEnsemble`` of ``--members`` ``bt`` fits (their own
  seeds), combined by the mean / the lower confidence bound mean − 1·std of the standardised members;
  ``ensemble-more-pairs``: the mean of ``more-pairs`` fits;
- ``gold-labels`` (reference, not a method): ``reward.yaml`` trained on ``pairs_gold_train.jsonl``, the
  same demonstration pairs ordered by the noise-free gold reward: what this RM size reaches with perfect
  labels at the quickstart's 120 steps.

The regulariser weights are single untuned values (the ablation asks whether the term helps at a
common setting), not chosen on any evaluation data.

Columns: accuracy against gold on ``pairs_gold_val.jsonl`` (the annotator distribution's pairs with
noise-free gold labels; what the stages log as ``val/accuracy``), accuracy against gold on pairs of the
SFT policy's own samples (2 per ``prompts_test`` prompt, labelled by gold, ties dropped: the pairs a
reward model judges during RLHF; used for this report only), the reward/length Pearson correlation on
the gold pairs, wall time of the fit (an ensemble: its members'); mean ± std over seeds. Writes
``<results>/reward_ablations.{json,md}``. Every shared stage, fit and (row, seed) evaluation is a cell
under ``--work/cells`` (``harness.Cells``); a rerun reads back the cells whose command, config and shared
stages are unchanged.

    python benchmarks/bench_reward_ablations.py --configs configs/quickstart   # seeds 0 1 2
    python benchmarks/bench_reward_ablations.py --plan        # the planned cells and the ETA
    python benchmarks/bench_reward_ablations.py --tiny        # end-to-end check at toy size
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import (
    Cells,
    command_line,
    config_sha256,
    config_stack,
    fmt_s,
    get_key,
    mean_std,
    pm,
    read_config,
    run_alignlit,
    write_results,
)
from harness.quality import ROOT, TINY_DATA, fit_command, out_prefix, stage_cells


@dataclass(frozen=True)
class Row:
    """One row: ``alignlit fit --config <configs>/<config> <extra>``, or (``members``) an ensemble of
    ``n_members`` fits of the row ``members`` combined by ``combine``; ``reference``: trained on gold
    labels (a ceiling, not a method)."""

    label: str
    config: str = "reward.yaml"
    extra: tuple[str, ...] = ()
    members: str | None = None
    combine: str = "mean"
    reference: bool = False


SCRATCH = "--model.init_args.model=out/rm_init/scratch"
LENGTH_HEAD = '--model.init_args.length_head={"lr": 0.02, "decorrelation": 1.0}'
EPOCH = "--trainer.limit_train_batches=1.0"  # the whole pair file once, not 120 steps
MORE = "--data.init_args.train_file=data/sim/pairs_extra_train.jsonl"
ONPOLICY = "--data.init_args.train_file=data/sim/pairs_onpolicy_train.jsonl"
NO_BALANCE = "--data.init_args.length_balance=false"

ROWS: dict[str, Row] = {
    "bt": Row("Bradley-Terry RM, length balancing on"),
    "bt-no-balance": Row(
        "Bradley-Terry RM, length balancing off", extra=("--data.init_args.length_balance=false",)
    ),
    "bt-l2": Row(
        "Bradley-Terry RM + score regulariser (λ_reg = 0.01)", extra=("--model.init_args.l2_weight=0.01",)
    ),
    "bt-lm": Row("Bradley-Terry RM + LM imitation (β_lm = 0.1)", extra=("--model.init_args.lm_weight=0.1",)),
    "pairpref": Row("pairwise preference model", "pairpref.yaml"),
    "length-head": Row("+ length head (ODIN-style, λ_ρ = 1), dropped at use", extra=(LENGTH_HEAD,)),
    "scratch": Row("from a random init of the same architecture (not the SFT policy)", extra=(SCRATCH,)),
    "more-pairs": Row("40k fresh annotator pairs, 1 epoch", extra=(MORE, EPOCH)),
    "more-pairs-length-head": Row("40k annotator pairs + length head", extra=(MORE, EPOCH, LENGTH_HEAD)),
    "onpolicy": Row("annotator pairs of SFT samples (on-policy), 1 epoch", extra=(ONPOLICY, EPOCH)),
    "onpolicy-no-balance": Row(
        "on-policy pairs, 1 epoch, length balancing off", extra=(ONPOLICY, EPOCH, NO_BALANCE)
    ),
    "onpolicy-3-epochs": Row("on-policy pairs, 3 epochs", extra=(ONPOLICY, EPOCH, "--trainer.max_epochs=3")),
    "ensemble-mean": Row("ensemble of 3 Bradley-Terry RMs, mean", members="bt", combine="mean"),
    "ensemble-lcb": Row("ensemble of 3 Bradley-Terry RMs, mean − std", members="bt", combine="lcb"),
    "ensemble-more-pairs": Row(
        "ensemble of 3 RMs on 40k annotator pairs, mean", members="more-pairs", combine="mean"
    ),
    "gold-labels": Row(
        "reference: gold-labelled pairs (not a method)",
        extra=("--data.init_args.train_file=data/sim/pairs_gold_train.jsonl",),
        reference=True,
    ),
}

# Rough wall times (s) on 2 idle CPU cores with the quickstart configs, for the first ETA.
ESTIMATE_S = {
    "make-data": 10,
    "sft": 100,
    "onpolicy-pairs": 10,
    "extra-pairs": 25,
    "train-samples": 60,
    "train-pairs": 5,
    "scratch-init": 5,
    "reward.yaml": 20,
    "pairpref.yaml": 40,
    "length-head": 25,
    "epoch": 150,
    "onpolicy-epoch": 60,
    "eval": 10,
}


def member_seed(seed: int, j: int) -> int:
    """Seed of member ``j`` of an ensemble reported as seed ``seed``: members of different ensembles
    never share a fit, so the ensembles' seeds are as independent as single models'."""
    return 100 + 10 * seed + j


def seed_overrides(row: str, seed: int) -> list[str]:
    """What a seed changes besides ``seed_everything`` (the new weights' init): the data order
    (``data.init_args.seed``) and, for the preference model, which position the chosen response is
    shown in (``model.init_args.seed``); without them the preference model, which adds no weights to
    the SFT policy, trains identically under every seed."""
    return [
        f"--data.init_args.seed={seed}",
        *([f"--model.init_args.seed={seed}"] if ROWS[row].config == "pairpref.yaml" else []),
    ]


def command(row: str, configs: Path, seed: int) -> str:
    """The row's command as a user types it in a checkout (after the shared stages)."""
    r = ROWS[row]
    if r.members is not None:
        paths = [f"out/rm/{r.members}/seed{member_seed(seed, j)}" for j in range(3)]
        return f"RewardEnsemble({paths}, combine={r.combine!r}, normalize='data/sim/sft_val.jsonl')"
    stack = [
        str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in config_stack(r.config, configs)
    ]
    return shlex.join(
        [
            "alignlit",
            "fit",
            *[arg for path in stack for arg in ("--config", path)],
            *r.extra,
            f"--seed_everything={seed}",
            *seed_overrides(row, seed),
        ]
    )


def fit_estimate(row: str) -> float:
    r = ROWS[row]
    if ONPOLICY in r.extra:
        return ESTIMATE_S["onpolicy-epoch"]
    if EPOCH in r.extra:
        return ESTIMATE_S["epoch"]
    if LENGTH_HEAD in r.extra:
        return ESTIMATE_S["length-head"]
    return ESTIMATE_S.get(r.config, 300)


def estimate(row: str, scale: float, members: int) -> float:
    r = ROWS[row]
    if r.members is not None:
        return (fit_estimate(r.members) * members + ESTIMATE_S["eval"]) * scale
    return (fit_estimate(row) + ESTIMATE_S["eval"]) * scale


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs", default=None, help="config directory (default: configs/paper; --tiny: quickstart)"
    )
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument("--members", type=int, default=3, help="reward models per ensemble (default: 3)")
    p.add_argument(
        "--onpolicy-prompts", type=int, default=1000, help="prompts_test prompts for the sample pairs"
    )
    p.add_argument("--extra-pairs", type=int, default=40000, help="fresh annotator pairs (make-pairs)")
    p.add_argument("--batch-size", type=int, default=64, help="pairs per scoring batch")
    p.add_argument("--work", default=None, help="runs and cell results (default: out/bench_reward[_tiny])")
    p.add_argument(
        "--results", default=None, help="table and JSON (default: benchmarks/results; --tiny: WORK)"
    )
    p.add_argument("--tiny", action="store_true", help="toy sizes: checks the whole pipeline in minutes")
    p.add_argument("--plan", action="store_true", help="print the planned cells and the ETA, run nothing")
    p.add_argument(
        "--report",
        action="store_true",
        help="train nothing: write the table from the cells already evaluated (missing ones are listed)",
    )
    return p


def shared_steps(args, configs: Path, prefix: str) -> list[tuple[str, list[str] | None]]:
    """The shared stages in order: ``(name, alignlit argv)`` (None: done in Python)."""
    return [
        ("make-data", ["sim", "make-data", "--out", "data/sim", *(TINY_DATA if args.tiny else [])]),
        ("sft", fit_command("sft", configs, seed=0, tiny=args.tiny)),
        (
            "onpolicy-pairs",  # evaluation only: SFT samples on test prompts, labelled by gold
            [
                "sample",
                "--policy",
                f"{prefix}/sft",
                "--prompts",
                "data/sim/prompts_test.jsonl",
                "--max-prompts",
                str(args.onpolicy_prompts),
                "--n",
                "2",
                "--scorer",
                "gold",
                "--sim",
                "data/sim",
                "--out",
                f"{prefix}/onpolicy/ranked.jsonl",
                "--pairs",
                f"{prefix}/onpolicy/pairs.jsonl",
                "--no-progress",
            ],
        ),
        ("extra-pairs", ["sim", "make-pairs", "--sim", "data/sim", "--n", str(args.extra_pairs)]),
        (
            "train-samples",  # training data: 4 SFT samples per training prompt, unscored
            [
                "sample",
                "--policy",
                f"{prefix}/sft",
                "--prompts",
                "data/sim/prompts_train.jsonl",
                "--n",
                "4",
                "--out",
                "data/sim/samples_sft_train.jsonl",
                "--no-progress",
            ],
        ),
        (
            "train-pairs",
            [
                "sim",
                "label-samples",
                "--sim",
                "data/sim",
                "--samples",
                "data/sim/samples_sft_train.jsonl",
                "--out",
                "data/sim/pairs_onpolicy_train.jsonl",
                "--pairs-per-prompt",
                "2",
            ],
        ),
        ("scratch-init", None),
    ]


def python_step(name: str, root: Path, prefix: str) -> None:
    """The shared stage done in Python: a random initialisation of the SFT policy's architecture."""
    if name == "scratch-init":
        from transformers import AutoConfig, AutoModelForCausalLM

        from alignlit.models import export_pretrained, load_tokenizer

        sft = root / prefix / "sft"
        import torch

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sft))
        export_pretrained(model, load_tokenizer(sft), root / "out" / "rm_init" / "scratch", stage="init")


def annotator_ceiling(sim_dir: Path, records: list) -> dict[str, float]:
    """What the annotators' labels can teach at best, on gold-ordered pairs: the accuracy against gold of
    the noise-free annotator preference ``sign((g_w - g_l)/τ + b·(|y_w| - |y_l|))`` (a reward model that
    learnt the annotators perfectly ranks so)."""
    from alignlit.data.pair_records import parse_pairs
    from alignlit.sim.data import load_sim
    from alignlit.sim.task import num_words

    task, manifest = load_sim(sim_dir)
    a = manifest["annotator"]
    pairs = [p for rec in records for p in parse_pairs(rec)[0]]
    agree = 0
    for p in pairs:
        gap = task.gold_reward(p.prompt, p.chosen) - task.gold_reward(p.prompt, p.rejected)
        agree += gap / a["temperature"] + a["length_bias"] * (num_words(p.chosen) - num_words(p.rejected)) > 0
    return {"pairs": len(pairs), "noise_free_annotator_accuracy": agree / len(pairs)}


def evaluate(reward, records: list) -> dict[str, float]:
    """Accuracy, margin and reward/length correlation of any reward (``score(prompts, responses)``) on
    preference pairs."""
    import torch

    from alignlit.data.pair_records import parse_pairs
    from alignlit.eval.score import pearson

    pairs = [p for rec in records for p in parse_pairs(rec)[0]]
    prompts = [p.prompt for p in pairs]
    chosen, rejected = [p.chosen for p in pairs], [p.rejected for p in pairs]
    s_w, s_l = reward.score(prompts, chosen), reward.score(prompts, rejected)
    tok = reward.tokenizer
    lengths = torch.tensor([len(tok(r, add_special_tokens=False).input_ids) for r in chosen + rejected])
    return {
        "pairs": len(pairs),
        "accuracy": float((s_w > s_l).double().mean()),
        "margin": float((s_w - s_l).mean()),
        "reward_length_corr": pearson(torch.cat([s_w, s_l]), lengths.float()),
    }


class FitFailed(Exception):
    """A cell's fit failed (recorded in ``Runner.failed``): the cell has no result."""


class Runner:
    """Fits cells (``(row, seed)``) under ``work/runs``, each in its own directory linked to the shared
    stages, and evaluates them."""

    def __init__(self, args, configs: Path, work: Path, prefix: str, stamp: float | None):
        self.args, self.configs, self.work, self.prefix, self.stamp = args, configs, work, prefix, stamp
        self.root = work / "root"
        self.cells = Cells(work)  # fit-<row>-seed<n> and eval-<row>-seed<n>, read back while their spec holds
        self.failed: dict[str, str] = {}
        self.measured: list[float] = []
        self.pairs: dict[str, list] = {}

    def load_pairs(self) -> None:
        from alignlit.data import read_records

        self.pairs = {
            "gold_pairs": read_records(self.root / "data" / "sim" / "pairs_gold_val.jsonl"),
            "sample_pairs": read_records(self.root / self.prefix / "onpolicy" / "pairs.jsonl"),
        }

    def fit_argv(self, row: str, seed: int) -> list[str]:
        r = ROWS[row]
        return [
            *fit_command(r.config, self.configs, seed=seed, tiny=self.args.tiny),
            *r.extra,
            *seed_overrides(row, seed),
        ]

    def same(self, row: str, seed: int) -> dict:
        r = ROWS[row]
        if r.members is not None:
            members = [self.same(r.members, member_seed(seed, j)) for j in range(self.args.members)]
            return {"members": members, "combine": r.combine, "shared_stamp": self.stamp}
        return {
            "argv": self.fit_argv(row, seed),
            "config_sha256": config_sha256(r.config, self.configs),
            "shared_stamp": self.stamp,
        }

    def export_of(self, row: str, seed: int) -> Path:
        r = ROWS[row]
        path = self.work / "runs" / row / f"seed{seed}"
        return path / get_key(read_config(r.config, self.configs), "model.init_args.export_dir")

    def fit(self, row: str, seed: int) -> float | None:
        """A training cell: one fit, read back while its command, config and shared stages are unchanged
        and its export is there; its fit seconds (None: it failed)."""
        path = self.work / "runs" / row / f"seed{seed}"

        def train() -> dict:
            (path / self.prefix).mkdir(parents=True, exist_ok=True)
            for link, target in (
                (path / "data", self.root / "data"),
                (path / self.prefix / "sft", self.root / self.prefix / "sft"),
                (path / "out" / "rm_init", self.root / "out" / "rm_init"),
            ):
                link.parent.mkdir(parents=True, exist_ok=True)
                if not link.is_symlink():
                    link.symlink_to(target, target_is_directory=True)
            fit_s = run_alignlit(f"{row} seed {seed}", self.fit_argv(row, seed), path, path / "fit.log")
            self.measured.append(fit_s)
            return {"fit_s": fit_s}

        try:
            export = self.export_of(row, seed)
            done = self.cells.run(
                f"fit-{row}-seed{seed}", train, self.same(row, seed), valid=lambda _: export.exists()
            )
        except RuntimeError as err:
            self.failed[f"{row}/seed{seed}"] = str(err)
            print(f"bench_reward_ablations: {row} seed {seed} FAILED: {err}", flush=True)
            return None
        return done["fit_s"]

    def evaluated(self, row: str, seed: int) -> dict | None:
        """The evaluation cell of ``(row, seed)`` if it is there for the current fits, else None."""
        return self.cells.get(f"eval-{row}-seed{seed}", self.same(row, seed))

    def cell(self, row: str, seed: int) -> dict | None:
        """The evaluation cell: the row's fit (or its members' fits) and its accuracy on both pair sets,
        read back while the fits' commands, configs and shared stages are unchanged (None: a fit failed)."""
        try:
            return self.cells.run(
                f"eval-{row}-seed{seed}", lambda: self.evaluation(row, seed), self.same(row, seed)
            )
        except FitFailed:
            return None

    def evaluation(self, row: str, seed: int) -> dict:
        """What :meth:`cell` computes (:class:`FitFailed` when a fit failed)."""
        from alignlit.models import RewardEnsemble, load_reward_model

        r = ROWS[row]
        if r.members is not None:
            seeds = [member_seed(seed, j) for j in range(self.args.members)]
            fits = [self.fit(r.members, s) for s in seeds]
            if any(f is None for f in fits):
                raise FitFailed(row)
            reward = RewardEnsemble(
                [str(self.export_of(r.members, s)) for s in seeds],
                combine=r.combine,
                normalize=str(self.root / "data" / "sim" / "sft_val.jsonl"),
                batch_size=self.args.batch_size,
            )
            fit_s = sum(fits)
        else:
            fit_s = self.fit(row, seed)
            if fit_s is None:
                raise FitFailed(row)
            export = self.export_of(row, seed)
            if r.config == "pairpref.yaml":
                from alignlit.eval.score import evaluate_pairs

                record = {k: evaluate_pairs(str(export), v, batch_size=self.args.batch_size, max_length=None)
                          for k, v in self.pairs.items()}  # fmt: skip
                return self.record(row, seed, fit_s, record)
            reward = load_reward_model(export, batch_size=self.args.batch_size)
        record = {k: evaluate(reward, v) for k, v in self.pairs.items()}
        return self.record(row, seed, fit_s, record)

    def record(self, row: str, seed: int, fit_s: float, record: dict) -> dict:
        record = {
            "row": row,
            "seed": seed,
            "command": command(row, self.configs, seed),
            "fit_s": fit_s,
            **record,
            **self.same(row, seed),
        }
        print(
            f"bench_reward_ablations: {row} seed {seed}: accuracy {record['gold_pairs']['accuracy']:.3f} "
            f"(gold pairs), {record['sample_pairs']['accuracy']:.3f} (sample pairs), fit {fit_s:.0f} s",
            flush=True,
        )
        return record


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.configs = args.configs or str(ROOT / "configs" / "quickstart")
        args.work = args.work or "out/bench_reward_tiny"
        args.onpolicy_prompts = min(args.onpolicy_prompts, 32)
        args.extra_pairs = min(args.extra_pairs, 400)
    configs = Path(args.configs or ROOT / "configs" / "paper").resolve()
    work = Path(args.work or "out/bench_reward").resolve()
    results = Path(args.results or (work / "results" if args.tiny else ROOT / "benchmarks" / "results"))
    prefix = out_prefix(configs)
    scale = 0.1 if args.tiny else (1.0 if configs.name == "quickstart" else 3.0)
    root = work / "root"

    cells = [(row, seed) for row in args.rows for seed in args.seeds]
    steps = [(name, argv, None) for name, argv in shared_steps(args, configs, prefix)]
    planned = stage_cells(Cells(work), steps, None, make=False)  # the shared stages' cells as they are
    shared_left = planned.pop("left")
    runner = Runner(args, configs, work, prefix, None if shared_left else planned["stamp"])
    left = [(r, s) for r, s in cells if shared_left or runner.evaluated(r, s) is None]
    eta = sum(ESTIMATE_S[k] for k in shared_left) * scale + sum(
        estimate(r, scale, args.members) for r, _ in left
    )
    print(f"bench_reward_ablations: configs {configs}, work {work}, results {results}")
    print(f"bench_reward_ablations: shared stages to run: {', '.join(shared_left) or 'none'}")
    print(f"bench_reward_ablations: {len(cells)} cells ({len(cells) - len(left)} done):")
    for row, seed in cells:
        print(f"  {row}/seed{seed}: {command(row, configs, seed)}")
    print(f"bench_reward_ablations: ETA {fmt_s(eta)} (estimates for 2 idle CPU cores)")
    if args.plan:
        return []

    def run(name: str, argv: list[str] | None) -> float:
        print(f"bench_reward_ablations: shared stage {name}", flush=True)
        if argv is not None:
            return run_alignlit(name, argv, root, work / "logs" / f"{name}.log")
        start = time.perf_counter()
        python_step(name, root, prefix)
        return time.perf_counter() - start

    root.mkdir(parents=True, exist_ok=True)
    # --report: the shared stages as they are; otherwise each stage is a cell, run when missing or stale
    shared = planned if args.report else stage_cells(runner.cells, steps, run)
    runner.stamp = shared["stamp"]
    runner.load_pairs()
    records: dict[str, list[dict]] = {}
    for i, (row, seed) in enumerate(cells):
        if args.report and runner.evaluated(row, seed) is None:
            runner.failed[f"{row}/seed{seed}"] = "not evaluated yet (--report)"
            continue
        record = runner.cell(row, seed)
        if record is not None:
            records.setdefault(row, []).append(record)
        if runner.measured:
            rest = sum(estimate(r, 1.0, args.members) for r, _ in cells[i + 1 :])
            print(f"bench_reward_ablations: about {fmt_s(rest * scale)} left", flush=True)

    table = []
    for row in args.rows:
        rs = records.get(row, [])
        entry = {
            "row": row,
            "label": ROWS[row].label,
            "command": command(row, configs, 0),
            "reference": ROWS[row].reference,
            "seeds": [r["seed"] for r in rs],
        }
        for key, values in (
            ("accuracy_gold_pairs", [r["gold_pairs"]["accuracy"] for r in rs]),
            ("accuracy_sample_pairs", [r["sample_pairs"]["accuracy"] for r in rs]),
            ("reward_length_corr", [r["gold_pairs"].get("reward_length_corr") for r in rs]),
            ("fit_s", [r["fit_s"] for r in rs]),
        ):
            entry[key], entry[f"{key}_std"] = mean_std(values)
            entry[f"{key}_per_seed"] = values
        table.append(entry)
    lines = [
        "| model | command (seed 0) | accuracy vs gold, gold-labelled val pairs | accuracy vs gold, SFT sample "
        "pairs | reward/length r | fit (s) | seeds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for e in table:
        lines.append(
            f"| {e['label']} | `{e['command']}` | {pm(e['accuracy_gold_pairs'], e['accuracy_gold_pairs_std'])} | "
            f"{pm(e['accuracy_sample_pairs'], e['accuracy_sample_pairs_std'])} | "
            f"{pm(e['reward_length_corr'], e['reward_length_corr_std'], 2)} | {pm(e['fit_s'], e['fit_s_std'], 0)} | "
            f"{len(e['seeds'])} |"
        )
    gold_pairs, sample_pairs = len(runner.pairs["gold_pairs"]), len(runner.pairs["sample_pairs"])
    ceiling = {k: annotator_ceiling(root / "data" / "sim", v) for k, v in runner.pairs.items()}
    note = (
        "\nA perfect model of the annotators (their noise-free preference, length bias included) ranks "
        f"{ceiling['gold_pairs']['noise_free_annotator_accuracy']:.3f} of the gold val pairs and "
        f"{ceiling['sample_pairs']['noise_free_annotator_accuracy']:.3f} of the SFT-sample pairs as gold "
        "does.\n"
        + (f"Not evaluated yet: {', '.join(runner.failed)}.\n" if runner.failed else "")
        + f"\n{gold_pairs} gold-labelled val pairs; {sample_pairs} SFT-sample pairs; mean ± std over seeds "
        f"{args.seeds}; configs {configs.name}"
    )
    md = "\n".join(lines)
    print("\n" + md + note)
    setup = {
        "configs": configs.name,
        "seeds": args.seeds,
        "members": args.members,
        "extra_pairs": args.extra_pairs,
        "gold_pairs": gold_pairs,
        "sample_pairs": sample_pairs,
        "tiny": args.tiny,
        "annotator_ceiling": ceiling,
        "missing_or_failed": runner.failed,
        "date": time.strftime("%Y-%m-%d"),
        "shared_stage_s": shared,
    }
    this = command_line([__file__, *(sys.argv[1:] if argv is None else argv)])
    write_results("reward_ablations", {"setup": setup, "table": table}, command=this, table=md + "\n" + note,
                  results_dir=results)  # fmt: skip
    print(f"bench_reward_ablations: wrote {results}/reward_ablations.{{md,json}}")
    if runner.failed and not args.report:
        raise SystemExit(
            f"bench_reward_ablations: {len(runner.failed)} cell(s) failed: {', '.join(runner.failed)}"
        )
    return table


if __name__ == "__main__":
    main()
