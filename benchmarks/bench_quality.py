"""The quality benchmark on the simulated task: every alignment method, tuned on validation prompts,
reported on held-out test prompts over several seeds.

Rows (``METHODS``): the SFT policy; best-of-n of the SFT policy (n = 4, 16; selected by the reward model
and by the gold reward itself, an oracle); RFT (SFT on the reward model's best of 4); DPO (with the RPO
SFT term), cDPO, IPO, SimPO, RRHF; online iterative DPO and online RRHF; PPO-max, vanilla PPO, GRPO and
RLOO. Each trained row is one run's config stack (``harness.config_stack(<config>, <configs>)``: the
quickstart base and its overlays, plus the paper overlay at paper scale); a method whose config does not
exist is listed with "config missing", never left out.

``--suite verifiable`` is the RLVR table (README "Verifiable rewards (RLVR)"): SFT, its gold-selected
best-of-4 and best-of-16, and GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, DAPO and PPO trained against the
rule-based answer check (the ``*-verifiable`` runs, ``configs/verifiable/``; the grid is the number of rollouts), and
DAPO again with longer runs chosen within its own KL budget (``Method.max_val_kl``); its shared stages
are data and SFT only, and its table adds the share of responses the answer check accepts. It writes
``verifiable.{md,json}``, ``verifiable_selection.md`` and ``verifiable.png``.

Protocol:

1. Shared stages, once, with the configs' own seeds: ``alignlit sim make-data``, SFT (``sft.yaml``), the
   reward model (``reward.yaml``), and 4 samples per training prompt from the SFT policy ranked by the
   reward model (``alignlit sample --pairs --rft``): the data of the offline methods.
2. Selection: every setting of a method's grid (``GRIDS``; a few values of its main hyperparameter) is
   trained with seed 0 and evaluated on ``--val-prompts`` prompts of ``prompts_val`` (T = 1, sampling
   seed 0); the setting with the highest mean gold reward is kept (with ``--max-val-kl``: among the
   settings whose validation KL to SFT is at most that).
3. Report: the kept setting is trained with every seed of ``--seeds`` (seed 0 is the selection run) and
   evaluated on ``--test-prompts`` prompts of ``prompts_test`` with sampling seed = the seed; SFT and
   best-of-n are evaluated with the same sampling seeds. Columns: gold reward (mean ± std over seeds),
   win rate against SFT under gold (per prompt, same sampling seed, ties ½), KL to the SFT policy (Monte
   Carlo; analytic ``log n - (n-1)/n`` for best-of-n), response length (tokens) and wall time of the
   method's own stage (its ``alignlit fit`` process; best-of-n: sampling and selection; SFT: its fit).

Writes ``<results>/quality.{json,md}``, ``quality_selection.md`` (every validation cell) and
``quality_frontier.png`` (gold against KL for every row). Every shared stage, training run and evaluation
is a cell under ``--work/cells`` (``harness.Cells``): a rerun reads back the cells whose command, config
and inputs are unchanged, so an interrupted run continues where it stopped. The planned cells and an ETA
are printed first, and after every cell.

    python benchmarks/bench_quality.py                        # the full benchmark (paper-scale configs)
    python benchmarks/bench_quality.py --plan                 # only print the plan and the ETA
    python benchmarks/bench_quality.py --methods sft dpo ppo-max --seeds 0
    python benchmarks/bench_quality.py --tiny                 # end-to-end check at toy size (minutes)
    python benchmarks/bench_quality.py --suite verifiable --configs configs/quickstart --max-val-kl 1.4
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # benchmarks/ is on sys.path when a script runs
    command_line,
    fmt_s,
    write_results,
)
from harness.quality import (
    ESTIMATE_S,
    GRIDS,
    METHODS,
    ROOT,
    SUITES,
    Bench,
    Cell,
    aggregate,
    build_parser,
    estimate,
    format_selection,
    format_table,
    frontier,
    plan,
    slug,
)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if 0 not in args.seeds:
        raise SystemExit("bench_quality: --seeds must include 0 (the seed of the selection runs)")
    if args.tiny:
        args.configs = args.configs or str(ROOT / "configs" / "quickstart")
        args.work = args.work or f"out/bench_{args.suite}_tiny"
        args.val_prompts, args.test_prompts = min(args.val_prompts, 16), min(args.test_prompts, 16)
        args.sample_prompts = args.sample_prompts or 48
    args.configs = args.configs or str(ROOT / "configs" / "paper")
    args.work = args.work or f"out/bench_{args.suite}"
    suite = SUITES[args.suite]
    args.methods = suite.methods if args.methods is None else args.methods
    args.results = Path(
        args.results or (Path(args.work) / "results" if args.tiny else ROOT / "benchmarks" / "results")
    )
    methods = [m for m in METHODS if m.name in args.methods]
    if args.no_grid:
        GRIDS.clear()
    bench = Bench(args, methods)
    the_plan = plan(methods, bench.configs, args.seeds, args.grid_limit)
    cells: list[Cell] = the_plan["cells"]
    shared_left = bench.shared_left()
    shared_s = sum(ESTIMATE_S[k] * bench.scale for k in shared_left)
    print(f"bench_quality: configs {bench.configs}, work {bench.work}, results {args.results}")
    print(f"bench_quality: shared stages to run: {', '.join(shared_left) or 'none'} (~{fmt_s(shared_s)})")
    for m, path in the_plan["missing"].items():
        print(f"bench_quality: {m}: config missing ({path}): listed in the table, not run")
    print(f"bench_quality: {len(cells)} cells planned:")
    for c in cells:
        print(f"  {c.what:<4} {c.key}")
    total = shared_s + sum(estimate(c, {}, bench.scale) for c in cells)
    print(
        f"bench_quality: ETA {fmt_s(total)} (estimates for 2 idle CPU cores; cells already done are skipped)"
    )
    if args.plan:
        return {"plan": the_plan, "eta_s": total}

    shared_times = bench.shared()
    table, selection, done = [], [], 0
    sft_by_seed: dict[int, list[float]] = {}
    for m in methods:
        if m.name in the_plan["missing"]:
            table.append(
                {"name": m.name, "label": m.label, "status": f"config missing: {the_plan['missing'][m.name]}"}
            )
            continue
        try:
            rows = []
            if m.kind in ("sft", "best_of"):
                setting = {}
                for s in args.seeds:
                    rec = bench.evaluate(m, {}, s, "test", None, shared_times["stamp"])
                    rec["wall_s"] = shared_times.get("sft") if m.kind == "sft" else rec["eval_s"]
                    rows.append(rec)
                    done += 1
                    bench.print_eta(cells, done)
                if m.kind == "sft":
                    sft_by_seed = {r["seed"]: r["prompt_gold"] for r in rows}
            else:
                setting, records = bench.chosen_setting(m)
                for r in records:
                    r["chosen"] = r["setting"] == setting
                selection += records
                done += 2 * len(records)
                bench.print_eta(cells, done)
                for s in args.seeds:
                    export, run = bench.fit(m, setting, s)
                    rec = bench.evaluate(m, setting, s, "test", export, run["stamp"])
                    rec["wall_s"] = run["fit_s"]
                    rows.append(rec)
                    done += 1 if s == 0 else 2
                    bench.print_eta(cells, done)
            table.append(
                {"name": m.name, "label": m.label, "setting": slug(setting), **aggregate(rows, sft_by_seed)}
            )
        except RuntimeError as err:
            bench.failed[m.name] = str(err)
            print(f"bench_quality: {m.name} FAILED: {err}", flush=True)
            table.append({"name": m.name, "label": m.label, "status": f"failed: {str(err).splitlines()[0]}"})

    md = format_table(table, with_pass_rate=suite.name == "verifiable")
    chosen = (
        "every method at its config's own setting (--no-grid: no selection run)"
        if args.no_grid
        else f"settings chosen on {args.val_prompts} prompts_val prompts"
        + ("" if args.max_val_kl is None else f" among those with validation KL to SFT <= {args.max_val_kl}")
        + "".join(f" ({m.label}: <= {m.max_val_kl})" for m in methods if m.max_val_kl is not None)
    )
    note = (
        f"\n{args.test_prompts} prompts_test prompts, T = 1; mean ± std over seeds {args.seeds}; {chosen}; "
        f"configs {Path(args.configs).name}"
    )
    print("\n" + md + note)
    slim_selection = [{k: v for k, v in r.items() if k != "prompt_gold"} for r in selection]
    setup = {
        "suite": suite.name,
        "configs": Path(args.configs).name,
        "seeds": args.seeds,
        "val_prompts": args.val_prompts,
        "test_prompts": args.test_prompts,
        "tiny": args.tiny,
        "selection": not args.no_grid,
        "max_val_kl": args.max_val_kl,
        "row_max_val_kl": {m.name: m.max_val_kl for m in methods if m.max_val_kl is not None},
        "date": time.strftime("%Y-%m-%d"),
        "shared_stage_s": shared_times,
    }

    def draw(path):
        from alignlit.eval.plots import plot_frontier

        points = frontier(table)
        title = (
            f"gold vs KL to SFT ({args.test_prompts} test prompts, mean ± std over {len(args.seeds)} seeds)"
        )
        baseline = "SFT" if any(p["name"] == "SFT" for p in points) else None
        if points:
            plot_frontier(points, path, title=title, baseline=baseline)

    command = command_line([__file__, *(sys.argv[1:] if argv is None else argv)])
    results = args.results
    write_results(suite.name, {"setup": setup, "table": table, "selection": slim_selection}, command=command,
                  table=md + "\n" + note, plot={suite.plot: draw}, results_dir=results)  # fmt: skip
    selection_md = format_selection(selection, with_pass_rate=suite.name == "verifiable")
    write_results(f"{suite.name}_selection", None, command=command, table=selection_md,
                  results_dir=results)  # fmt: skip
    print(f"bench_quality: wrote {results}/{suite.name}.{{md,json}}, {suite.name}_selection.md, {suite.plot}")
    if bench.failed:
        raise SystemExit(f"bench_quality: {len(bench.failed)} method(s) failed: {', '.join(bench.failed)}")
    return {"table": table, "selection": slim_selection}


if __name__ == "__main__":
    main()
