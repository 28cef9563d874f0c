"""The test prompts and the gold reward stay out of every training and selection path.

- No shipped config (stage or overlay) names a test data file, and on generated data every file a
  quickstart or paper run (its stacked configs) trains, validates or mixes in (prompts, SFT data,
  pairs) shares no prompt with ``prompts_test``.
- The gold reward (``alignlit.sim.SimGoldReward``) appears in a config only as ``gold:`` (validation
  logging on ``prompts_val``), never as the reward a stage trains on; the verifiable configs train on
  ``alignlit.rewards.SimVerifier``.
- The quickstart's commands before its evaluation read no test file.
- The quality/verifiable benchmark chooses settings on ``prompts_val`` only: every evaluation of the
  selection is on the ``val`` split, its prompts are ``prompts_val``'s, and no training run it starts
  gets a test file.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from alignlit.sim import make_data
from alignlit.sim.multiturn import write_multiturn_sft

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
CONFIGS = sorted(CONFIG_DIR.rglob("*.yaml"))
GOLD = "alignlit.sim.SimGoldReward"
DATA_FILE = re.compile(r"\.(jsonl|json|parquet|csv|arrow)$")
TEST_NAME = re.compile(r"(^|[_\-.])test($|[_\-.])")

sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import SCALES, read_config, runs  # noqa: E402
from harness import quality as bench_quality  # noqa: E402

RUNS = [(scale, name) for scale in SCALES for name in runs()]  # every run of the simulated task
VERIFIABLE = [(scale, name) for scale, name in RUNS if name.endswith("-verifiable")]


def leaves(node, path=()):
    """(key path, value) of every leaf of a parsed YAML tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from leaves(value, (*path, str(i)))
    else:
        yield path, node


def data_files(config: dict) -> dict[str, str]:
    """Every value of the config that names a data file, by its dotted key."""
    return {
        ".".join(path): value
        for path, value in leaves(config)
        if isinstance(value, str) and DATA_FILE.search(value)
    }


def names_test_data(value: str) -> bool:
    return any(TEST_NAME.search(part.rsplit(".", 1)[0]) for part in Path(value).parts)


def test_the_test_name_check_by_hand():
    assert names_test_data("data/sim/prompts_test.jsonl") and names_test_data("data/hh/test.jsonl")
    assert names_test_data("data/test/prompts.jsonl") and names_test_data("pairs-test.parquet")
    assert not names_test_data("data/sim/prompts_val.jsonl") and not names_test_data("data/latest.jsonl")
    config = {"data": {"init_args": {"train_file": "data/sim/prompts_test.jsonl", "batch_size": 8}}}
    assert data_files(config) == {"data.init_args.train_file": "data/sim/prompts_test.jsonl"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_no_config_names_a_test_file(config):
    files = data_files(yaml.safe_load(config.read_text()))
    bad = {key: value for key, value in files.items() if names_test_data(value)}
    assert not bad, f"{config}: test data in a training/selection path: {bad}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_gold_reward_is_only_logged(config):
    """SimGoldReward only under a ``gold`` key; a stage never trains on it."""
    tree = yaml.safe_load(config.read_text())
    for path, value in leaves(tree):
        if value == GOLD:
            assert path[-1] == "class_path" and path[-2] == "gold", f"{config}: {'.'.join(path)} is gold"


@pytest.mark.parametrize(("scale", "name"), VERIFIABLE, ids=lambda v: v)
def test_verifiable_configs_train_on_the_verifier(scale, name):
    args = read_config(name, scale)["model"]["init_args"]
    assert args["reward"]["class_path"] == "alignlit.rewards.SimVerifier"
    assert args["gold"]["class_path"] == GOLD


def test_six_verifiable_methods_at_both_scales():
    names = {name for _, name in VERIFIABLE}
    methods = ("grpo", "rloo", "dr-grpo", "reinforce-pp", "dapo", "ppo")
    assert names == {f"{m}-verifiable" for m in methods}
    assert len(VERIFIABLE) == 2 * len(methods)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """A small generated data set: ``data/sim`` under a fresh root, as the configs name it (with the
    multi-turn SFT files of ``alignlit sim make-multiturn-data``)."""
    root = tmp_path_factory.mktemp("root")
    make_data(root / "data" / "sim", n_sft=300, n_pairs=200, n_prompts=300, n_val=100, n_test=200)
    write_multiturn_sft(root / "data" / "sim", n_train=50, n_val=20, eos="<|endoftext|>")
    return root


def prompts_of(path: Path) -> set[str]:
    """The prompts of a JSONL data file (``prompt`` field, or the prompt part of an HH-style ``chosen``)."""
    out = set()
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "prompt" in record:
            out.add(record["prompt"])
        else:
            chosen = record["chosen"]
            out.add(chosen[: chosen.rindex("\n\nAssistant:") + len("\n\nAssistant:")])
    return out


@pytest.mark.parametrize(("scale", "name"), RUNS, ids=lambda v: v)
def test_config_data_shares_no_prompt_with_the_test_prompts(scale, name, sim):
    test = prompts_of(sim / "data/sim/prompts_test.jsonl")
    assert len(test) == 200
    sim_files = {k: v for k, v in data_files(read_config(name, scale)).items() if "data/sim/" in v}
    for key, value in sim_files.items():
        prompts = prompts_of(sim / value)
        assert prompts and not prompts & test, f"{scale}/{name}: {key} = {value} holds test prompts"


def load_noxfile():
    spec = importlib.util.spec_from_file_location("alignlit_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_reads_test_prompts_only_in_its_evaluation():
    steps = load_noxfile().QUICKSTART
    *training, (title, evaluation, _) = steps
    for name, cmd, _ in training:
        assert not [a for a in cmd if names_test_data(a) or a == "test"], f"{name}: {cmd}"
        assert cmd[:2] != ["alignlit", "eval"], name
    assert title.startswith("held-out gold reward") and evaluation[:2] == ["alignlit", "eval"]
    assert "--split" not in evaluation  # the evaluation's default split is test


# --- the benchmark's selection path ---


@pytest.fixture
def bench(sim, tmp_path):
    args = bench_quality.build_parser().parse_args(
        ["--suite", "verifiable", "--configs", str(CONFIG_DIR / "quickstart"), "--work", str(tmp_path / "w")]
    )
    args.tiny = False
    b = bench_quality.Bench(args, bench_quality.METHODS)
    b.root = sim  # the generated data set above stands in for the shared stages' data/sim
    return b


def test_selection_reads_prompts_val_only(bench, sim):
    val = bench.prompts("val")
    assert len(val) == 100 and set(val) == prompts_of(sim / "data/sim/prompts_val.jsonl")
    assert not set(val) & prompts_of(sim / "data/sim/prompts_test.jsonl")
    assert set(bench.prompts("test")) == prompts_of(sim / "data/sim/prompts_test.jsonl")


@pytest.mark.parametrize("name", bench_quality.VERIFIABLE)
def test_the_benchmark_selects_on_val_and_trains_without_test_files(bench, name, monkeypatch):
    """``chosen_setting`` trains every grid setting and evaluates each on the val split only; the
    command line of every run it starts names no test file."""
    method = bench.methods[name]
    fits, evals = [], []

    def fake_fit(method, setting, seed):
        argv = bench.fit_args(f"{method.config}.yaml", seed, bench.own_setting(method.name, setting))
        fits.append(argv)
        return Path("export"), {"stamp": 1.0}

    def fake_evaluate(method, setting, seed, split, policy_dir, stamp):
        evals.append(split)
        # the last setting scores best, every one within any KL budget
        return {"setting": setting, "gold": len(evals) * 0.1, "kl_to_reference": 0.1}

    monkeypatch.setattr(bench, "fit", fake_fit)
    monkeypatch.setattr(bench, "evaluate", fake_evaluate)
    settings = bench_quality.settings_of(method, bench.configs)
    chosen, records = bench.chosen_setting(method)
    assert evals == ["val"] * len(settings) and len(fits) == len(settings) >= 1
    assert chosen == settings[-1] and len(records) == len(settings)
    for argv in fits:
        assert not [a for a in argv if names_test_data(a)], argv
    # and the plan evaluates on test only the chosen setting
    cells = bench_quality.plan([method], bench.configs, seeds=[0, 1, 2], grid_limit=None)["cells"]
    assert {c.split for c in cells if c.what == "eval" and c.setting != {"chosen": "on-val"}} == {"val"}
    assert {c.split for c in cells if c.what == "eval" and c.setting == {"chosen": "on-val"}} == {"test"}


def test_the_claims_benchmark_trains_without_test_files(sim, tmp_path):
    """Every arm of ``bench_claims.py`` starts a run whose command line names no test file; the gold
    reward is a training reward only in the oracle-labeller arm (``online-dpo-gold``; ``dpo-gold``
    trains on the gold-ranked samples of training prompts), and the prompt filter's ε comes from the
    shared samples of training prompts."""
    from harness import claims as bench_claims

    args = bench_claims.build_parser().parse_args(
        ["--configs", str(CONFIG_DIR / "quickstart"), "--work", str(tmp_path / "w")]
    )
    args.suite, args.grid_limit, args.max_val_kl = "quality", None, None
    bench = bench_claims.ClaimsBench(args)
    bench.root = sim
    names = set()
    for arms in bench_claims.arms(args).values():
        for arm in arms:
            names.add(arm.name)
            argv = bench.fit_args(
                f"{arm.config}.yaml", 0, bench_claims.resolve_setting(arm.setting, bench, 0.1)
            )
            assert not [a for a in argv if names_test_data(a)], (arm.name, argv)
            assert any(GOLD in a for a in argv) == (arm.name == "online-dpo-gold"), (arm.name, argv)
            if arm.name == "dpo-gold":
                assert "--data.init_args.train_file=out/quickstart/samples-gold/pairs.jsonl" in argv
    assert {"ppo-max-long", "ppo-vanilla-long", "grpo-long", "dpo-rm", "online-dpo-rm", "rrhf"} <= names
