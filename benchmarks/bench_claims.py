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

Writes ``<results>/claims.{json,md}`` and ``claims_overopt.png``. Every shared stage, run and evaluation is
a cell under ``--work/cells`` like ``bench_quality.py``'s (a rerun reads back the unchanged ones).

    python benchmarks/bench_claims.py --work out/bench_claims
    python benchmarks/bench_claims.py --claims overopt --seeds 0      # one claim, one seed
    python benchmarks/bench_claims.py --tiny                           # the pipeline at toy size
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import command_line, write_results  # benchmarks/ is on sys.path when a script runs
from harness import quality as bq
from harness.claims import (
    ROOT,
    ClaimsBench,
    aggregate,
    arms,
    build_parser,
    curves_md,
    filter_epsilon,
    plot_overopt,
    resolve_setting,
    table_md,
)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
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
        s: bench.evaluate_policy_dir(None, s, f"eval-sft-seed{s}", shared["stamp"]) for s in args.seeds
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
                rec = bench.evaluate_policy_dir(export, s, f"eval-{arm.name}-seed{s}", run["stamp"])
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
                        key = f"eval-{arm.name}-seed{s}-snapshot{batch:05d}"
                        srec = bench.evaluate_policy_dir(run_dir / snap["path"], s, key, run["stamp"])
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

    command = command_line([__file__, *(sys.argv[1:] if argv is None else argv)])
    note = (
        f"{args.test_prompts} prompts_test prompts, T = 1; mean ± std over seeds {args.seeds}; configs "
        f"{Path(args.configs).name}"
    )
    rm_md = "\n".join(
        ["| reward model | accuracy vs gold (pairs_gold_val) | reward–length corr |", "|---|---:|---:|"]
        + [f"| {k} | {v['accuracy']:.3f} | {v['reward_length_corr']:.3f} |" for k, v in reward_models.items()]
    )
    md = "\n\n".join(
        [table_md(rows), curves_md(curves) if curves else "", rm_md if reward_models else "", note]
    )
    title = f"long runs, {args.test_prompts} test prompts, mean ± std over seeds {args.seeds}"
    data = {
        "setup": {**vars(args), "date": time.strftime("%Y-%m-%d"), "command": command},
        "shared_stage_s": shared,
        "shared_extra_s": extra,
        "prompt_filter": filter_report,
        "rows": rows,
        "curves": curves,
        "reward_models": reward_models,
    }
    plots = {"claims_overopt.png": lambda path: plot_overopt(curves, path, title)} if curves else None
    write_results("claims", data, command=command, table=md, plot=plots, results_dir=results)
    print(md)
    return {"rows": rows, "curves": curves, "reward_models": reward_models}


if __name__ == "__main__":
    main()
