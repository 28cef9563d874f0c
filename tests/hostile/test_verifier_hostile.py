"""Hostile answers against the math reward: inputs on which math-verify never returns (``10^{10^{10}}``,
``9^{9^{9^{9}}}`` against ``1``), deep nesting, huge unbalanced responses, lone surrogates, a worker killed
mid-sample, and calls from a non-main thread. Each call runs in a thread joined with a deadline of our
own (and a faulthandler watchdog for hangs that hold the GIL), so a regression fails instead of hanging CI."""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time

import pytest

pytest.importorskip("math_verify")

from alignlit.data.records import DataError
from alignlit.rewards._verify_worker import boxed_span, final_answer
from alignlit.rewards.math import MathVerifyReward, math_verify_score

TIMEOUT_S = 2.0
SLACK_S = 30.0  # a replacement worker's start-up (importing sympy) on a loaded 2-core machine

HANGING = ["\\boxed{10^{10^{10}}}", "\\boxed{9^{9^{9^{9}}}}"]


def bounded(fn, limit_s: float):
    """``fn()``'s result, run in a daemon thread; fails the test if it is not back within ``limit_s``."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    # a hang that holds the GIL (math-verify's bigint powers) also blocks join(): faulthandler's C watchdog
    # then ends the process with every thread's traceback, so CI fails instead of hanging
    faulthandler.dump_traceback_later(limit_s + 15, exit=True)
    try:
        thread.start()
        thread.join(limit_s)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if thread.is_alive():
        pytest.fail(f"the math reward did not return within {limit_s:.0f} s (it hangs)")
    if "error" in out:
        raise out["error"]
    return out["value"], time.monotonic() - start


@pytest.fixture
def reward():
    r = MathVerifyReward(timeout_s=TIMEOUT_S, timeout_score=-0.5)
    bounded(lambda: r(["warm-up"], ["\\boxed{2.0}"], answer=["2"]), 120)  # the worker started
    yield r
    r.close()


@pytest.mark.parametrize("response", HANGING)
def test_a_never_ending_check_times_out(reward, response):
    got, took = bounded(lambda: reward(["q"], [response], answer=["#### 1"]), TIMEOUT_S + SLACK_S)
    assert got.tolist() == [-0.5] and took < TIMEOUT_S + SLACK_S
    assert reward.counts["timeouts"] == 1 and reward.metrics()["math_verify/timeouts"] == 1.0


def test_hanging_samples_in_a_batch_do_not_take_the_others_down(reward):
    responses = ["\\boxed{1}", HANGING[0], "1", "\\boxed{2}", HANGING[1], "so the answer is 1"]
    got, _ = bounded(lambda: reward(["q"] * 6, responses, answer=["1"] * 6), 2 * (TIMEOUT_S + SLACK_S))
    assert got.tolist() == [1.0, -0.5, 1.0, 0.0, -0.5, 1.0]
    assert reward.counts["timeouts"] == 2
    # the pool still works after replacing the killed workers
    again, _ = bounded(lambda: reward(["q"], ["the answer: 3"], answer=["3"]), SLACK_S)
    assert again.tolist() == [1.0]


def test_module_function_is_bounded_too():
    """``math_verify_score`` (what the old API hung in) shares one bounded worker: it returns 0.0."""
    got, _ = bounded(lambda: math_verify_score("#### 1", HANGING[0]), 5.0 + 2 * SLACK_S)
    assert got == 0.0


def test_a_call_from_a_non_main_thread(reward):
    """The asynchronous producer scores in its own thread: no signal-based timeouts are involved."""
    got, _ = bounded(lambda: reward(["q", "q"], [HANGING[1], "\\boxed{7}"], answer=["1", "7"]), 2 * SLACK_S)
    assert got.tolist() == [-0.5, 1.0]


def test_huge_and_malformed_responses(reward):
    unbalanced = "\\boxed{" * 200_000
    start = time.monotonic()
    assert final_answer(unbalanced) is None and boxed_span(unbalanced + "}") is not None
    assert time.monotonic() - start < 5.0  # the scan in the training process is linear, not quadratic
    nested = "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}"  # math-verify takes about a minute: cut off
    responses = [unbalanced, nested, "\ud800 lone surrogate 5", "\x00\x00 5", "", "5" * 100_000]
    got, _ = bounded(lambda: reward(["q"] * 6, responses, answer=["5"] * 6), 3 * (TIMEOUT_S + SLACK_S))
    scores = got.tolist()
    # math-verify on 1.4 MB of unbalanced boxes: wrong (0.0) or cut off (-0.5), never a hang
    assert scores[0] in (0.0, -0.5) and scores[1] == -0.5 and scores[4] == 0.0 and scores[5] == 0.0
    assert scores[2] == 1.0 and scores[3] == 1.0


def test_a_worker_killed_mid_sample_is_a_counted_crash(reward, caplog):
    def kill_soon():
        time.sleep(0.5)
        for w in list(reward.pool._workers):
            if w.task is not None:
                os.kill(w.proc.pid, 9)

    killer = threading.Thread(target=kill_soon, daemon=True)
    reward.timeout_s = reward.pool.timeout_s = 60.0  # the kill, not the deadline, ends the sample
    killer.start()
    got, took = bounded(lambda: reward(["q", "q"], [HANGING[0], "\\boxed{1}x"], answer=["1", "1"]), 60.0)
    assert got.tolist() == [0.0, 1.0] and took < 50.0
    assert reward.counts["crashes"] == 1 and "row 0" in caplog.text and "crash" in caplog.text


# issue 36, "Silent wrong results" item 5 and the unclear errors about the math reward, as a user meets them


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_a_gold_of_bare_hashes_is_a_load_error_naming_the_row(tmp_path):
    path = write_jsonl(
        tmp_path / "g.jsonl", [{"prompt": "a", "answer": "#### 3"}, {"prompt": "b", "answer": "####"}]
    )
    with pytest.raises(DataError, match=r"g.jsonl:2, field 'answer'.*nothing after '####'"):
        MathVerifyReward(answers_file=path)


def test_a_duplicate_prompt_with_another_gold_is_refused(tmp_path):
    rows = [{"prompt": "a", "answer": "#### 3"}, {"prompt": "a", "answer": "#### 4"}]
    with pytest.raises(
        DataError, match=r"two different gold answers: '3' at .*g.jsonl:1 and '4' at .*g.jsonl:2"
    ):
        MathVerifyReward(answers_file=write_jsonl(tmp_path / "g.jsonl", rows))


def test_an_answers_file_without_the_prompt_field(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "a", "answer": "#### 3"}])
    with pytest.raises(DataError, match=r"g.jsonl:1, field 'prompt': missing"):
        MathVerifyReward(answers_file=path)


def test_a_truncated_prompt_says_truncation_may_be_why(tmp_path):
    path = write_jsonl(
        tmp_path / "g.jsonl", [{"prompt": "Janet's ducks lay 16 eggs per day.", "answer": "#### 18"}]
    )
    with pytest.raises(DataError, match=r"no gold answer for prompt row 0 .*truncated \(max_prompt_length\)"):
        MathVerifyReward(answers_file=path)(["ducks lay 16 eggs per day."], ["18"])


def test_equal_answers_that_scored_zero(reward):
    big = "9" * 10_000
    responses = [f"\\boxed{{{big}}}", "٧٢", "７２", "(1,2)", "$(1,2)$"]
    golds = [f"#### {big}", "#### 72", "#### 72", "(1,2)", "(1,2)"]
    got, _ = bounded(lambda: reward(["q"] * 5, responses, answer=golds), 2 * SLACK_S)
    assert got.tolist() == [1.0] * 5
