"""Reward-model ablations on the simulated task: accuracy against the gold reward.

Rows (``ROWS``), each one ``alignlit fit`` command from the shared SFT policy, trained with every seed of
``--seeds``:

- ``bt``: the Bradley-Terry reward model as configured (``reward.yaml``: length balancing on);
- ``bt-no-balance``: the same without length balancing (ChatGLM-RLHF §3.3; the annotators prefer the
  longer answer, so an unbalanced reward model learns length);
- ``bt-l2``: with the score regulariser ``λ_reg·(r_w² + r_l²)`` (ChatGLM-RLHF eq. 2), λ_reg = 0.01;
- ``bt-lm``: with the LM-imitation loss on the chosen response (PPO-max §4), β_lm = 0.1;
- ``pairpref``: the pairwise preference model (``pairpref.yaml``; RLHF-Workflow §2.2), which compares two
  responses in one forward pass instead of scoring each.

The regulariser weights are single untuned values (the ablation asks whether the term helps at a
common setting), not chosen on any evaluation data.

Columns: accuracy against gold on ``pairs_gold_val.jsonl`` (the annotator distribution's pairs with
noise-free gold labels; what the stages log as ``val/accuracy``), accuracy against gold on pairs of the
SFT policy's own samples (2 per ``prompts_test`` prompt, labelled by gold, ties dropped: the pairs a
reward model judges during RLHF), the reward/length Pearson correlation on the gold pairs (reward models
only), wall time of the fit; mean ± std over seeds. Writes ``<results>/reward_ablations.{json,md}``.
Every (row, seed) cell leaves a JSON under ``--work``; a rerun skips the cells whose JSON exists.

    python benchmarks/bench_reward_ablations.py               # paper-scale configs, seeds 0 1 2
    python benchmarks/bench_reward_ablations.py --plan        # the planned cells and the ETA
    python benchmarks/bench_reward_ablations.py --tiny        # end-to-end check at toy size
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

from bench_quality import (
    ROOT,
    TINY_DATA,
    fmt_s,
    get_key,
    mean_std,
    out_prefix,
    pm,
    read_config,
    read_json,
    run_alignlit,
    run_overrides,
)

ROWS: dict[str, tuple[str, str, list[str]]] = {
    "bt": ("Bradley-Terry RM, length balancing on", "reward.yaml", []),
    "bt-no-balance": (
        "Bradley-Terry RM, length balancing off",
        "reward.yaml",
        ["--data.init_args.length_balance=false"],
    ),
    "bt-l2": (
        "Bradley-Terry RM + score regulariser (λ_reg = 0.01)",
        "reward.yaml",
        ["--model.init_args.l2_weight=0.01"],
    ),
    "bt-lm": (
        "Bradley-Terry RM + LM imitation (β_lm = 0.1)",
        "reward.yaml",
        ["--model.init_args.lm_weight=0.1"],
    ),
    "pairpref": ("pairwise preference model", "pairpref.yaml", []),
}

# Rough wall times (s) on 2 idle CPU cores with the paper-scale configs, for the first ETA.
ESTIMATE_S = {"make-data": 15, "sft": 270, "onpolicy-pairs": 30, "bt": 280, "pairpref": 330, "eval": 20}


def seed_overrides(row: str, seed: int) -> list[str]:
    """What a seed changes besides ``seed_everything`` (the new weights' init): the data order
    (``data.init_args.seed``) and, for the preference model, which position the chosen response is
    shown in (``model.init_args.seed``); without them the preference model, which adds no weights to
    the SFT policy, trains identically under every seed."""
    return [
        f"--data.init_args.seed={seed}",
        *([f"--model.init_args.seed={seed}"] if row == "pairpref" else []),
    ]


def command(row: str, configs: Path, seed: int) -> str:
    """The row's command as a user types it in a checkout (after the SFT stage)."""
    _, config, extra = ROWS[row]
    rel = configs.relative_to(ROOT) if configs.is_relative_to(ROOT) else configs
    return " ".join(
        [
            "alignlit fit --config",
            str(rel / config),
            *extra,
            f"--seed_everything={seed}",
            *seed_overrides(row, seed),
        ]
    )


def estimate(row: str, scale: float) -> float:
    return (ESTIMATE_S["pairpref" if row == "pairpref" else "bt"] + ESTIMATE_S["eval"]) * scale


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs", default=None, help="config directory (default: configs/paper; --tiny: quickstart)"
    )
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument(
        "--onpolicy-prompts", type=int, default=1000, help="prompts_test prompts for the sample pairs"
    )
    p.add_argument("--batch-size", type=int, default=64, help="pairs per scoring batch")
    p.add_argument("--work", default=None, help="runs and cell results (default: out/bench_reward[_tiny])")
    p.add_argument(
        "--results", default=None, help="table and JSON (default: benchmarks/results; --tiny: WORK)"
    )
    p.add_argument("--tiny", action="store_true", help="toy sizes: checks the whole pipeline in minutes")
    p.add_argument("--plan", action="store_true", help="print the planned cells and the ETA, run nothing")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.configs = args.configs or str(ROOT / "configs" / "quickstart")
        args.work = args.work or "out/bench_reward_tiny"
        args.onpolicy_prompts = min(args.onpolicy_prompts, 32)
    configs = Path(args.configs or ROOT / "configs" / "paper").resolve()
    work = Path(args.work or "out/bench_reward").resolve()
    results = Path(args.results or (work / "results" if args.tiny else ROOT / "benchmarks" / "results"))
    prefix = out_prefix(configs)
    scale = 0.1 if args.tiny else (0.35 if configs.name == "quickstart" else 1.0)
    root = work / "root"

    cells = [(row, seed) for row in args.rows for seed in args.seeds]
    left = [(r, s) for r, s in cells if not (work / "runs" / r / f"seed{s}" / "eval.json").exists()]
    shared = read_json(work / "shared.json")
    shared_left = [k for k in ("make-data", "sft", "onpolicy-pairs") if k not in shared]
    eta = sum(ESTIMATE_S[k] for k in shared_left) * scale + sum(estimate(r, scale) for r, _ in left)
    print(f"bench_reward_ablations: configs {configs}, work {work}, results {results}")
    print(f"bench_reward_ablations: shared stages to run: {', '.join(shared_left) or 'none'}")
    print(f"bench_reward_ablations: {len(cells)} cells ({len(cells) - len(left)} done):")
    for row, seed in cells:
        print(f"  {row}/seed{seed}: {command(row, configs, seed)}")
    print(f"bench_reward_ablations: ETA {fmt_s(eta)} (estimates for 2 idle CPU cores)")
    if args.plan:
        return []

    # shared stages: data, SFT, on-policy gold-labelled pairs
    root.mkdir(parents=True, exist_ok=True)
    tiny_fit = dict(seed=0, tiny=args.tiny)
    sft_cfg = configs / "sft.yaml"
    onpolicy = f"{prefix}/onpolicy/pairs.jsonl"
    steps = [
        ("make-data", ["sim", "make-data", "--out", "data/sim", *(TINY_DATA if args.tiny else [])]),
        ("sft", ["fit", "--config", str(sft_cfg), *run_overrides(read_config(sft_cfg), **tiny_fit)]),
        (
            "onpolicy-pairs",
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
                onpolicy,
                "--no-progress",
            ],
        ),
    ]
    redo = False  # a stage that ran makes every later one run again (they start from its result)
    for name, step in steps:
        if not redo and name in shared:
            continue
        redo = True
        print(f"bench_reward_ablations: shared stage {name}: alignlit {' '.join(step)}", flush=True)
        shared[name] = run_alignlit(name, step, root, work / "logs" / f"{name}.log")
        shared["stamp"] = time.time()
        (work / "shared.json").write_text(json.dumps(shared, indent=1) + "\n")

    from alignlit.data import read_records
    from alignlit.eval.score import evaluate_pairs

    gold_pairs = read_records(root / "data" / "sim" / "pairs_gold_val.jsonl")
    sample_pairs = read_records(root / onpolicy)
    measured: list[float] = []
    failed: dict[str, str] = {}
    records: dict[str, list[dict]] = {}
    for i, (row, seed) in enumerate(cells):
        _, config_name, extra = ROWS[row]
        path = work / "runs" / row / f"seed{seed}"
        cell_file = path / "eval.json"
        config_path = configs / config_name
        fit_argv = [
            "fit",
            "--config",
            str(config_path),
            *run_overrides(read_config(config_path), seed=seed, tiny=args.tiny),
            *extra,
            *seed_overrides(row, seed),
        ]
        same = {
            "argv": fit_argv,
            "config_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest(),
            "shared_stamp": shared["stamp"],
        }
        cached = read_json(cell_file)
        if all(cached.get(k) == v for k, v in same.items()):
            records.setdefault(row, []).append(cached)
            continue
        (path / prefix).mkdir(parents=True, exist_ok=True)
        for link, target in ((path / "data", root / "data"), (path / prefix / "sft", root / prefix / "sft")):
            if not link.is_symlink():
                link.symlink_to(target, target_is_directory=True)
        try:
            fit_s = run_alignlit(f"{row} seed {seed}", fit_argv, path, path / "fit.log")
        except RuntimeError as err:
            failed[f"{row}/seed{seed}"] = str(err)
            print(f"bench_reward_ablations: {row} seed {seed} FAILED: {err}", flush=True)
            continue
        export = str(path / get_key(read_config(config_path), "model.init_args.export_dir"))
        on_gold = evaluate_pairs(export, gold_pairs, batch_size=args.batch_size, max_length=None)
        on_samples = evaluate_pairs(export, sample_pairs, batch_size=args.batch_size, max_length=None)
        record = {
            "row": row,
            "seed": seed,
            "command": command(row, configs, seed),
            "fit_s": fit_s,
            "gold_pairs": on_gold,
            "sample_pairs": on_samples,
            **same,
        }
        tmp = cell_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(cell_file)
        records.setdefault(row, []).append(record)
        measured.append(fit_s)
        remaining = len(cells) - i - 1
        per_cell = statistics.mean(measured)
        print(
            f"bench_reward_ablations: {row} seed {seed}: accuracy {on_gold['accuracy']:.3f} (gold pairs), "
            f"{on_samples['accuracy']:.3f} (sample pairs), {fit_s:.0f} s; ETA {fmt_s(remaining * per_cell)}",
            flush=True,
        )

    table = []
    for row in args.rows:
        rs = records.get(row, [])
        entry = {
            "row": row,
            "label": ROWS[row][0],
            "command": command(row, configs, 0),
            "seeds": [r["seed"] for r in rs],
        }
        for key, values in (
            ("accuracy_gold_pairs", [r["gold_pairs"]["accuracy"] for r in rs]),
            ("accuracy_sample_pairs", [r["sample_pairs"]["accuracy"] for r in rs]),
            ("reward_length_corr", [r["gold_pairs"].get("reward_length_corr") for r in rs]),
            ("fit_s", [r["fit_s"] for r in rs]),
        ):
            entry[key], entry[f"{key}_std"] = mean_std(values)
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
    pairs_note = f"{len(gold_pairs)} gold-labelled val pairs; {len(sample_pairs)} SFT-sample pairs"
    note = (
        f"\n{pairs_note}; mean ± std over seeds {args.seeds}; configs {configs.name}; {time.strftime('%Y-%m-%d')}; "
        "`"
        + " ".join(["python benchmarks/bench_reward_ablations.py", *(sys.argv[1:] if argv is None else argv)])
        + "`"
    )
    md = "\n".join(lines)
    print("\n" + md + note)
    results.mkdir(parents=True, exist_ok=True)
    (results / "reward_ablations.md").write_text(md + "\n" + note + "\n")
    (results / "reward_ablations.json").write_text(
        json.dumps(
            {
                "setup": {
                    "configs": configs.name,
                    "seeds": args.seeds,
                    "gold_pairs": len(gold_pairs),
                    "sample_pairs": len(sample_pairs),
                    "tiny": args.tiny,
                    "date": time.strftime("%Y-%m-%d"),
                    "shared_stage_s": shared,
                },
                "table": table,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"bench_reward_ablations: wrote {results}/reward_ablations.{{md,json}}")
    if failed:
        raise SystemExit(f"bench_reward_ablations: {len(failed)} cell(s) failed: {', '.join(failed)}")
    return table


if __name__ == "__main__":
    main()
