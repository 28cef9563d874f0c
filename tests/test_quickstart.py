"""The quickstart pipeline (noxfile.QUICKSTART), the evaluation it ends with (win rate, per-prompt gold,
progress in chunks, the gold-vs-KL plot) and the planning and resume logic of the quality benchmarks."""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
import sys
from pathlib import Path

import pytest

from alignlit.eval.gold import best_of_n, evaluate_policy, format_table, sample_responses, win_rate
from alignlit.models import load_policy
from alignlit.rollout import SamplingParams
from tests.helpers import EVAL_PROMPTS as PROMPTS
from tests.helpers import n_chars

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
from harness import quality as bench_quality  # noqa: E402


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    model, tok = load_policy(tiny_policy_dir)
    return model.eval(), tok


def test_win_rate_counts_ties_as_half():
    """Per prompt: 1 > 0.5 wins, 0.5 = 0.5 ties, 0.2 < 0.9 loses, 0.9 > 0.7 wins:
    (1 + 0.5 + 0 + 1) / 4 = 0.625."""
    assert win_rate([1.0, 0.5, 0.2, 0.9], [0.5, 0.5, 0.9, 0.7]) == pytest.approx(0.625)
    assert win_rate([0.3], [0.3]) == 0.5
    with pytest.raises(ValueError, match="3 and 2"):
        win_rate([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-empty"):
        win_rate([], [])


def test_evaluation_in_chunks_samples_what_one_call_samples(policy):
    """Chunks of 2 prompts with a progress bar give the samples of one seeded call with the same
    batch size; per-prompt gold is the mean over each prompt's n samples."""
    model, tok = policy
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    res = evaluate_policy(model, tok, PROMPTS, n_chars, sampling=sampling, n=2, batch_size=2, progress=True)
    rollout = sample_responses(model, tok, PROMPTS, n=2, sampling=sampling, batch_size=2)
    gold = n_chars(None, rollout.texts)
    assert res.samples == 6
    assert res.gold == pytest.approx(sum(gold) / 6)
    assert res.prompt_gold == pytest.approx([(gold[2 * i] + gold[2 * i + 1]) / 2 for i in range(3)])
    assert "prompt_gold" not in res.as_dict()

    best = best_of_n(model, tok, PROMPTS, n_chars, n=2, sampling=sampling, batch_size=2, progress=True)
    assert best.prompt_gold == pytest.approx([max(gold[2 * i], gold[2 * i + 1]) for i in range(3)])
    assert best.samples == 6


def test_format_table_adds_the_win_rate_against_a_baseline(policy):
    model, tok = policy
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    base = evaluate_policy(model, tok, PROMPTS, n_chars, sampling=sampling, name="SFT")
    best = best_of_n(model, tok, PROMPTS, n_chars, n=4, sampling=sampling, name="SFT")
    table = format_table([base, best], baseline="SFT")
    assert "win vs SFT" in table.splitlines()[0]
    rows = table.splitlines()[2:]
    assert " 0.500 |" in rows[0]  # the baseline against itself: all ties
    assert f" {win_rate(best.prompt_gold, base.prompt_gold):.3f} |" in rows[1]
    with pytest.raises(ValueError, match="no row 'PPO'"):
        format_table([base], baseline="PPO")


def test_plot_frontier_writes_a_png_and_checks_its_input(tmp_path):
    from alignlit.eval.plots import plot_frontier

    points = [
        {"name": "SFT", "kl": 0.0, "gold": 0.6, "series": ["best-of-n"]},
        {"name": "best-of-4", "kl": 0.64, "gold": 0.8, "gold_err": 0.01, "series": "best-of-n"},
        {"name": "DPO", "kl": 1.5, "gold": 0.7, "kl_err": 0.2, "gold_err": 0.02},
        {"name": "greedy", "kl": None, "gold": 0.8},  # no KL: left out
    ]
    out = plot_frontier(points, tmp_path / "sub" / "f.png", title="t", baseline="SFT")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="baseline 'PPO'"):
        plot_frontier(points, tmp_path / "g.png", baseline="PPO")
    with pytest.raises(ValueError, match="at least one point"):
        plot_frontier(points[3:], tmp_path / "h.png")


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory):
    from alignlit.sim import make_data

    d = tmp_path_factory.mktemp("sim")
    make_data(d, n_sft=20, n_pairs=20, n_prompts=20, n_val=8, n_test=8)
    return d


def test_eval_command_writes_win_rates_json_and_plot(tmp_path, sim_dir, tiny_policy_dir, capsys):
    from alignlit.cli import main

    policy = str(tiny_policy_dir)
    argv = ["eval", "--sim", str(sim_dir), "--policy", policy, policy, "--name", "SFT", "B"]
    argv += ["--reference", policy, "--n-prompts", "4", "--max-new-tokens", "6", "--best-of", "2"]
    argv += ["--best-of-for", "SFT", "--json", str(tmp_path / "e.json"), "--plot", str(tmp_path / "f.png")]
    results = main(argv)
    assert [(r.name, r.mode) for r in results] == [("SFT", "T=1"), ("SFT", "best-of-2"), ("B", "T=1")]
    rows = json.loads((tmp_path / "e.json").read_text())["results"]
    assert rows[0]["win_vs_SFT"] == 0.5 and rows[2]["win_vs_SFT"] == 0.5  # the same policy and seed
    assert (tmp_path / "f.png").stat().st_size > 0
    assert "win vs SFT" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["eval", "--sim", str(sim_dir), "--policy", policy, "--best-of-for", "X"])
    with pytest.raises(SystemExit):
        main(["eval", "--sim", str(sim_dir), "--policy", policy, "--plot", str(tmp_path / "x.png")])


# --- the quality benchmark's plan and resume logic ---


@pytest.fixture
def configs(tmp_path):
    """A config directory with the quickstart configs of SFT, RFT, DPO and GRPO only."""
    d = tmp_path / "configs"
    d.mkdir()
    for name in ("sft", "rft", "dpo", "grpo"):
        shutil.copy(ROOT / "configs" / "quickstart" / f"{name}.yaml", d)
    return d


def test_plan_runs_every_setting_then_every_seed_and_lists_missing_configs(configs):
    methods = [
        m for m in bench_quality.METHODS if m.name in ("sft", "bo4-rm", "rft", "dpo", "ppo-max", "online-dpo")
    ]
    got = bench_quality.plan(methods, configs, seeds=[0, 1, 2], grid_limit=None)
    assert set(got["missing"]) == {"ppo-max", "online-dpo"}
    keys = [f"{c.what} {c.key}" for c in got["cells"]]
    assert keys[:6] == [f"eval {m}/default/seed{s}/test" for m in ("sft", "bo4-rm") for s in (0, 1, 2)]
    # RFT: the config's lr 1e-4 times 0.5, 1, 2; each setting trained with seed 0 and evaluated on val
    rft = [k for k in keys if "rft/" in k]
    assert rft[:6] == [
        f"{w} rft/optim.lr={lr}/seed0" + ("/val" if w == "eval" else "")
        for lr in ("5e-05", "0.0001", "0.0002")
        for w in ("fit", "eval")
    ]
    # then the chosen setting with seeds 1 and 2, and the test evaluations of all three seeds
    assert rft[6:] == [
        "fit rft/chosen=on-val/seed1",
        "fit rft/chosen=on-val/seed2",
        *[f"eval rft/chosen=on-val/seed{s}/test" for s in (0, 1, 2)],
    ]
    dpo = [k for k in keys if "dpo/" in k]
    assert dpo[0] == "fit dpo/loss_args.beta=0.05,loss_args.label_smoothing=0/seed0"
    assert len(dpo) == 11
    assert len(bench_quality.plan(methods, configs, seeds=[0], grid_limit=1)["cells"]) == 2 + 2 * 2 + 2 * 1


def test_run_overrides_drop_checkpoints_and_shrink_tiny_runs(configs):
    offline = harness.read_config("dpo", configs)
    online = harness.read_config("grpo", configs)
    full = bench_quality.run_overrides(online, seed=2, tiny=False)
    assert full == [
        "--seed_everything=2",
        "--data.init_args.seed=2",
        "--model.init_args.rollout.seed=2",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]",
        "--trainer.enable_progress_bar=false",
    ]
    tiny = bench_quality.run_overrides(offline, seed=0, tiny=True)
    assert "--data.init_args.seed=0" in tiny and not any("rollout.seed" in a for a in tiny)
    assert "--trainer.max_steps=6" in tiny and "--trainer.val_check_interval=6" in tiny
    tiny = bench_quality.run_overrides(online, seed=0, tiny=True)
    assert "--trainer.limit_train_batches=2" in tiny and "--trainer.limit_val_batches=1" in tiny


def test_a_finished_run_is_reused_until_its_config_changes(configs, tmp_path, monkeypatch):
    calls = []

    def fake_run(name, argv, cwd, log):
        calls.append(argv)
        export = Path(cwd) / "out/quickstart/dpo"
        export.mkdir(parents=True, exist_ok=True)
        (export / "alignlit.json").write_text("{}")
        return 1.5

    monkeypatch.setattr(bench_quality, "run_alignlit", fake_run)
    args = bench_quality.build_parser().parse_args(["--configs", str(configs), "--work", str(tmp_path / "w")])
    args.tiny = False
    bench = bench_quality.Bench(args, bench_quality.METHODS)
    bench.shared_stamp = 1.0
    dpo = next(m for m in bench_quality.METHODS if m.name == "dpo")
    setting = {"loss_args": {"beta": 0.3, "label_smoothing": 0.0}}
    export, run = bench.fit(dpo, setting, 0)
    assert (
        export
        == tmp_path / "w/runs/dpo/loss_args.beta=0.3,loss_args.label_smoothing=0/seed0/out/quickstart/dpo"
    )
    assert (export.parents[2] / "data").is_symlink() and (export.parent / "sft").is_symlink()
    assert (
        run["fit_s"] == 1.5
        and calls[0][-1] == '--model.init_args.loss_args={"beta": 0.3, "label_smoothing": 0.0}'
    )
    assert bench.fit(dpo, setting, 0)[1] == run and len(calls) == 1  # reused
    (configs / "dpo.yaml").write_text((configs / "dpo.yaml").read_text() + "\n# changed\n")
    bench.fit(dpo, setting, 0)
    assert len(calls) == 2  # the config text changed: trained again
    bench.shared_stamp = 2.0
    bench.fit(dpo, setting, 0)
    assert len(calls) == 3  # the shared SFT/RM changed: trained again
    # the grid point at the config's own setting (beta 0.1) is the config's run without overrides:
    # same directory and command line as the setting-free run, so it is trained once for both
    own = {"loss_args": {"beta": 0.1, "label_smoothing": 0.0}}
    assert bench.own_setting("dpo", own) == {} and bench.own_setting("dpo", setting) == setting
    export, _ = bench.fit(dpo, own, 1)
    assert export == tmp_path / "w/runs/dpo/default/seed1/out/quickstart/dpo"
    assert not any(a.startswith("--model.init_args.") for a in calls[-1]) and len(calls) == 4
    bench.fit(dpo, {}, 1)
    assert len(calls) == 4  # reused
    lrs = bench_quality.settings_of(next(m for m in bench_quality.METHODS if m.name == "rft"), configs)
    assert [bench.own_setting("rft", s) for s in lrs] == [{"optim.lr": 5e-05}, {}, {"optim.lr": 0.0002}]


def test_aggregate_mean_std_and_win_rate_per_seed():
    """Two seeds: gold 0.6 and 0.8 -> mean 0.7, std sqrt(0.02) = 0.1414; win rates against SFT's
    per-prompt gold of the same seed: seed 0 (1 > 0, 0 = 0) -> 0.75, seed 1 (1 > 0.5, 0 < 1) -> 0.5, so
    0.625 ± sqrt(2 · 0.125²) = 0.1768."""
    rows = [
        {
            "seed": 0,
            "gold": 0.6,
            "prompt_gold": [1.0, 0.0],
            "kl_to_reference": 1.0,
            "length": 5.0,
            "wall_s": 10,
        },
        {
            "seed": 1,
            "gold": 0.8,
            "prompt_gold": [1.0, 0.0],
            "kl_to_reference": 2.0,
            "length": 7.0,
            "wall_s": 12,
        },
    ]
    got = bench_quality.aggregate(rows, {0: [0.0, 0.0], 1: [0.5, 1.0]})
    assert got["gold"] == pytest.approx(0.7) and got["gold_std"] == pytest.approx(0.02**0.5)
    assert got["win_vs_sft"] == pytest.approx(0.625) and got["win_vs_sft_std"] == pytest.approx(
        0.125 * 2**0.5
    )
    assert got["kl_to_sft"] == 1.5 and got["seeds"] == [0, 1]


def test_choose_keeps_the_best_validation_gold_within_the_kl_limit():
    """A (gold 0.90, KL 1.7), B (0.86, 1.2), C (0.80, 0.9): no limit -> A; KL <= 1.5 -> B (A is over);
    KL <= 0.5 -> none is within, so the lowest KL, C."""
    records = [
        {"setting": "A", "gold": 0.90, "kl_to_reference": 1.7},
        {"setting": "B", "gold": 0.86, "kl_to_reference": 1.2},
        {"setting": "C", "gold": 0.80, "kl_to_reference": 0.9},
    ]
    assert bench_quality.choose(records)["setting"] == "A"
    assert bench_quality.choose(records, 1.5)["setting"] == "B"
    assert bench_quality.choose(records, 0.5)["setting"] == "C"


def test_trainer_settings_override_the_trainer_and_a_row_budget_overrides_max_val_kl(tmp_path, monkeypatch):
    """A grid key under ``trainer.`` (the number of rollouts) is a trainer override, not a model one; equal
    to the config's own value (grpo-verifiable: 60) it is dropped; --tiny drops it (the tiny length wins).
    DAPO's longer row chooses within its own KL budget (1.75), the others within --max-val-kl (1.4):
    records A (gold 0.95, KL 1.7) and B (0.90, 1.3) -> the long row keeps A, a plain row B."""
    assert bench_quality.setting_overrides({"trainer.limit_train_batches": 80, "optim.lr": 1e-5}) == [
        "--trainer.limit_train_batches=80",
        "--model.init_args.optim.lr=1e-05",
    ]
    configs = str(ROOT / "configs/quickstart")
    args = bench_quality.build_parser().parse_args(
        ["--suite", "verifiable", "--configs", configs, "--work", str(tmp_path), "--max-val-kl", "1.4"]
    )
    args.tiny = False
    bench = bench_quality.Bench(args, bench_quality.METHODS)
    own = bench.own_setting("grpo-verifiable", {"trainer.limit_train_batches": 60})
    assert own == {} and bench.own_setting("grpo-verifiable", {"trainer.limit_train_batches": 80}) != {}
    argv = bench.fit_args("grpo-verifiable.yaml", 0, {"trainer.limit_train_batches": 80})
    assert argv[-1] == "--trainer.limit_train_batches=80"
    bench.args.tiny = True
    tiny = bench.fit_args("grpo-verifiable.yaml", 0, {"trainer.limit_train_batches": 80})
    assert "--trainer.limit_train_batches=80" not in tiny and "--trainer.limit_train_batches=2" in tiny
    a, b = {"gold": 0.95, "kl_to_reference": 1.7}, {"gold": 0.90, "kl_to_reference": 1.3}
    record_of = {80: a, 200: a}  # every other number of rollouts: B

    def fake_fit(method, setting, seed):
        return Path("export"), {"stamp": 1.0}

    def fake_evaluate(method, setting, seed, split, policy_dir, stamp):
        return {"setting": setting, **record_of.get(setting["trainer.limit_train_batches"], b)}

    monkeypatch.setattr(bench, "fit", fake_fit)
    monkeypatch.setattr(bench, "evaluate", fake_evaluate)
    long_row, plain = (bench.methods[n] for n in ("dapo-verifiable-long", "grpo-verifiable"))
    assert long_row.max_val_kl == 1.75 and plain.max_val_kl is None
    assert bench.chosen_setting(long_row)[0] == {"trainer.limit_train_batches": 200}  # A: KL 1.7 <= 1.75
    assert bench.chosen_setting(plain)[0] == {"trainer.limit_train_batches": 60}  # A: KL 1.7 > 1.4; B first


def test_pass_rate_counts_gold_one_and_the_verifiable_table_shows_it():
    """Gold 1, 0.9, 1, -0.1: the strict answer check accepts 2 of 4 -> 0.5."""
    assert bench_quality.pass_rate([1.0, 0.9, 1.0, -0.1]) == 0.5
    rows = [
        {"seed": s, "gold": g, "prompt_gold": pg, "kl_to_reference": 1.0, "length": 5.0}
        for s, g, pg in ((0, 0.95, [1.0, 0.9]), (1, 1.0, [1.0, 1.0]))
    ]
    got = bench_quality.aggregate(rows, {})
    assert got["pass_rate"] == 0.75 and got["pass_rate_std"] == pytest.approx(0.5**0.5 / 2)
    table = bench_quality.format_table([{"label": "GRPO", "setting": "default", **got}], with_pass_rate=True)
    assert "answer check pass rate" in table.splitlines()[0] and "| 0.750 ± 0.354 |" in table
    assert "pass rate" not in bench_quality.format_table([{"label": "GRPO", "setting": "default", **got}])


def test_the_verifiable_suite_runs_data_and_sft_only(tmp_path, monkeypatch):
    """Its rows are SFT, the gold best-of-n references, the six *-verifiable configs and DAPO's longer row;
    its shared stages are make-data and SFT (no reward model, no ranked samples), and its runs link only
    those."""
    calls = []

    def fake_run(name, argv, cwd, log):
        calls.append(name)
        return 1.0

    monkeypatch.setattr(bench_quality, "run_alignlit", fake_run)
    args = bench_quality.build_parser().parse_args(
        ["--suite", "verifiable", "--configs", str(ROOT / "configs/quickstart"), "--work", str(tmp_path)]
    )
    args.tiny = False
    suite = bench_quality.SUITES["verifiable"]
    assert suite.methods[:3] == ("sft", "bo4-gold", "bo16-gold") and len(suite.methods) == 10
    configs = {m.name: m.config for m in bench_quality.METHODS}
    assert (
        suite.methods[-1] == "dapo-verifiable-long" and configs["dapo-verifiable-long"] == "dapo-verifiable"
    )
    assert all(harness.config_stack(configs[name], "quickstart") for name in suite.methods[3:])
    bench = bench_quality.Bench(args, bench_quality.METHODS)
    bench.shared()
    assert calls == ["make-data", "sft"]
    bench.prepare_run_dir(tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run/out/quickstart").iterdir()) == ["sft"]


# --- the quickstart itself, at toy size ---


def load_noxfile():
    spec = importlib.util.spec_from_file_location("alignlit_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny(cmd: list[str]) -> list[str]:
    """A quickstart command at toy size: few rows of data, a few steps, few prompts."""
    if cmd[:3] == ["alignlit", "sim", "make-data"]:
        return [
            *cmd[1:],
            "--n-sft",
            "300",
            "--n-pairs",
            "200",
            "--n-prompts",
            "100",
            "--n-val",
            "32",
            "--n-test",
            "16",
        ]
    if cmd[1] == "fit":
        config = harness.read_files(ROOT / c for k, c in itertools.pairwise(cmd) if k == "--config")
        return cmd[1:] + bench_quality.run_overrides(config, seed=0, tiny=True)
    if cmd[1] == "sample":
        return [*cmd[1:], "--max-prompts", "24", "--no-progress"]
    if cmd[1] == "eval":
        return [*cmd[1:], "--n-prompts", "8", "--no-progress"]
    raise AssertionError(f"unexpected quickstart command {cmd}")


def test_the_verifiable_stage_needs_only_data_and_the_sft_policy():
    """The quickstart's RLVR stage trains GRPO on the answer check from the SFT policy: no reward model,
    no samples; it runs after SFT and its export is a row of the final evaluation."""
    nox_module = load_noxfile()
    name, row, configs = nox_module.QUICKSTART_VERIFIABLE
    config = harness.read_config(name, "quickstart")
    args = config["model"]["init_args"]
    assert (
        args["reward"]["class_path"] == "alignlit.rewards.SimVerifier"
        and args["policy"] == "out/quickstart/sft"
    )
    assert "out/quickstart/reward" not in json.dumps(config)
    titles = [cmd for _, cmd, _ in nox_module.QUICKSTART]
    assert [str(p.relative_to(ROOT)) for p in harness.config_stack(name)] == configs[1::2]
    stage = titles.index(["alignlit", "fit", *configs])
    assert stage > titles.index(["alignlit", "fit", "--config", "configs/quickstart/sft.yaml"])
    evaluation = titles[-1]
    assert f"out/quickstart/{name}" in evaluation and row in evaluation


@pytest.mark.slow
def test_quickstart_pipeline_runs_end_to_end_at_toy_size(tmp_path, monkeypatch):
    from alignlit.cli import main

    nox_module = load_noxfile()
    assert [title for title, _, _ in nox_module.QUICKSTART][-1].startswith("held-out gold reward")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    for title, cmd, writes in nox_module.QUICKSTART:
        main(tiny(cmd))
        for path in writes:
            assert (tmp_path / path).exists(), f"{title}: {path} was not written"
    rows = json.loads((tmp_path / "out/quickstart/eval.json").read_text())["results"]
    names = [r["name"] for r in rows]
    assert names[:3] == ["SFT", "SFT", "SFT"]
    assert names[3:] == ["DPO", "PPO", nox_module.QUICKSTART_ONLINE[1], nox_module.QUICKSTART_VERIFIABLE[1]]
