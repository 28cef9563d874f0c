"""bench_async's table (speed-ups, overlap ceiling, staleness histogram) and its ``--collect`` of finished runs,
on hand-made run records."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import Cells  # noqa: E402
from harness import async_runs as bench_async  # noqa: E402

PHASES = dict.fromkeys(bench_async.PHASES, 0.0)


def record(k, seed, rate, *, threads=1, rollout=1.0, train=3.0, staleness=None, gold=0.5):
    return {
        "stage": "grpo", "engine": "hf", "k": k, "threads": threads, "seed": seed, "rollouts": 4,
        "wall_s": 10.0, "cpu_s": 15.0, "cores_used": 1.5, "samples_per_s": rate, "samples_per_s_all": rate / 2,
        "wait_share": 0.25 if k == 0 else 0.0, "first_step_s": 2.0,
        "phases_s": {**PHASES, "rollout_s": rollout, "train_s": train},
        "staleness": staleness or [0.0] * 4, "eval": {"gold": gold, "kl_to_reference": 0.2},
    }  # fmt: skip


def test_table_speedups_ceiling_and_histogram():
    records = [
        record(0, 0, 100.0, gold=0.50), record(0, 1, 110.0, gold=0.60),
        record(1, 0, 120.0, staleness=[0.0, 1.0, 1.0, 1.0]), record(1, 1, 130.0, staleness=[0.0, 1.0, 1.0, 1.0]),
        record(0, 0, 140.0, threads=2, rollout=0.5, train=2.0),
    ]  # fmt: skip
    rows = {(r["k"], r["threads"]): r for r in bench_async.table(records)}
    assert set(rows) == {(0, 1), (1, 1), (0, 2)}
    sync, k1, two = rows[0, 1], rows[1, 1], rows[0, 2]
    assert sync["samples_per_s"] == pytest.approx(105.0) and sync["speedup"] == pytest.approx(1.0)
    assert sync["gold"] == pytest.approx((0.55, 0.0707107), rel=1e-5)  # mean, sample std of 0.5 and 0.6
    assert k1["speedup"] == pytest.approx(125.0 / 105.0)
    assert k1["speedup_vs_sync_threads"] == pytest.approx(125.0 / 140.0) and k1["sync_threads"] == 2
    # the ceiling comes from the one-thread synchronous runs' phases: (1 + 3) / max(1, 3)
    assert k1["ceiling"] == pytest.approx(4.0 / 3.0) and sync["ceiling"] is None
    assert k1["staleness_histogram"] == {0: 2, 1: 6} and sync["staleness_histogram"] == {0: 8}
    assert two["speedup"] == pytest.approx(140.0 / 105.0)
    text = bench_async.format_table(bench_async.table(records))
    assert "| grpo | hf | 1 | 1 | 125.0 ± 7.1 | 1.19× | 0.89× (2 threads) | 1.33× |" in text


def test_reward_lag_in_rollouts():
    """k = 0's seed-mean training reward rises 0.5 per rollout (0.1, 0.6, 1.1, 1.6); k = 1's seed mean is the
    same line one rollout later (-0.4, 0.1, 0.6, 1.1): the mean gap 0.5 over the slope 0.5 is 1 rollout."""
    base = [
        {**record(0, 0, 100.0), "reward_curve": [0.0, 0.5, 1.0, 1.5]},
        {**record(0, 1, 100.0), "reward_curve": [0.2, 0.7, 1.2, 1.7]},
        {**record(0, 0, 140.0, threads=2), "reward_curve": [0.0, 0.0, 0.0, 0.0]},  # not k = 0's base
    ]
    late = [
        {**record(1, 0, 120.0), "reward_curve": [-0.4, 0.0, 0.6, 1.0]},
        {**record(1, 1, 120.0), "reward_curve": [-0.4, 0.2, 0.6, 1.2]},
    ]
    rows = {(r["k"], r["threads"]): r for r in bench_async.table(base + late)}
    assert rows[1, 1]["reward_lag"] == pytest.approx((0.85 - 0.35) / 0.5)  # seed means 0.85 and 0.35
    assert rows[0, 1]["reward_lag"] is None  # k = 0 is the base
    assert "| 2 | 1.0 | 0: 8 |" in bench_async.format_table([rows[1, 1]])
    assert bench_async.reward_lag([1.0, 1.0], [2.0, 1.0]) is None  # a base that does not rise
    assert bench_async.reward_lag(None, [0.0, 1.0]) is None


def test_collect_takes_the_evaluated_runs_of_the_asked_size(tmp_path):
    def write(name, rec, evaluation):
        cells = Cells(tmp_path / name)  # the cells bench_async's fit and evaluate leave
        cells.run("fit", lambda: {k: v for k, v in rec.items() if k != "eval"}, spec={"argv": [name]})
        if evaluation is not None:
            cells.run("eval_test", lambda: evaluation, spec={"prompts": evaluation["prompts"]})

    evaluation = {"prompts": 50, "gold": 0.5, "kl_to_reference": 0.2}
    write("grpo-hf-k0-s0", record(0, 0, 100.0), evaluation)
    write("grpo-hf-k1-s0", record(1, 0, 120.0), None)  # not evaluated yet
    write("grpo-hf-k2-s0", record(2, 0, 120.0), {**evaluation, "prompts": 10})  # other test prompts
    write("grpo-hf-k4-s0", {**record(4, 0, 120.0), "rollouts": 30}, evaluation)  # another campaign
    write("ppo-hf-k0-s0", {**record(0, 0, 90.0), "stage": "ppo"}, evaluation)  # not asked for
    args = bench_async_args(tmp_path, "--stages", "grpo", "--rollouts", "4", "--test-prompts", "50")
    got = bench_async.collect(args)
    assert [(r["stage"], r["k"]) for r in got] == [("grpo", 0)] and got[0]["eval"] == evaluation
    with pytest.raises(SystemExit, match="no finished run"):
        bench_async.collect(bench_async_args(tmp_path, "--stages", "dpo", "--rollouts", "4"))


def bench_async_args(work, *argv):
    """The arguments ``--collect`` reads."""
    values = dict(zip(argv[::2], argv[1::2]))
    return SimpleNamespace(
        work=str(work), stages=[values.get("--stages", "grpo")], engines=["hf"],
        rollouts=int(values.get("--rollouts", 30)), test_prompts=int(values.get("--test-prompts", 500)),
    )  # fmt: skip


@pytest.mark.parametrize("stage", ["grpo-long", "grpo-long-partial"])
def test_long_shape_stages_parse(stage, monkeypatch, tmp_path):
    """The long shape's overrides on the quickstart GRPO config parse (reward by dotted path from
    benchmarks/, the random policy's directory) and give the shape bench_async documents."""
    import importlib.util

    from alignlit.cli import AlignCLI

    spec = importlib.util.spec_from_file_location(
        "bench_async_script", ROOT / "benchmarks" / "bench_async.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    class ParseOnly(AlignCLI):
        def instantiate_classes(self) -> None:
            pass

    config, overrides = script.CONFIGS[stage]
    args = ["--config", str(ROOT / config), *(o.format(long=tmp_path) for o in overrides)]
    monkeypatch.setattr(sys, "argv", ["alignlit"])
    init = ParseOnly(args=args, run=False).config.model.init_args
    assert init.reward == "harness.vs_trl.reward_fn" and init.policy == f"{tmp_path}/policy"
    rollout = init.rollout.init_args
    assert rollout.sampling.max_new_tokens == 128 and rollout.samples_per_prompt == 8
    assert (init.minibatches.size, init.minibatches.epochs) == (16, 1)
    assert rollout.partial == (64 if stage.endswith("partial") else None)
