"""JudgeReward against a local stand-in OpenAI-compatible server on 127.0.0.1 (bounded, stops itself):
scores parsed and normalised, columns in the template, concurrency, caching, retries, malformed answers
under both failure policies, auth header, and the reward through score_texts with Prompt columns."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from alignlit.data import Prompt
from alignlit.rewards.judge import JudgeError, JudgeReward
from alignlit.rollout.reward_protocol import score_texts


class Judge(BaseHTTPRequestHandler):
    """Answers by what the graded text contains: 'good' -> Score: 9, 'bad' -> Score: 2, 'junk' -> no score,
    'huge' -> Score: 99 (out of range), 'flaky' -> HTTP 503 on its first try, 'slow' -> sleeps 2 s."""

    state: ClassVar[dict] = {"requests": 0, "inflight": 0, "max_inflight": 0, "flaky_seen": set(), "auth": []}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][-1]["content"]
        st = self.state
        with self.lock:
            st["requests"] += 1
            st["inflight"] += 1
            st["max_inflight"] = max(st["max_inflight"], st["inflight"])
            st["auth"].append(self.headers.get("Authorization"))
        try:
            time.sleep(0.05)
            if "slow" in text:
                time.sleep(2.0)
        finally:
            with self.lock:  # done before answering: the client's next request cannot overlap this one
                st["inflight"] -= 1
        if "flaky" in text and text not in st["flaky_seen"]:
            st["flaky_seen"].add(text)
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"busy")
            return
        answer = (
            "Reasoning... Score: 9" if "good" in text else "Score: 2 (bad)" if "bad" in text
            else "Score: 99" if "huge" in text else "I cannot grade this." if "junk" in text else "Score: 5"
        )  # fmt: skip
        if "ref=" in text:
            answer = f"Score: {text.split('ref=')[1][0]}"
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def server():
    Judge.state.update(requests=0, inflight=0, max_inflight=0, flaky_seen=set(), auth=[])
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_scores_concurrency_cache_and_auth(server):
    judge = JudgeReward(server, "m", template="Grade: {response}", max_concurrency=4, api_key="k1")
    responses = ["good one", "bad one", "meh", "good one"] * 2
    scores = judge(["p"] * 8, responses)
    assert scores == [0.9, 0.2, 0.5, 0.9] * 2
    assert Judge.state["requests"] <= 8 and judge.counts["requests"] + judge.counts["cache_hits"] == 8
    assert 2 <= Judge.state["max_inflight"] <= 4
    assert set(Judge.state["auth"]) == {"Bearer k1"}
    before = Judge.state["requests"]
    assert judge(["p"], ["good one"]) == [0.9] and Judge.state["requests"] == before  # cached
    assert judge.last_answers == ["Reasoning... Score: 9"]


def test_columns_reach_the_template_through_score_texts(server):
    judge = JudgeReward(server, "m", template="Q {prompt} ref={answer} A {response}", normalize=False)
    prompts = [Prompt("q1", fields={"answer": "7"}), Prompt("q2", fields={"answer": "3"})]
    assert score_texts(judge, prompts, ["x", "y"]).tolist() == [7.0, 3.0]
    with pytest.raises(ValueError, match=r"the template names \['answer'\]"):
        judge(["q"], ["x"])


def test_retries_then_success_and_timeouts(server, tmp_path):
    judge = JudgeReward(server, "m", template="{response}", retries=2, timeout_s=0.5, on_failure="default",
                        default_score=-1.0, log_file=str(tmp_path / "judge.jsonl"))  # fmt: skip
    start = time.monotonic()
    scores = judge(["p", "p"], ["flaky good", "slow"])
    assert scores == [0.9, -1.0]
    assert judge.counts["retries"] >= 1 and judge.counts["failed_default_score"] == 1
    assert time.monotonic() - start < 10
    lines = [json.loads(line) for line in (tmp_path / "judge.jsonl").read_text().splitlines()]
    assert [line["score"] for line in lines] == [0.9, -1.0] and lines[1]["answer"].startswith("<failed:")


def test_malformed_answers_error_names_the_row_or_default(server):
    strict = JudgeReward(server, "m", template="{response}")
    with pytest.raises(
        JudgeError, match=r"f\.jsonl:3 .*no score in the judge's answer 'I cannot grade this\.'"
    ):
        strict([Prompt("a", source="f.jsonl:2"), Prompt("b", source="f.jsonl:3")], ["good", "junk"])
    with pytest.raises(JudgeError, match=r"row 0 .*score 99 outside \[0, 10\]"):
        strict(["a"], ["huge"])
    lenient = JudgeReward(server, "m", template="{response}", on_failure="default")
    assert lenient(["a", "b"], ["junk", "good"]) == [0.0, 0.9]
    assert lenient.metrics()["judge/failed_default_score"] == 1.0


def test_unreachable_endpoint_is_one_clear_error():
    judge = JudgeReward("http://127.0.0.1:9", "m", template="{response}", retries=1, timeout_s=0.5)
    with pytest.raises(
        JudgeError, match=r"http://127.0.0.1:9/v1/chat/completions: row 0 .*no answer after 2 tries"
    ):
        judge(["p"], ["r"])


def test_arguments_checked():
    with pytest.raises(ValueError, match="endpoint must be http"):
        JudgeReward("localhost:8000", "m")
    with pytest.raises(ValueError, match=r"must contain \{response\}"):
        JudgeReward("http://x", "m", template="no response field")
    with pytest.raises(ValueError, match="no group"):
        JudgeReward("http://x", "m", score_pattern=r"Score: \d+")
