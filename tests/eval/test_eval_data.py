"""``alignlit eval`` on real prompts: the reference answer reaches the reward row for row, pass@k by hand."""

from __future__ import annotations

import gzip
import json

import pytest

from alignlit.cli import main as alignlit
from alignlit.eval.verifiable import pass_at_k
from tests.hubcache import GSM8K_TRAIN, snapshot_dir

GSM8K_TEST = GSM8K_TRAIN.with_name("test.jsonl.gz")


def even_answer(prompts, responses, answer):
    """1.0 when the prompt's GSM8K answer is even: depends only on the answer each prompt carries."""
    return [float(int(a.rsplit("####", 1)[1].replace(",", "")) % 2 == 0) for a in answer]


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_eval_on_gsm8k_wires_answers(hub_cache, tmp_path, capsys):
    with gzip.open(GSM8K_TEST, "rt") as f:
        rows = [json.loads(next(f)) for _ in range(6)]
    even = [int(r["answer"].rsplit("####", 1)[1].replace(",", "")) % 2 == 0 for r in rows]
    out = tmp_path / "eval.json"
    policy = str(snapshot_dir(hub_cache))
    results = alignlit(
        ["eval", "--policy", policy, "--name", "tiny", "--prompts", str(GSM8K_TEST), "--n-prompts", "6",
         "--columns", "question:prompt", "--chat", "--system-prompt", "Answer after ####.",
         "--reward", "tests.eval.test_eval_data.even_answer", "--max-new-tokens", "4", "--samples", "2",
         "--reference", policy, "--json", str(out), "--no-progress"]
    )  # fmt: skip
    (row,) = results
    assert row.prompts == 6
    assert row.accuracy == pytest.approx(sum(even) / 6)
    assert row.mean_at_k == pytest.approx(sum(even) / 6) and row.pass_at_k == pytest.approx(sum(even) / 6)
    assert row.kl_to_reference == pytest.approx(0.0, abs=1e-5)  # the policy is its own reference
    assert 0 < row.length <= 4
    saved = json.loads(out.read_text())
    assert saved["prompts"] == 6 and saved["results"][0]["accuracy"] == pytest.approx(sum(even) / 6)
    table = capsys.readouterr().out
    assert "| tiny | 6 |" in table and "pass@2" in table


def test_eval_refuses_bad_arguments(hub_cache, capsys):
    policy = str(snapshot_dir(hub_cache))
    with pytest.raises(SystemExit):
        alignlit(
            ["eval", "--policy", policy, "--prompts", str(GSM8K_TEST), "--reward", "x.y", "--columns", "bad"]
        )
    with pytest.raises(SystemExit):
        alignlit(["eval", "--policy", policy, "--prompts", str(GSM8K_TEST), "--reward", "no.such.reward"])
    assert "cannot be imported" in capsys.readouterr().err


def test_sample_renders_chat_prompts_and_passes_answers(hub_cache, tmp_path):
    """alignlit sample --chat: the prompts are rendered as training renders them, and a scorer that names the
    answer column gets each prompt's GSM8K answer."""
    with gzip.open(GSM8K_TEST, "rt") as f:
        rows = [json.loads(next(f)) for _ in range(3)]
    even = [float(int(r["answer"].rsplit("####", 1)[1].replace(",", "")) % 2 == 0) for r in rows]
    out = tmp_path / "ranked.jsonl"
    groups = alignlit(
        ["sample", "--policy", str(snapshot_dir(hub_cache)), "--prompts", str(GSM8K_TEST), "--max-prompts", "3",
         "--columns", "question:prompt", "--chat", "--system-prompt", "Answer after ####.", "--n", "2",
         "--max-new-tokens", "3", "--scorer", "tests.eval.test_eval_data.even_answer", "--out", str(out),
         "--no-progress"]
    )  # fmt: skip
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g.scores for g in groups] == [[e, e] for e in even]
    for row, w in zip(rows, written):
        assert w["prompt"].startswith("<|im_start|>system\nAnswer after ####.<|im_end|>\n<|im_start|>user\n")
        assert row["question"] in w["prompt"] and w["prompt"].endswith("<|im_start|>assistant\n")
