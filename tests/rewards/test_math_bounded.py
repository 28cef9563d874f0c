"""MathVerifyReward: golds from the prompts' ``answer`` column or an answers file, load-time errors that name
the row, what "equal" means (10,000-digit numbers, Unicode digits, intervals), the format bonus, real GSM8K
rows, and the bounded worker's failure policy (errors and crashes scored, counted, named)."""

from __future__ import annotations

import gzip
import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("math_verify")

from alignlit.data import Prompt
from alignlit.data.records import DataError
from alignlit.rewards import verify_pool
from alignlit.rewards._verify_worker import final_answer, normalize_digits
from alignlit.rewards.math import MathVerifyReward, gold_answer, has_final_answer_format
from alignlit.rollout.reward_protocol import score_texts
from tests.helpers import write_jsonl

GSM8K = Path("/work/shared/data/gsm8k/test.jsonl.gz")


@pytest.fixture(scope="module")
def reward():
    with MathVerifyReward(timeout_s=5.0) as r:
        yield r


def test_gold_answer_reduces_gsm8k_solutions():
    assert gold_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert gold_answer("... #### 1,234,567") == "1234567"
    assert gold_answer("#### -3.5") == "-3.5"
    assert gold_answer("\\frac{1}{2}") == "\\frac{1}{2}"
    assert gold_answer(72) == "72"
    assert gold_answer("#### ٧٢") == "72"
    for bad in ("####", "reasoning ... ####   ", "   "):
        with pytest.raises(DataError, match="where I was"):
            gold_answer(bad, "where I was")


def test_answer_column_through_score_texts(reward):
    prompts = [
        Prompt("q1", fields={"answer": "... #### 72"}, source="gsm.jsonl:1"),
        Prompt("q2", fields={"answer": "\\frac{1}{2}"}, source="gsm.jsonl:2"),
        Prompt("q1", fields={"answer": "... #### 72"}, source="gsm.jsonl:1"),
    ]
    got = score_texts(reward, prompts, ["so it is 72", "$\\boxed{0.5}$", "70"])
    assert got.tolist() == [1.0, 1.0, 0.0]
    # the kwarg itself, with plain strings: the row number names a bad gold
    assert reward(["a", "b"], ["18", "\\boxed{19}"], answer=["#### 18", "#### 18"]).tolist() == [1.0, 0.0]
    with pytest.raises(DataError, match=r"row 1, column 'answer'.*nothing after '####'"):
        reward(["a", "b"], ["1", "2"], answer=["#### 1", "####"])
    bad = [Prompt("q", fields={"answer": "####"}, source="gsm.jsonl:7")]
    with pytest.raises(DataError, match=r"gsm.jsonl:7, column 'answer'.*nothing after '####'"):
        score_texts(reward, bad, ["1"])


def test_answers_file_and_mapping(tmp_path, reward):
    path = write_jsonl(
        tmp_path / "gold.jsonl",
        [
            {"prompt": "q1", "answer": "#### 72"},
            {"prompt": "q2", "answer": 5},
            {"prompt": "q1", "answer": "other reasoning #### 72"},  # same gold again: fine
        ],
    )
    from_file = MathVerifyReward(answers_file=str(path))
    assert from_file.answers == {"q1": "72", "q2": "5"} and from_file.sources["q1"].endswith("gold.jsonl:1")
    from_file._pool = reward.pool  # share the warm worker
    assert from_file(["q1", "q2", "q2"], ["#### 72", "\\boxed{5}", "6"]).tolist() == [1.0, 1.0, 0.0]
    mapping = MathVerifyReward(answers={"q1": "#### 72", "q2": "\\frac{1}{2}"})
    mapping._pool = reward.pool
    assert mapping(["q1", "q2", "q1"], ["it is 72", "$\\boxed{0.5}$", "70"]).tolist() == [1.0, 1.0, 0.0]
    # the answer column wins over the file when the prompts carry it
    assert from_file(["q1"], ["5"], answer=["#### 5"]).tolist() == [1.0]
    with pytest.raises(ValueError, match="at most one"):
        MathVerifyReward(answers_file=str(path), answers={})


def test_answers_file_errors_name_file_row_and_field(tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "2"}]
    )
    with pytest.raises(DataError, match=r"a.jsonl:2, field 'prompt': missing"):
        MathVerifyReward(answers_file=str(path))
    path = write_jsonl(
        tmp_path / "b.jsonl", [{"prompt": "q1", "answer": "#### 1"}, {"prompt": "q2", "gold": "2"}]
    )
    with pytest.raises(DataError, match=r"b.jsonl:2, field 'answer': missing: no gold answer"):
        MathVerifyReward(answers_file=str(path))
    path = write_jsonl(
        tmp_path / "c.jsonl", [{"prompt": "q1", "answer": "#### 1"}, {"prompt": "q2", "answer": "... ####"}]
    )
    with pytest.raises(DataError, match=r"c.jsonl:2, field 'answer'.*nothing after '####'"):
        MathVerifyReward(answers_file=str(path))
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "q1", "answer": "#### 1"},
            {"prompt": "q2", "answer": "#### 2"},
            {"prompt": "q1", "answer": "#### 3"},
        ],
    )
    with pytest.raises(
        DataError, match=r"two different gold answers: '1' at .*d.jsonl:1 and '3' at .*d.jsonl:3"
    ):
        MathVerifyReward(answers_file=str(path))


def test_no_gold_error_says_what_to_do(tmp_path):
    neither = MathVerifyReward()
    with pytest.raises(
        DataError, match=r"no gold answer for prompt row 0 \('what is 2\+2\?'\).*`answer` column"
    ):
        neither(["what is 2+2?"], ["4"])
    path = write_jsonl(tmp_path / "gold.jsonl", [{"prompt": "the whole question, long", "answer": "#### 4"}])
    truncated = MathVerifyReward(answers_file=str(path))
    with pytest.raises(
        DataError, match=r"row 1 .*truncated \(max_prompt_length\).*1 prompts in .*gold.jsonl"
    ):
        truncated(["the whole question, long", "the whole question"], ["4", "4"])


def test_unreadable_gold_is_an_error_naming_the_row(reward):
    with pytest.raises(
        DataError, match=r"gsm.jsonl:3, column 'answer': math-verify cannot read the gold answer"
    ):
        score_texts(reward, [Prompt("q", fields={"answer": "\\frac{"}, source="gsm.jsonl:3")], ["1"])


def test_ten_thousand_digit_answers(reward):
    big = "".join(str((i * 7 + 3) % 10) for i in range(10_000))
    other = big[:-1] + str((int(big[-1]) + 1) % 10)
    responses = [f"so \\boxed{{{big}}}", f"...\n#### {big}", big, f"\\boxed{{{other}}}", other]
    got = reward(["q"] * 5, responses, answer=[f"#### {big}"] * 5)
    assert got.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_unicode_digits(reward):
    assert normalize_digits("٧٢ ７２ ७२ x²") == "72 72 72 x²"
    responses = ["٧٢", "７２", "\\boxed{٧٢}", "the answer is ७२", "٧٣"]
    assert reward(["q"] * 5, responses, answer=["#### 72"] * 5).tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert reward(["q"], ["72"], answer=["#### ٧٢"]).tolist() == [1.0]


def test_intervals_and_tuples(reward):
    responses = ["(1,2)", "(1, 2)", "$\\boxed{(1,2)}$", "$[1,2]$", "(2,1)"]
    assert reward(["q"] * 5, responses, answer=["(1,2)"] * 5).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_what_is_extracted_from_responses(reward):
    assert final_answer("a \\boxed{3} then \\boxed{\\frac{1}{2}}.") == ("boxed", "\\frac{1}{2}")
    assert final_answer("work\n#### 18\n") == ("hashes", "18")
    assert final_answer("so the answer is 18.") is None  # math-verify's extraction decides
    responses = [
        "...so the answer is 18.",  # "the answer is" found by math-verify
        "#### 18",
        "She had 3 + 4 = 7, then 7 + 11 = 18.",  # the last number
        "The answer is 17, not 18",  # math-verify prefers "the answer is": 17
        "\\boxed{18} at first, then \\boxed{17}",  # the last box
        "#### 1,8",  # not a thousands separator
    ]
    assert reward(["q"] * 6, responses, answer=["#### 18"] * 6).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_format_bonus(reward):
    assert has_final_answer_format("so \\boxed{18}.") and has_final_answer_format("work\n#### 18\n")
    assert has_final_answer_format("$\\boxed{\\frac{1}{2}}$")
    assert not has_final_answer_format("\\boxed{18} is it, I think") and not has_final_answer_format("18")
    shaped = MathVerifyReward(format_weight=0.25)
    shaped._pool = reward.pool
    got = shaped(["q"] * 4, ["\\boxed{18}", "18", "\\boxed{17}", "#### 18"], answer=["#### 18"] * 4)
    assert got.tolist() == [1.25, 1.0, 0.25, 1.25]


@pytest.mark.skipif(not GSM8K.exists(), reason="GSM8K test split not in /work/shared")
def test_gsm8k_gold_solutions_score_their_own_answer(reward):
    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(50), f)]
    prompts = [
        Prompt(r["question"], fields={"answer": r["answer"]}, source=f"test.jsonl:{i + 1}")
        for i, r in enumerate(rows)
    ]
    solutions = [r["answer"] for r in rows]
    assert score_texts(reward, prompts, solutions).tolist() == [1.0] * 50
    numbers = [int(r["answer"].rsplit("####", 1)[1].strip().replace(",", "")) for r in rows]
    boxed = [
        f"{s.rsplit('####', 1)[0]}So the answer is $\\boxed{{{n}}}$." for s, n in zip(solutions, numbers)
    ]
    assert score_texts(reward, prompts, boxed).tolist() == [1.0] * 50
    wrong = [f"{s.rsplit('####', 1)[0]}#### {n + 1}" for s, n in zip(solutions, numbers)]
    assert score_texts(reward, prompts, wrong).tolist() == [0.0] * 50


def test_pickled_reward_restarts_its_pool(reward):
    reward(["q"], ["1"], answer=["2"])  # a started pool
    again = pickle.loads(pickle.dumps(reward))
    assert again._pool is None and again.counts == reward.counts
    try:
        assert again(["q", "q"], ["\\boxed{2}", "3"], answer=["2", "2"]).tolist() == [1.0, 0.0]
    finally:
        again.close()


SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("worker", {worker!r})
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
check = worker.check
def raising(mv, gold, response, golds=None):
    if response == "RAISE":
        raise ZeroDivisionError("injected")
    if response == "DIE":
        import os
        os._exit(3)
    return check(mv, gold, response, golds)
worker.check = raising
worker._serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
"""


def test_a_failing_sample_is_scored_counted_and_named(tmp_path, monkeypatch, caplog):
    """A check that raises, and one that kills its worker: each scores error_score, is counted and logged
    with its row; the other samples of the batch are scored as usual."""
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT.format(worker=str(verify_pool.WORKER)))
    monkeypatch.setattr(verify_pool, "WORKER", script)
    r = MathVerifyReward(error_score=-1.0)
    prompts = [Prompt("q", fields={"answer": "#### 5"}, source=f"f.jsonl:{i}") for i in range(5)]
    try:
        with caplog.at_level(logging.WARNING, logger="alignlit.rewards.math"):
            got = score_texts(r, prompts, ["\\boxed{5}1", "RAISE", "6", "DIE", "so 5"])
    finally:
        r.close()
    assert torch.equal(got, torch.tensor([1.0, -1.0, 0.0, -1.0, 1.0]))
    assert r.counts["errors"] == 1 and r.counts["crashes"] == 1
    assert r.metrics()["math_verify/errors"] == 1.0 and r.metrics()["math_verify/crashes"] == 1.0
    text = caplog.text
    assert "f.jsonl:1" in text and "ZeroDivisionError: injected" in text and "f.jsonl:3" in text


def test_a_forked_child_starts_its_own_workers(reward):
    """A forked process (a DataLoader worker) must not share its parent's worker pipes: it starts its own
    and leaves the parent's running."""
    reward(["q"], ["so 3"], answer=["3"])
    parent_pids = [w.proc.pid for w in reward.pool._workers]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            got = reward(["q", "q"], ["so 5", "so 6"], answer=["5", "5"]).tolist()
            own = [w.proc.pid for w in reward.pool._workers]
            os.write(write, json.dumps([got, not set(own) & set(parent_pids)]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        got, own_workers = json.loads(f.read())
    os.waitpid(pid, 0)
    assert got == [1.0, 0.0] and own_workers
    assert [w.proc.pid for w in reward.pool._workers] == parent_pids
    assert reward(["q"], ["so 7"], answer=["7"]).tolist() == [1.0]
