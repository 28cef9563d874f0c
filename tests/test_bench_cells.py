"""The quality and claims benchmarks' resumable records (harness/quality.py, harness/claims.py) are
``harness.Cells`` cells: a second call reads a cell back without computing it again, and a changed setting
(command line, inputs, prompts, sampling) or a missing output computes it again."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import Cells, claims  # noqa: E402
from harness import quality as bench_quality  # noqa: E402


def test_shared_stages_are_a_chain_of_cells(tmp_path):
    ran = []

    def run(name, argv):
        ran.append(name)
        (tmp_path / f"{name}.out").write_text("done")
        return 1.0

    def steps(sft_argv):
        return [(n, a, tmp_path / f"{n}.out") for n, a in (("data", ["d"]), ("sft", sft_argv), ("rm", ["r"]))]

    cells = Cells(tmp_path / "work")
    planned = bench_quality.stage_cells(cells, steps(["s"]), None, make=False)
    assert planned["left"] == ["data", "sft", "rm"] and not ran
    times = bench_quality.stage_cells(cells, steps(["s"]), run)
    assert ran == ["data", "sft", "rm"] and times["sft"] == 1.0 and times["stamp"] is not None
    assert bench_quality.stage_cells(cells, steps(["s"]), run) == times and len(ran) == 3  # read back
    assert bench_quality.stage_cells(cells, steps(["s"]), None, make=False)["left"] == []
    bench_quality.stage_cells(cells, steps(["s", "--lr=2"]), run)  # a changed command: it and every later one
    assert ran[3:] == ["sft", "rm"]
    (tmp_path / "data.out").unlink()  # a stage whose output is gone runs again, and so does every later one
    assert bench_quality.stage_cells(cells, steps(["s", "--lr=2"]), None, make=False)["left"] == [
        "data",
        "sft",
        "rm",
    ]
    bench_quality.stage_cells(cells, steps(["s", "--lr=2"]), run)
    assert ran[5:] == ["data", "sft", "rm"]


def quick_args(parser, tmp_path):
    """A quality-harness parser's arguments for the quickstart configs, 4 test prompts, work under tmp_path."""
    argv = [
        "--configs",
        str(ROOT / "configs" / "quickstart"),
        "--work",
        str(tmp_path / "w"),
        "--test-prompts",
        "4",
    ]
    return parser.parse_args(argv)


@pytest.fixture
def bench(tmp_path, monkeypatch):
    args = quick_args(bench_quality.build_parser(), tmp_path)
    b = bench_quality.Bench(args, bench_quality.METHODS)
    monkeypatch.setattr(
        b, "prompts", lambda split: ["p"] * (args.val_prompts if split == "val" else args.test_prompts)
    )
    return b


def test_an_evaluation_is_a_cell_recomputed_when_its_policy_or_sampling_changes(bench, monkeypatch):
    computed = []

    def evaluation(method, setting, seed, split, policy_dir, stamp):
        computed.append((method.name, seed, split, stamp))
        return {"method": method.name, "seed": seed, "gold": 0.5, "prompt_gold": [0.5]}

    monkeypatch.setattr(bench, "evaluation", evaluation)
    sft = next(m for m in bench_quality.METHODS if m.name == "sft")
    first = bench.evaluate(sft, {}, 0, "test", None, 1.0)
    assert bench.evaluate(sft, {}, 0, "test", None, 1.0) == first and len(computed) == 1  # read back
    assert (bench.work / "cells" / "eval-sft-default-seed0-test.json").exists()
    bench.evaluate(sft, {}, 1, "test", None, 1.0)  # another seed: its own cell
    assert len(computed) == 2
    bench.evaluate(sft, {}, 0, "test", None, 2.0)  # the policy (here: the shared stages) changed
    assert len(computed) == 3
    bench.args.max_new_tokens = 48  # the sampling changed
    bench.evaluate(sft, {}, 0, "test", None, 2.0)
    assert len(computed) == 4
    bench.args.test_prompts = 8  # the prompts changed
    bench.evaluate(sft, {}, 0, "test", None, 2.0)
    bench.evaluate(sft, {}, 0, "test", None, 2.0)
    assert len(computed) == 5


def test_a_training_run_is_a_cell_trained_again_when_its_export_is_gone(bench, monkeypatch):
    runs = []

    def fake_run(name, argv, cwd, log):
        runs.append(argv)
        export = Path(cwd) / "out" / "quickstart" / "dpo"
        export.mkdir(parents=True, exist_ok=True)
        (export / "alignlit.json").write_text("{}")
        return 1.5

    monkeypatch.setattr(bench_quality, "run_alignlit", fake_run)
    bench.shared_stamp = 1.0
    dpo = next(m for m in bench_quality.METHODS if m.name == "dpo")
    export, run = bench.fit(dpo, {}, 0)
    assert bench.fit(dpo, {}, 0) == (export, run) and len(runs) == 1  # read back
    assert (bench.work / "cells" / "fit-dpo-default-seed0.json").exists()
    shutil.rmtree(export)
    bench.fit(dpo, {}, 0)
    assert len(runs) == 2


@pytest.fixture
def claims_bench(tmp_path):
    args = quick_args(claims.build_parser(), tmp_path)
    args.suite, args.grid_limit, args.max_val_kl = "quality", None, None  # as bench_claims.py sets them
    bench = claims.ClaimsBench(args)
    bench.shared_stamp = 1.0
    return bench


def test_claims_shared_stages_are_cells(claims_bench, monkeypatch):
    runs = []

    def fake_run(name, argv, cwd, log):
        runs.append(name)
        out = claims_bench.extra / name
        out.mkdir(parents=True, exist_ok=True)
        (out / ("pairs.jsonl" if name == "samples-gold" else "alignlit.json")).write_text("{}")
        return 3.0

    monkeypatch.setattr(claims, "run_alignlit", fake_run)
    times = claims_bench.shared_extra()
    assert runs == ["samples-gold", "reward-unbalanced"] and times["reward-unbalanced"] == {
        "s": 3.0,
        "stamp": 1.0,
    }
    assert claims_bench.shared_extra() == times and len(runs) == 2  # read back
    claims_bench.shared_stamp = 2.0  # the shared stages they start from changed
    claims_bench.shared_extra()
    assert runs[2:] == ["samples-gold", "reward-unbalanced"]
    claims_bench.args.sample_prompts = 64  # the gold-ranked samples' command changed
    claims_bench.shared_extra()
    assert runs[4:] == ["samples-gold"]


def test_claims_evaluations_are_cells(claims_bench, monkeypatch):
    computed = []

    def proxy_evaluation(policy_dir, seed, stamp):
        computed.append((policy_dir, seed, stamp))
        return {"gold": 0.5, "proxy": 0.1, "seed": seed, "stamp": stamp}

    monkeypatch.setattr(claims_bench, "proxy_evaluation", proxy_evaluation)
    monkeypatch.setattr(claims_bench, "prompts", lambda split: ["p"] * claims_bench.args.test_prompts)
    first = claims_bench.evaluate_policy_dir(Path("a"), 0, "eval-arm-seed0", 1.0)
    assert (
        claims_bench.evaluate_policy_dir(Path("a"), 0, "eval-arm-seed0", 1.0) == first and len(computed) == 1
    )
    claims_bench.evaluate_policy_dir(Path("a"), 0, "eval-arm-seed0", 2.0)  # the run finished again
    claims_bench.evaluate_policy_dir(Path("b"), 0, "eval-arm-seed0", 2.0)  # another policy
    assert len(computed) == 3
    claims_bench.args.test_prompts = 8  # the prompts changed
    claims_bench.evaluate_policy_dir(Path("b"), 0, "eval-arm-seed0", 2.0)
    assert len(computed) == 4
