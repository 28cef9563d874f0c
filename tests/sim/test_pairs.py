"""alignlit.sim.pairs: extra demonstration pairs and annotator-labelled pairs of a policy's samples."""

from __future__ import annotations

import hashlib
import json

import pytest

from alignlit.sim import Annotator, SimTask, make_data
from alignlit.sim.pairs import label_samples, make_extra_pairs
from alignlit.sim.task import split_of

SMALL = {"n_sft": 40, "n_pairs": 30, "n_prompts": 20, "n_val": 8, "n_test": 10}


def read_jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.fixture
def clean_sim(tmp_path):
    """A data set labelled by a noise-free, length-blind, decisive annotator: labels are gold's order."""
    task = SimTask(seed=0)
    make_data(tmp_path, seed=0, task=task, annotator=Annotator(0.001, 0.0, 0.0, task=task), **SMALL)
    return tmp_path, task


def digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*"))}


def test_extra_pairs_use_new_training_prompts_and_leave_files_unchanged(clean_sim):
    """The extra pairs' prompts are the next training prompts of the same seeded order (none of them in
    any make-data file), every label is gold's order (the annotator of the manifest), the make-data
    files are untouched, and the same call writes the same bytes."""
    sim, task = clean_sim
    before = digests(sim)
    stats = make_extra_pairs(sim, 25, seed=3)
    out = sim / "pairs_extra_train.jsonl"
    rows = read_jsonl(out)
    assert len(rows) == stats["rows"] == 25 and stats["prompts_offset"] == 40 + 30 + 20
    assert [r["prompt"] for r in rows] == task.prompts(115, "train")[90:]
    used = {
        r["prompt"]
        for name in ("sft_train", "pairs_train", "prompts_train")
        for r in read_jsonl(sim / f"{name}.jsonl")
    }
    assert not used & {r["prompt"] for r in rows}
    for r in rows:
        assert r["chosen"] != r["rejected"]
        assert task.gold_reward(r["prompt"], r["chosen"]) >= task.gold_reward(r["prompt"], r["rejected"])
    assert stats["annotator_gold_agreement"] == 1.0
    after = digests(sim)
    assert {k: v for k, v in after.items() if k in before} == before
    first = out.read_bytes()
    make_extra_pairs(sim, 25, seed=3)
    assert out.read_bytes() == first
    make_extra_pairs(sim, 25, seed=4)
    assert out.read_bytes() != first
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        make_extra_pairs(sim, 0)


def test_label_samples_pairs_distinct_responses_and_refuses_held_out_prompts(clean_sim, tmp_path):
    """Responses (0, 1), (2, 3) of the distinct non-empty ones become pairs, ordered by the manifest's
    annotator (gold's order here); a prompt with one distinct response gives none; a validation prompt
    is refused with its file and line."""
    sim, task = clean_sim
    p1, p2 = task.prompts(2, "train")
    ideal1 = task.ideal(p1)
    samples = tmp_path / "samples.jsonl"
    rows = [
        {"prompt": p1, "responses": [ideal1 + " ok done", ideal1, ideal1, " ", " damn" + ideal1, " a"]},
        {"prompt": p2, "responses": [task.ideal(p2)] * 3},
    ]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "pairs.jsonl"
    stats = label_samples(sim, samples, out, pairs_per_prompt=2)
    got = read_jsonl(out)
    assert got == [
        {"prompt": p1, "chosen": ideal1, "rejected": ideal1 + " ok done"},
        {"prompt": p1, "chosen": " a", "rejected": " damn" + ideal1}
        if task.gold_reward(p1, " a") > task.gold_reward(p1, " damn" + ideal1)
        else {"prompt": p1, "chosen": " damn" + ideal1, "rejected": " a"},
    ]
    assert stats["prompts_without_pair"] == 1 and stats["rows"] == 2
    assert len(read_jsonl(out)) == 2 and (tmp_path / "pairs.stats.json").exists()
    assert len(label_samples(sim, samples, out, pairs_per_prompt=1) and read_jsonl(out)) == 1

    make_extra_pairs(sim, 5)
    extra = read_jsonl(sim / "pairs_extra_train.jsonl")
    stats = label_samples(sim, samples, out, pairs_per_prompt=2, include=[sim / "pairs_extra_train.jsonl"])
    assert read_jsonl(out) == extra + got and stats["included_rows"] == 5 and stats["rows"] == 2

    val_prompt = task.prompts(1, "val")[0]
    assert split_of(val_prompt) == "val"
    samples.write_text(json.dumps({"prompt": val_prompt, "responses": [" a", " b"]}) + "\n")
    with pytest.raises(ValueError, match=r"samples\.jsonl:1: prompt .* is in the 'val' split"):
        label_samples(sim, samples, out)


def test_cli_make_pairs_and_label_samples(clean_sim, tmp_path, capsys):
    """`alignlit sim make-pairs` writes what make_extra_pairs writes (same bytes for the same seed);
    `alignlit sim label-samples --include` puts the included file's rows first and reports both counts."""
    from alignlit.cli.sim import main

    sim, task = clean_sim
    assert main(["make-pairs", "--sim", str(sim), "--n", "6", "--out", str(tmp_path / "cli.jsonl")]) == 0
    assert "wrote" in capsys.readouterr().out and len(read_jsonl(tmp_path / "cli.jsonl")) == 6
    make_extra_pairs(sim, 6, out=tmp_path / "api.jsonl")  # the CLI's default seed is the function's
    assert (tmp_path / "cli.jsonl").read_bytes() == (tmp_path / "api.jsonl").read_bytes()

    p = task.prompts(1, "train")[0]
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"prompt": p, "responses": [task.ideal(p), task.ideal(p) + " ok"]}) + "\n")
    argv = ["label-samples", "--sim", str(sim), "--samples", str(samples), "--out", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--include", str(tmp_path / "cli.jsonl")]) == 0
    assert "1 labelled pairs after 6 included ones" in capsys.readouterr().out
    rows = read_jsonl(tmp_path / "o.jsonl")
    assert rows[:6] == read_jsonl(tmp_path / "cli.jsonl")
    assert rows[6] == {"prompt": p, "chosen": task.ideal(p), "rejected": task.ideal(p) + " ok"}
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": p, "chosen": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected \{'prompt', 'chosen', 'rejected'\}"):
        main([*argv, "--include", str(tmp_path / "bad.jsonl")])
