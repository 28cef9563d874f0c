"""benchmarks/harness/: cached and resumable cells, results written with their command, machine and
commit, and one command per committed result (what `nox -s bench -- NAME` runs)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402


def test_a_cell_runs_once_per_spec_and_resumes(tmp_path):
    cells, calls = harness.Cells(tmp_path), []

    def compute():
        calls.append(1)
        return {"gold": 0.5}

    assert cells.run("grpo/seed0", compute, spec={"argv": ["fit", "a"]}) == {"gold": 0.5}
    assert harness.Cells(tmp_path).run("grpo/seed0", compute, spec={"argv": ["fit", "a"]}) == {"gold": 0.5}
    assert len(calls) == 1  # a new Cells on the same work directory resumes: the record is read back
    cells.run("grpo/seed0", compute, spec={"argv": ["fit", "b"]})  # another spec: computed again
    assert len(calls) == 2 and cells.get("grpo/seed0", {"argv": ["fit", "a"]}) is None
    record = json.loads(cells.path("grpo/seed0").read_text())
    assert record["spec"] == {"argv": ["fit", "b"]} and record["seconds"] >= 0
    assert not list(cells.dir.glob("*.tmp"))


def test_a_failing_cell_leaves_no_record(tmp_path):
    cells = harness.Cells(tmp_path)
    with pytest.raises(RuntimeError):
        cells.run("x", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert cells.get("x") is None


def test_results_are_table_json_and_plot_with_command_machine_and_commit(tmp_path):
    rows = [{"method": "grpo", "gold": 0.81234}, {"method": "ppo", "gold": 0.75}]
    plotted = []
    out = harness.write_results(
        "demo",
        {"rows": rows},
        command="python benchmarks/bench_demo.py --seeds 0",
        table=harness.markdown_table(rows),
        title="Demo",
        plot=lambda path: plotted.append(path) or path.write_bytes(b"png"),
        results_dir=tmp_path,
    )
    data = json.loads(out["json"].read_text())
    assert data["command"] == "python benchmarks/bench_demo.py --seeds 0" and data["rows"] == rows
    assert data["machine"]["cores"] >= 1 and "commit" in data["commit"] and data["date"]
    md = out["md"].read_text()
    assert md.startswith("# Demo\n\n| method | gold |") and "| grpo | 0.8123 |" in md
    assert "Command: `python benchmarks/bench_demo.py --seeds 0`" in md
    assert plotted == [tmp_path / "demo.png"]
    assert harness.result_command("demo", tmp_path) == data["command"]
    assert harness.result_names(tmp_path) == ["demo"]


def test_command_line_is_relative_to_the_checkout():
    argv = [str(ROOT / "benchmarks/bench_quality.py"), "--work", "out/bq", "--seeds", "0", "1"]
    assert harness.command_line(argv) == "python benchmarks/bench_quality.py --work out/bq --seeds 0 1"


@pytest.mark.parametrize("name", harness.result_names(), ids=str)
def test_every_committed_result_names_its_command(name):
    """`nox -s bench -- NAME` runs it: every step is a python script under benchmarks/ that exists (or
    the quickstart), and its options are the script's (or those of the harness module its parser is in)."""
    command = harness.result_command(name)
    for step in command.split(" && "):
        words = shlex.split(step)
        if words[:2] == ["python3", "-m"] or words[0] == "cp":
            continue
        assert words[0] == "python" and (ROOT / words[1]).is_file(), step
        source = harness.script_source(ROOT / words[1])  # with its parser's home
        for word in words[2:]:
            if word.startswith("--"):
                assert f'"{word.split("=")[0]}"' in source, f"{name}: {word} is not an option of {words[1]}"


def test_config_stacks_by_name():
    stack = harness.config_stack("grpo-verifiable", "paper")
    assert [str(p.relative_to(ROOT)) for p in stack] == [
        "configs/quickstart/grpo.yaml",
        "configs/verifiable/grpo.yaml",
        "configs/paper/grpo-verifiable.yaml",
    ]
    assert harness.config_stack("sft.yaml") == [ROOT / "configs/quickstart/sft.yaml"]
    assert harness.config_args("ipo") == [
        "--config",
        str(ROOT / "configs/quickstart/dpo.yaml"),
        "--config",
        str(ROOT / "configs/dpo/ipo.yaml"),
    ]
    with pytest.raises(FileNotFoundError):
        harness.config_stack("no-such-run")
    config = harness.read_config("grpo-verifiable", "paper")
    assert config["model"]["init_args"]["export_dir"] == "out/paper/grpo-verifiable"
    assert config["model"]["init_args"]["reward"]["class_path"] == "alignlit.rewards.SimVerifier"
    assert harness.merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}
    assert harness.merge({"r": {"class_path": "A", "init_args": {"x": 1}}}, {"r": {"class_path": "B"}}) == {
        "r": {"class_path": "B"}
    }


def test_a_training_cell_reuses_a_finished_run_with_the_same_command(tmp_path):
    calls = []

    def run(argv):
        calls.append(argv)
        (tmp_path / "policy").mkdir(exist_ok=True)
        (tmp_path / "policy" / "config.json").write_text("{}")

    first = harness.fit_once(tmp_path, ["fit", "--config", "a.yaml"], {"arm": "grpo"}, extra_s=2.0, run=run)
    again = harness.fit_once(tmp_path, ["fit", "--config", "a.yaml"], {"arm": "grpo"}, run=run)
    assert again == first and len(calls) == 1 and first["fit_s"] >= 2.0  # the same argv: read back
    assert list(first) == ["arm", "argv", "policy", "fit_s"]
    assert first["argv"] == ["fit", "--config", "a.yaml"] and first["policy"] == str(tmp_path / "policy")
    cell = json.loads((tmp_path / "cells" / "fit.json").read_text())  # a harness cell, no record of its own
    assert cell["spec"] == {"argv": ["fit", "--config", "a.yaml"]} and cell["result"] == first
    assert not (tmp_path / "run.json").exists()
    harness.fit_once(tmp_path, ["fit", "--config", "b.yaml"], run=run)
    assert len(calls) == 2  # another command line: trained again
    harness.fit_once(tmp_path, ["fit", "--config", "b.yaml"], run=run)
    assert len(calls) == 2
    (tmp_path / "policy" / "config.json").unlink()
    harness.fit_once(tmp_path, ["fit", "--config", "b.yaml"], run=run)
    assert len(calls) == 3  # the same command, but its export is gone: trained again
    assert harness.fit_once(tmp_path, ["fit", "--config", "b.yaml"], run=run)["argv"][-1] == "b.yaml"
    assert len(calls) == 3


def test_a_training_cell_that_fails_is_run_again(tmp_path):
    """A run that stops before its export exists leaves no cell: the next call trains."""
    calls = []

    def run(argv):
        calls.append(argv)
        if len(calls) == 1:
            raise KeyboardInterrupt  # stopped mid-run
        (tmp_path / "policy").mkdir(exist_ok=True)
        (tmp_path / "policy" / "config.json").write_text("{}")

    with pytest.raises(KeyboardInterrupt):
        harness.fit_once(tmp_path, ["fit"], run=run)
    assert not (tmp_path / "cells" / "fit.json").exists()
    assert harness.fit_once(tmp_path, ["fit"], run=run)["argv"] == ["fit"] and len(calls) == 2


def test_paper_stages_are_made_once_in_order(tmp_path):
    stages = harness.paper_stages(
        tmp_path / "sim", tmp_path / "sft", tmp_path / "rm", tmp_path / "logs", steps=3
    )
    assert [argv[0] for _, argv in stages] == ["sim", "fit", "fit"]
    assert "--trainer.max_steps=3" in stages[1][1] and str(ROOT / "configs/paper/sft.yaml") in stages[1][1]
    ran = []
    harness.prepare(stages[:1], run=lambda argv: ran.append(argv) or (tmp_path / "sim").mkdir())
    assert ran == [stages[0][1]]
    (tmp_path / "sim" / "manifest.json").write_text("{}")
    harness.prepare(stages[:1], run=ran.append)
    assert len(ran) == 1  # made once
    with pytest.raises(SystemExit, match=r"missing .*sft/config\.json.*: run --prepare"):
        harness.prepare(stages, run=ran.append, make=False, hint="run --prepare")


def test_a_cell_whose_files_are_gone_is_computed_again(tmp_path):
    """``Cells.run(valid=)``: a record whose spec matches is used only while what it names still exists; with
    a settings dict as the spec (what a script's cells name), a changed setting computes again."""
    cells, calls = harness.Cells(tmp_path), []

    def compute(x):
        calls.append(x)
        (tmp_path / f"out{x}").write_text("")
        return {"x": x, "file": str(tmp_path / f"out{x}")}

    def cell(x):
        return cells.run("c", lambda: compute(x), spec={"x": x}, valid=lambda r: Path(r["file"]).exists())

    assert cell(3) == {"x": 3, "file": str(tmp_path / "out3")} == cell(3) and calls == [3]
    assert cell(4)["x"] == 4 and calls == [3, 4]  # another setting
    (tmp_path / "out4").unlink()
    assert cell(4)["x"] == 4 and calls == [3, 4, 4]  # the same setting, its file gone
    assert cells.latest("c") == {"x": 4, "file": str(tmp_path / "out4")}
    assert not hasattr(harness, "cached")  # one kind of record: the cells


def test_a_failing_alignlit_run_names_itself_and_its_log(tmp_path):
    with pytest.raises(RuntimeError, match=r"demo failed \(exit 2; log .*fit\.log\)"):
        harness.run_alignlit("demo", ["fit", "--no-such-option"], tmp_path, tmp_path / "fit.log")
    assert (tmp_path / "fit.log").read_text()


def test_shared_helpers_mean_std_pm_fmt_s():
    assert harness.mean_std([1.0, None, 3.0]) == (2.0, pytest.approx(2**0.5))
    assert harness.mean_std([2.0]) == (2.0, None) and harness.mean_std([None]) == (None, None)
    assert (
        harness.pm(0.5, 0.25) == "0.500 ± 0.250"
        and harness.pm(0.5, None, 1) == "0.5"
        and harness.pm(None, 1) == ""
    )
    assert harness.fmt_s(65) == "1m05s" and harness.fmt_s(3725) == "1h02m"


def test_no_benchmark_imports_another_benchmark():
    """What scripts share lives in the harness: a benchmark script imports no other script of benchmarks/."""
    import ast

    scripts = {p.stem: p for p in (ROOT / "benchmarks").glob("*.py")}
    for name, path in scripts.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        assert not imported & (set(scripts) - {name}), (
            f"benchmarks/{name}.py imports {imported & set(scripts)}"
        )


def test_results_table_only_and_named_plots(tmp_path):
    """``data=None`` writes the table alone (its command in its last lines); a dict names the plots' files."""
    drawn = []
    out = harness.write_results(
        "demo_selection",
        None,
        command="python benchmarks/bench_demo.py",
        table="| a |\n|---|\n| 1 |",
        plot={"demo_frontier.png": lambda path: drawn.append(path.name)},
        results_dir=tmp_path,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo_selection.md"]
    assert set(out) == {"md", "demo_frontier"} and drawn == ["demo_frontier.png"]
    assert harness.result_command("demo_selection", tmp_path) == "python benchmarks/bench_demo.py"


def test_tests_import_the_harness_not_the_scripts():
    """A test of a benchmark's pieces imports them from the harness: the scripts are run, never imported."""
    import ast

    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            )
            assert not {n.split(".")[0] for n in names} & scripts, f"{path.relative_to(ROOT)} imports {names}"


def test_measurement_cells_resume_for_the_same_code_only(tmp_path, monkeypatch):
    """A measuring benchmark's cell is read back while the code is the same, measured again once it changed."""
    stamp = harness.code_stamp()
    assert stamp.split("+")[0] == harness.commit()["commit"]
    cells, calls = harness.measurement_cells("demo", tmp_path), []
    measure = lambda: calls.append(1) or {"seconds": 1.0}  # noqa: E731
    for code in (stamp, stamp, stamp + "changed"):
        assert cells.run("variant", measure, {"config": {"rows": 8}, "code": code}) == {"seconds": 1.0}
    assert len(calls) == 2 and cells.dir == tmp_path / "cells"
    assert harness.measurement_cells("demo").dir == ROOT / "out" / "bench" / "demo" / "cells"
