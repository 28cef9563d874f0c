"""benchmarks/bench_real_shape.py --tiny: one GRPO step on GSM8K prompts runs and its JSON has every phase,
the forced response lengths and the prompt / answer length table; a second run reads its cells back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from harness import GSM8K, hash_reward  # noqa: E402

PHASES = {"generation", "score", "old_logprobs", "ref_logprobs", "update", "other"}  # the step's split


def test_hash_reward_reads_the_number_after_the_last_marker():
    assert hash_reward(["p"] * 4, ["so #### 1,200", "#### 12", "no marker", "#### 5 #### 7"],
                       ["... #### 1200", "#### 13", "#### 5", "#### 7"]) == [1.0, 0.0, 0.0, 1.0]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not GSM8K.is_file(), reason=f"needs the shared GSM8K train split at {GSM8K}")
def test_tiny_run_writes_phases_and_lengths(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def run() -> dict:
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "bench_real_shape.py"), "--tiny", "--out-dir", str(tmp_path),
             "--work", str(tmp_path / "work")],
            capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return json.loads((tmp_path / "real_shape_tiny.json").read_text())

    result = run()
    assert {p.stem for p in (tmp_path / "work" / "cells").glob("*.json")} == {"model", "lengths", "step-hf"}
    hf = result["engines"]["hf"]
    assert hf["status"] == "ok" and set(hf["seconds"]) == set(PHASES)
    assert all(v >= 0 for k, v in hf["seconds"].items() if k != "other")
    assert abs(sum(hf["seconds"].values()) - hf["step_s"]) < 1e-6
    assert hf["response_lengths"] == [8] and hf["response_tokens"] == 2 * 2 * 8
    assert set(hf["rss_peak_mb_by_phase"]) == {"generation", "logprobs", "update"}
    assert result["memory"]["peak_rss_mb"] >= max(hf["rss_peak_mb_by_phase"].values()) - 1
    lengths = result["lengths"]
    assert lengths["rows"] == 200 and "NOT Qwen's" in lengths["tokenizer"]
    for key in ("prompt_tokens", "answer_tokens", "question_words", "answer_words"):
        assert 0 < lengths[key]["min"] <= lengths[key]["median"] <= lengths[key]["max"]
    # the chat-rendered prompt holds the system prompt and the generation prompt
    assert lengths["example_prompt"].startswith("<|im_start|>system\nPlease reason step by step")
    assert lengths["example_prompt"].endswith("<|im_start|>assistant\n")
    assert lengths["prompt_tokens"]["min"] > lengths["question_words"]["min"]
    assert result["engines"]["vllm"]["status"] == "not run" and result["load_average_start"]
    assert (
        (tmp_path / "real_shape_tiny.md").read_text().startswith("# One GRPO step at the real shape (--tiny)")
    )
    # the cells are read back: the same step and lengths, nothing measured again
    again = run()
    assert again["engines"]["hf"] == hf and again["lengths"] == lengths
    assert again["memory"]["peak_rss_mb"] == result["memory"]["peak_rss_mb"]
