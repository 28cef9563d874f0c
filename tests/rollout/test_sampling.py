"""`alignlit sample` and the data built from scored samples (DPO pairs, rejection-sampling SFT data)."""

from __future__ import annotations

import json

import pytest
import torch

from alignlit.cli.sample import load_scorer, main
from alignlit.data import read_records
from alignlit.data.pairs_from_rm import RankedGroup, best_of_n_records, best_worst_pairs, read_ranked
from alignlit.rollout import Rollout, SamplingParams
from alignlit.rollout.sampling import sample_ranked

PROMPTS = [
    "\n\nHuman: sort c a d\n\nAssistant:",
    "\n\nHuman: reverse a b c\n\nAssistant:",
    "\n\nHuman: copy h g f e\n\nAssistant:",
]


def _group(responses, scores, lengths=None):
    return RankedGroup("P", list(responses), list(scores), lengths)


def test_best_worst_pairs_by_hand():
    """Group 1: best 'a' (0.9), worst 'c' (0.1) -> one pair. Group 2: best and worst both 'x' -> identical.
    Group 3: scores 0.5, 0.5 -> gap 0 <= min_gap 0 -> dropped. Group 4: the blank response (score -1)
    is skipped, so the pair is 'q' (0.7) vs 'r' (0.2)."""
    groups = [
        _group(["a", "b", "c"], [0.9, 0.5, 0.1]),
        _group(["x", "x"], [0.3, 0.3]),
        _group(["u", "v"], [0.5, 0.5]),
        _group(["q", "  ", "r"], [0.7, -1.0, 0.2]),
    ]
    pairs, counts = best_worst_pairs(groups)
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("a", "c"), ("q", "r")]
    assert pairs[0]["chosen_score"] == 0.9 and pairs[0]["rejected_score"] == 0.1
    assert counts == {"kept": 2, "identical": 1, "gap": 1, "blank_responses_skipped": 1}


def test_min_gap_drops_close_pairs():
    """Gap 0.75 - 0.5 = 0.25: kept with min_gap 0.125, dropped with min_gap 0.25 (must be strictly above)."""
    group = [_group(["a", "b"], [0.75, 0.5])]
    assert best_worst_pairs(group, min_gap=0.125)[1] == {"kept": 1}
    assert best_worst_pairs(group, min_gap=0.25)[1] == {"gap": 1}


def test_length_penalty_changes_the_choice():
    """λ = 0.1: 'long' 1.0 - 0.1*8 = 0.2, 'short' 0.7 - 0.1*2 = 0.5, 'mid' 0.6 - 0.1*4 = 0.2.
    Best is 'short' (0.5); worst is the last of the tied 0.2s, 'mid'. Without the penalty best is 'long'
    (1.0) and worst 'mid' (0.6)."""
    group = [_group(["long", "short", "mid"], [1.0, 0.7, 0.6], [8, 2, 4])]
    pairs, _ = best_worst_pairs(group, length_penalty=0.1)
    assert (pairs[0]["chosen"], pairs[0]["rejected"]) == ("short", "mid")
    assert pairs[0]["chosen_score"] == pytest.approx(0.5)
    assert pairs[0]["rejected_score"] == pytest.approx(0.2)
    pairs, _ = best_worst_pairs(group)
    assert (pairs[0]["chosen"], pairs[0]["rejected"]) == ("long", "mid")
    records, _ = best_of_n_records(group, length_penalty=0.1)
    assert records == [{"prompt": "P", "response": "short", "score": pytest.approx(0.5)}]


def test_length_penalty_needs_lengths():
    with pytest.raises(ValueError, match="length penalty needs the response lengths"):
        best_worst_pairs([_group(["a", "b"], [1.0, 0.0])], length_penalty=0.1)


def test_best_of_n_records_by_hand():
    """Best per group: 'b' (0.8) and 'z' (0.3); min_score 0.5 drops the second group."""
    groups = [_group(["a", "b"], [0.2, 0.8]), _group(["z", "y"], [0.3, 0.1])]
    records, counts = best_of_n_records(groups)
    assert [r["response"] for r in records] == ["b", "z"] and counts == {"kept": 2}
    records, counts = best_of_n_records(groups, min_score=0.5)
    assert [r["response"] for r in records] == ["b"] and counts == {"kept": 1, "below_min_score": 1}


def test_ranked_record_errors_name_row_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "P", "responses": ["a", "b"], "scores": [1.0, 0.0]})
        + "\n"
        + json.dumps({"prompt": "P", "responses": ["a", "b"], "scores": [1.0]})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2, field 'scores': has 1 entries for 2 responses"):
        read_ranked(bad)
    bad.write_text(json.dumps({"prompt": "P", "responses": ["a", 3], "scores": [1.0, 0.0]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1, field 'responses': item 1 is 3"):
        read_ranked(bad)


def test_ranked_sorts_best_first():
    group = RankedGroup("P", ["a", "b", "c"], [0.1, 0.9, 0.5], [1, 2, 3]).ranked()
    assert (
        group.responses == ["b", "c", "a"] and group.scores == [0.9, 0.5, 0.1] and group.lengths == [2, 3, 1]
    )


@pytest.fixture
def sim_dir(tmp_path):
    d = tmp_path / "sim"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"task": {"ops": ["sort", "reverse", "copy"]}}))
    return d


@pytest.fixture
def prompts_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return f


def _sample(tiny_policy_dir, prompts_file, sim_dir, out, *extra):
    return main(
        [
            "--policy",
            str(tiny_policy_dir),
            "--prompts",
            str(prompts_file),
            "--n",
            "4",
            "--scorer",
            "gold",
            "--sim",
            str(sim_dir),
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
            "--out",
            str(out / "ranked.jsonl"),
            *extra,
        ]
    )


def _char_scorer(prompts, responses):
    """A stand-in reward with distinct values on random text: the number of characters."""
    return [float(len(r)) for r in responses]


def test_sample_cli_writes_ranked_pairs_and_rft(
    tmp_path, tiny_policy_dir, prompts_file, sim_dir, monkeypatch
):
    """Every row holds 4 responses sorted by their score, recomputed here from the texts; pairs and RFT
    records are exactly the best/worst and best of those rows; a second run with the same seed writes
    the same bytes. (The scorer is replaced by a character count, which varies on a random policy's
    output; the gold scorer is checked in test_gold_scorer.)"""
    monkeypatch.setattr("alignlit.cli.sample.load_scorer", lambda spec, **kwargs: _char_scorer)
    out = tmp_path / "a"
    groups = _sample(
        tiny_policy_dir,
        prompts_file,
        sim_dir,
        out,
        "--pairs",
        str(out / "pairs.jsonl"),
        "--rft",
        str(out / "rft.jsonl"),
    )
    rows = [r.fields for r in read_records(out / "ranked.jsonl")]
    assert [r["prompt"] for r in rows] == PROMPTS and len(groups) == 3
    for row in rows:
        assert len(row["responses"]) == len(row["scores"]) == len(row["lengths"]) == 4
        assert row["scores"] == _char_scorer(None, row["responses"])
        assert row["scores"] == sorted(row["scores"], reverse=True)
        assert all(1 <= n <= 6 for n in row["lengths"])  # --max-new-tokens 6

    pairs = [r.fields for r in read_records(out / "pairs.jsonl")]
    expected = [
        (row["prompt"], row["responses"][0], row["responses"][-1])
        for row in rows
        if row["responses"][0] != row["responses"][-1] and row["scores"][0] > row["scores"][-1]
    ]
    assert expected and [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == expected
    rft = [r.fields for r in read_records(out / "rft.jsonl")]
    assert [(r["prompt"], r["response"]) for r in rft] == [
        (row["prompt"], row["responses"][0]) for row in rows
    ]

    again = tmp_path / "b"
    _sample(tiny_policy_dir, prompts_file, sim_dir, again)
    assert (again / "ranked.jsonl").read_bytes() == (out / "ranked.jsonl").read_bytes()


def test_gold_scorer(sim_dir):
    """'gold' scores with the simulated task of the manifest: sort c a d -> ideal ' a c d' scores 1;
    ' a c d ok' has one word too many: 1 - 0.1 = 0.9."""
    scorer = load_scorer("gold", sim=sim_dir)
    assert scorer([PROMPTS[0]] * 2, [" a c d", " a c d ok"]) == pytest.approx([1.0, 0.9])


def test_sample_cli_unscored_and_errors(tmp_path, tiny_policy_dir, prompts_file, sim_dir):
    out = tmp_path / "unscored.jsonl"
    main(["--policy", str(tiny_policy_dir), "--prompts", str(prompts_file), "--n", "2", "--out", str(out)])
    rows = [r.fields for r in read_records(out)]
    assert len(rows) == 3 and all(len(r["responses"]) == 2 for r in rows)
    assert all(r["scores"] is None for r in rows)  # no scorer
    with pytest.raises(SystemExit):
        main(
            [
                "--policy",
                str(tiny_policy_dir),
                "--prompts",
                str(prompts_file),
                "--out",
                str(out),
                "--pairs",
                "p",
            ]
        )
    with pytest.raises(ValueError, match="--scorer gold needs --sim"):
        load_scorer("gold")
    with pytest.raises(FileNotFoundError, match="neither 'gold' nor a reward-model directory"):
        load_scorer(str(tmp_path / "missing"))


def test_sample_cli_with_a_reward_model(tmp_path, tiny_policy_dir, prompts_file, tokenizer):
    """--scorer RM_DIR: the ranked scores are the reward model's scores of the written texts."""
    from alignlit.models import export_pretrained, load_reward_model, load_scalar_model

    torch.manual_seed(0)
    rm, rm_tokenizer = load_scalar_model(tiny_policy_dir)  # a random scalar head on the tiny backbone
    rm_dir = export_pretrained(rm, rm_tokenizer, tmp_path / "rm", stage="reward")
    out = tmp_path / "ranked.jsonl"
    args = ["--policy", str(tiny_policy_dir), "--prompts", str(prompts_file), "--n", "3"]
    main(
        [
            *args,
            "--scorer",
            str(rm_dir),
            "--max-new-tokens",
            "5",
            "--out",
            str(out),
            "--rft",
            str(tmp_path / "rft.jsonl"),
        ]
    )
    rows = [r.fields for r in read_records(out)]
    expected = load_reward_model(rm_dir)
    for row in rows:
        scores = expected.score([row["prompt"]] * 3, row["responses"]).tolist()
        assert row["scores"] == pytest.approx(scores, abs=1e-6)
        assert row["scores"] == sorted(row["scores"], reverse=True)
        assert len(set(row["scores"])) > 1  # a real ranking
    rft = [r.fields["response"] for r in read_records(tmp_path / "rft.jsonl")]
    assert rft == [row["responses"][0] for row in rows]


class _FakeEngine:
    """Returns fixed texts: prompt 0 gets 'a', '', 'bb'; prompt 1 only blanks."""

    def __init__(self, tokenizer, policy, micro_batch_size=None):
        pass

    def generate(self, prompts, n, sampling):
        texts = ["a", "", "bb", "", " ", ""]
        lengths = torch.tensor([[1] * k + [0] * (3 - k) for k in (1, 1, 2, 1, 1, 1)], dtype=torch.bool)
        return Rollout(
            prompts=[p for p in prompts for _ in range(n)],
            prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
            prompt_ids=torch.zeros(6, 1, dtype=torch.long),
            prompt_mask=torch.ones(6, 1, dtype=torch.bool),
            response_ids=torch.zeros(6, 3, dtype=torch.long),
            response_mask=lengths,
            logprobs=torch.zeros(6, 3),
            texts=texts,
            finish_reasons=["stop"] * 6,
            n=n,
        )


def test_blank_samples_are_left_out_and_counted(monkeypatch):
    """Blank texts never reach the scorer and never enter a group; a prompt with only blanks gives none."""
    seen = []

    def scorer(prompts, responses):
        seen.extend(responses)
        return _char_scorer(prompts, responses)

    monkeypatch.setattr("alignlit.rollout.sampling.HFEngine", _FakeEngine)
    groups, counts = sample_ranked(None, None, ["P0", "P1"], n=3, sampling=SamplingParams(), scorer=scorer)
    assert seen == ["a", "bb"]
    assert len(groups) == 1 and groups[0].prompt == "P0"
    assert (
        groups[0].responses == ["bb", "a"] and groups[0].scores == [2.0, 1.0] and groups[0].lengths == [2, 1]
    )
    assert counts == {"blank_responses": 4, "prompts_without_response": 1}
