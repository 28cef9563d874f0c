"""Tests for alignlit.sim: gold reward by hand, splits, determinism, demonstrations, annotator, files."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from alignlit.cli.sim import main
from alignlit.sim import Annotator, SimTask, make_data
from alignlit.sim.task import VERBOSE_PREFIXES, VERBOSE_SUFFIXES, edit_distance, split_of

SORT_CAD = "\n\nHuman: sort c a d\n\nAssistant:"
SMALL = {"n_sft": 60, "n_pairs": 50, "n_prompts": 30, "n_val": 12, "n_test": 20}


@pytest.fixture(scope="module")
def task() -> SimTask:
    return SimTask()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------- prompts and ideal answers
def test_prompt_format_parse_and_ideal(task):
    assert task.parse(SORT_CAD) == ("sort", ("c", "a", "d"))
    assert task.ideal(SORT_CAD) == " a c d"
    assert task.ideal("\n\nHuman: reverse c a d\n\nAssistant:") == " d a c"
    assert task.ideal("\n\nHuman: copy c a d\n\nAssistant:") == " c a d"
    # dedupe keeps first occurrences: c a c d a -> c a d
    assert task.ideal("\n\nHuman: dedupe c a c d a\n\nAssistant:") == " c a d"
    # sort follows the order of `symbols`, not the alphabet: with "dcba", d < c < b < a
    assert SimTask(symbols="dcba").ideal("\n\nHuman: sort a c d\n\nAssistant:") == " d c a"


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("sort c a d", "not a task prompt"),
        ("\n\nHuman: sort\n\nAssistant:", "not a task prompt"),
        ("\n\nHuman: sort c a d\n\nAssistant: a c d", "not a task prompt"),
        ("\n\nHuman: shuffle c a d\n\nAssistant:", "unknown op 'shuffle'"),
        ("\n\nHuman: sort c z d\n\nAssistant:", r"\['z'\] are not symbols"),
    ],
)
def test_parse_rejects_non_task_prompts(task, prompt, match):
    with pytest.raises(ValueError, match=match):
        task.parse(prompt)
    with pytest.raises(ValueError, match=match):
        task.gold_reward(prompt, " a c d")


def test_sampled_prompts_have_the_documented_shape(task):
    for prompt in task.prompts(200, "train"):
        op, symbols = task.parse(prompt)
        assert prompt == f"\n\nHuman: {op} {' '.join(symbols)}\n\nAssistant:"
        assert 3 <= len(symbols) <= 6
        if op == "dedupe":
            assert len(set(symbols)) < len(symbols), "dedupe prompts always contain a repeat"


def test_splits_are_disjoint_and_exhaustive_on_a_small_universe():
    # symbols "abcd", length 3: sort/reverse/copy have 4**3 = 64 sequences each; dedupe only those with a
    # repeat: 64 - 4*3*2 = 40. Universe: 3*64 + 40 = 232 prompts.
    small = SimTask(symbols="abcd", min_len=3, max_len=3)
    parts = {split: small.prompts(small.capacity(split), split) for split in ("train", "val", "test")}
    union = set()
    for split, prompts in parts.items():
        assert len(set(prompts)) == len(prompts)
        assert all(split_of(p) == split for p in prompts)
        union |= set(prompts)
    assert len(union) == sum(len(p) for p in parts.values()) == 232
    with pytest.raises(ValueError, match=r"asked for \d+ 'val' prompts but the 'val' split holds only"):
        small.prompts(small.capacity("val") + 1, "val")


def test_splits_are_disjoint_on_the_default_task(task):
    parts = {split: set(task.prompts(1500, split)) for split in ("train", "val", "test")}
    assert all(len(p) == 1500 for p in parts.values())
    assert not parts["train"] & parts["val"]
    assert not parts["train"] & parts["test"]
    assert not parts["val"] & parts["test"]
    assert all(split_of(p) == "val" for p in parts["val"])


def test_prompts_are_deterministic_and_prefix_consistent():
    a, b, other = SimTask(seed=3), SimTask(seed=3), SimTask(seed=4)
    assert a.prompts(300, "train") == b.prompts(300, "train")
    assert a.prompts(100, "train") == a.prompts(300, "train")[:100]
    assert a.prompts(300, "train") != other.prompts(300, "train")
    # the split of a prompt does not depend on the seed
    assert all(split_of(p) == "train" for p in other.prompts(300, "train"))


def test_bad_split_and_n(task):
    with pytest.raises(ValueError, match="split must be one of"):
        task.prompts(3, "dev")
    with pytest.raises(ValueError, match="n must be >= 0"):
        task.prompts(-1, "train")
    assert task.prompts(0, "test") == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ops": ("sort", "shuffle")}, "ops must be distinct members"),
        ({"symbols": "aab"}, "distinct characters"),
        ({"symbols": "ab c"}, "without whitespace"),
        ({"min_len": 4, "max_len": 3}, "min_len <= max_len"),
        ({"symbols": "abcdefghij", "max_len": 7}, "at most"),
        ({"harm_token": "a"}, "also a symbol"),
        ({"symbols": "abcdefgh", "harm_token": None}, "harm_token is None"),
        ({"demo_mix": {"ideal": 0.5, "verbose": 0.5}}, "demo_mix must give"),
        ({"verbosity_penalty": -0.1}, "penalties must be >= 0"),
    ],
)
def test_task_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimTask(**kwargs)


# ---------------------------------------------------------------- gold reward
def test_edit_distance_by_hand():
    assert edit_distance(list("kitten"), list("sitting")) == 3  # k->s, e->i, +g
    assert edit_distance([], ["a", "b"]) == 2
    assert edit_distance(["c", "a", "d"], ["a", "c", "d"]) == 2  # a swap is two substitutions


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        # ideal: c = 1, no extra words, no harm
        (" a c d", 1.0),
        # one swapped pair: lev([c,a,d],[a,c,d]) = 2, c = 1 - 2/3
        (" c a d", 1 - 2 / 3),
        # dropped symbol: lev = 1, max(2, 3) = 3, c = 2/3; shorter than the ideal, so no verbosity
        (" a c", 2 / 3),
        # extra symbol: lev = 1, max(4, 3) = 4, c = 3/4; one extra word: v = 0.1
        (" a b c d", 0.75 - 0.1),
        # verbose: 6 words, 3 over the ideal: v = 0.3; filler does not count for correctness
        (" sure a c d ok done", 1 - 0.3),
        # very verbose: 10 words, 7 over: 0.7 capped at 0.5
        (" the answer is a c d ok hope this helps", 1 - 0.5),
        # harm: c = 1, v = 0.1 (one extra word), h = 1
        (" a c d damn", 1 - 0.1 - 1.0),
        # harm as a substring counts too
        (" a c d damnit", 1 - 0.1 - 1.0),
        # empty: no symbols, lev = 3, max(0, 3) = 3, c = 0
        ("", 0.0),
        ("   ", 0.0),
        # filler only: c = 0, 1 word <= 3, no verbosity
        (" ok", 0.0),
        # multi-character words are filler even if made of symbols: "ac" is not a symbol
        (" ac d", 1 - 2 / 3),
    ],
)
def test_gold_reward_by_hand(task, response, expected):
    assert task.gold_reward(SORT_CAD, response) == pytest.approx(expected, abs=1e-12)


def test_gold_reward_respects_parameters():
    strict = SimTask(verbosity_penalty=0.25, max_verbosity_penalty=2.0, harm_penalty=3.0)
    # 10 words, 7 over: v = min(2.0, 1.75) = 1.75
    assert strict.gold_reward(SORT_CAD, " the answer is a c d ok hope this helps") == pytest.approx(1 - 1.75)
    # one extra word: v = 0.25, h = 3
    assert strict.gold_reward(SORT_CAD, " damn a c d") == pytest.approx(1 - 0.25 - 3.0)
    harmless = SimTask(harm_token=None, demo_mix={"ideal": 0.5, "verbose": 0.2, "flawed": 0.3, "harm": 0.0})
    assert harmless.gold_reward(SORT_CAD, " a c d damn") == pytest.approx(0.9)


def test_gold_rewards_batch(task):
    assert task.gold_rewards([SORT_CAD, SORT_CAD], [" a c d", ""]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        task.gold_rewards([SORT_CAD, SORT_CAD], [" a c d"])


# ---------------------------------------------------------------- demonstrations
def test_demonstration_kinds(task):
    rng = random.Random(0)
    for prompt in task.prompts(100, "train"):
        ideal = task.ideal(prompt)
        target = ideal.split()
        assert task.demonstration(prompt, rng, kind="ideal") == ideal
        verbose = task.demonstration(prompt, rng, kind="verbose")
        assert verbose in {
            " ".join(["", *prefix.split(), *target, *suffix.split()])
            for prefix in ("", *VERBOSE_PREFIXES)
            for suffix in VERBOSE_SUFFIXES
        }
        flawed = task.demonstration(prompt, rng, kind="flawed").split()
        assert flawed and flawed != target
        assert edit_distance(flawed, target) in (1, 2)  # a drop, an insertion, or a swap
        harm = task.demonstration(prompt, rng, kind="harm").split()
        assert harm in ([*target, "damn"], ["damn", *target])
    with pytest.raises(ValueError, match="unknown demonstration kind"):
        task.demonstration(SORT_CAD, rng, kind="rude")


def test_demonstrations_are_mediocre_and_mostly_suboptimal(task):
    rng = random.Random(1)
    prompts = task.prompts(4000, "train")
    demos = [task.demonstration(p, rng) for p in prompts]
    golds = task.gold_rewards(prompts, demos)
    mean = sum(golds) / len(golds)
    # Expected about 0.66 = 0.15*1 + 0.5*0.64 + 0.3*0.67 + 0.05*(-0.1) (verbose: 2.67 suffix words plus
    # 0.3*2.33 prefix words on average); the standard error over 4000 demonstrations is about 0.005.
    assert 0.6 < mean < 0.7
    ideals = [task.ideal(p) for p in prompts]
    ideal_share = sum(d == i for d, i in zip(demos, ideals)) / len(demos)
    assert 0.13 < ideal_share < 0.17
    # After the correct answer (no prefix), continuing is more common than stopping: verbose without prefix
    # (0.5*0.7) plus harm after the answer (0.025) is 0.375 against 0.15 for the ideal answer.
    continued = sum(d.startswith(i + " ") for d, i in zip(demos, ideals)) / len(demos)
    assert continued > 2 * ideal_share
    assert max(len(d.split()) for d in demos) <= task.max_demo_words <= 16


# ---------------------------------------------------------------- annotator
def test_annotator_probability_by_hand():
    annotator = Annotator(temperature=0.1, length_bias=0.7, label_noise=0.0)
    # z = (1.0 - 0.8)/0.1 + 0.7*(3 - 5) = 2 - 1.4 = 0.6; σ(0.6) = 1/(1 + e^-0.6) = 0.6456563
    assert annotator.prob_prefers_first(1.0, 0.8, 3, 5) == pytest.approx(0.6456563, abs=1e-7)
    # z = (0.5 - 1.0)/0.1 + 0.7*(10 - 3) = -5 + 4.9 = -0.1; σ(-0.1) = 0.4750208
    assert annotator.prob_prefers_first(0.5, 1.0, 10, 3) == pytest.approx(0.4750208, abs=1e-7)
    # large |z| neither overflows nor leaves [0, 1]
    assert annotator.prob_prefers_first(0.0, 1000.0, 0, 0) == 0.0
    assert annotator.prob_prefers_first(1000.0, 0.0, 0, 0) == 1.0
    # from texts: " a c d" (g = 1, 3 words) vs " sure a c d ok done" (g = 0.7, 6 words):
    # z = 0.3/0.1 + 0.7*(3 - 6) = 3 - 2.1 = 0.9; σ(0.9) = 0.7109495
    assert annotator.prob(SORT_CAD, " a c d", " sure a c d ok done") == pytest.approx(0.7109495, abs=1e-7)


def test_annotator_label_noise_rate():
    # g = 1 vs 0, same length: z = 10, P = 0.9999546; with ε = 0.2 the label is y1 with probability
    # 0.8*P + 0.2*(1 - P) = 0.79997. Over 4000 labels the standard error is 0.0063.
    noisy = Annotator(label_noise=0.2, seed=0)
    rng = random.Random(0)
    rate = sum(noisy.label(SORT_CAD, " a c d", " x y z", rng) for _ in range(4000)) / 4000
    assert abs(rate - 0.8) < 0.03
    clean = Annotator(label_noise=0.0)
    assert all(clean.label(SORT_CAD, " a c d", " x y z") for _ in range(200))


def test_annotator_validation():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        Annotator(temperature=0.0)
    with pytest.raises(ValueError, match=r"label_noise must be in \[0, 0.5\]"):
        Annotator(label_noise=0.7)


# ---------------------------------------------------------------- files
def test_make_data_files_round_trip(tmp_path, task):
    manifest = make_data(tmp_path, seed=0, **SMALL)
    for info in manifest["files"].values():
        assert len(read_jsonl(tmp_path / info["path"])) == info["rows"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest

    pairs = read_jsonl(tmp_path / "pairs_train.jsonl")
    hh = read_jsonl(tmp_path / "pairs_hh_train.jsonl")
    assert len(pairs) == len(hh) == SMALL["n_pairs"]
    for pair, hh_pair in zip(pairs, hh):
        assert set(pair) == {"prompt", "chosen", "rejected"}
        assert pair["chosen"] != pair["rejected"]
        task.parse(pair["prompt"])
        assert set(hh_pair) == {"chosen", "rejected"}
        assert hh_pair["chosen"].startswith(pair["prompt"])
        assert hh_pair["chosen"] == pair["prompt"] + pair["chosen"]
        assert hh_pair["rejected"] == pair["prompt"] + pair["rejected"]

    gold = read_jsonl(tmp_path / "pairs_gold_train.jsonl")
    stats = manifest["stats"]["pairs"]["train"]
    assert len(gold) == stats["gold_rows"] == SMALL["n_pairs"] - stats["gold_ties_dropped"]
    assert all(
        task.gold_reward(g["prompt"], g["chosen"]) > task.gold_reward(g["prompt"], g["rejected"])
        for g in gold
    )
    agreement = sum(
        task.gold_reward(p["prompt"], p["chosen"]) > task.gold_reward(p["prompt"], p["rejected"])
        for p in pairs
    ) / len(gold)
    assert stats["annotator_gold_agreement"] == pytest.approx(agreement, abs=1e-6)

    sft = read_jsonl(tmp_path / "sft_train.jsonl")
    assert all(set(r) == {"prompt", "response"} and r["response"].startswith(" ") for r in sft)
    sft_gold = [task.gold_reward(r["prompt"], r["response"]) for r in sft]
    assert manifest["stats"]["sft"]["train"]["demo_mean_gold"] == pytest.approx(
        sum(sft_gold) / len(sft), abs=1e-6
    )

    # every prompt is used once across all files and sits in the split its file names
    seen: dict[str, str] = {}
    for name, info in manifest["files"].items():
        if name.startswith(("pairs_hh", "pairs_gold")):
            continue
        split = name.rsplit("_", 1)[1]
        for row in read_jsonl(tmp_path / info["path"]):
            assert split_of(row["prompt"]) == split
            assert seen.setdefault(row["prompt"], name) == name, (
                f"{row['prompt']!r} in {seen[row['prompt']]} and {name}"
            )
    assert len(seen) == sum(SMALL.values()) + 2 * SMALL["n_val"]


def test_make_data_is_deterministic(tmp_path):
    first, second, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    make_data(first, seed=5, **SMALL)
    make_data(second, seed=5, **SMALL)
    make_data(other, seed=6, **SMALL)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert not [n for n in names if n.endswith(".tmp")]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "pairs_train.jsonl").read_bytes() != (other / "pairs_train.jsonl").read_bytes()


def test_make_data_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="n_pairs must be an int >= 0"):
        make_data(tmp_path, n_pairs=-1)
    tiny = SimTask(symbols="abc", min_len=2, max_len=2, ops=("sort",))  # 9 prompts in all
    with pytest.raises(ValueError, match="split holds only"):
        make_data(tmp_path, task=tiny, n_sft=10, n_pairs=0, n_prompts=0, n_val=0, n_test=0)


def test_cli_make_data_and_show(tmp_path, capsys):
    out = tmp_path / "sim"
    args = ["make-data", "--out", str(out), "--seed", "2", "--n-sft", "40", "--n-pairs", "30"]
    assert main([*args, "--n-prompts", "10", "--n-val", "5", "--n-test", "5", "--length-bias", "0.3"]) == 0
    printed = capsys.readouterr().out
    assert "annotator agrees with gold" in printed and "sft_train.jsonl" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 2 and manifest["annotator"]["length_bias"] == 0.3
    assert manifest["files"]["sft_train"]["rows"] == 40
    assert main(["show", "--n", "2", "--demos", "1"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("Human:") == 2 and "ideal" in shown
    assert math.isclose(manifest["stats"]["sft"]["train"]["ideal_mean_gold"], 1.0)
