"""Fixtures of the stage tests: prompt data, a second tiny policy and a reward-model export, made once
(read-only). A test module may define its own ``data_dir`` with more files (test_online_dpo.py does)."""

from __future__ import annotations

import pytest

from alignlit.models import export_pretrained, load_scalar_model, make_tiny_llama
from tests.conftest import TINY
from tests.helpers import OP_PROMPTS, write_jsonl


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory, tokenizer):
    """A second tiny policy (seed 1), so that KL(policy ‖ reference) is not zero."""
    d = tmp_path_factory.mktemp("reference") / "ref"
    export_pretrained(make_tiny_llama(tokenizer, seed=1, **TINY), tokenizer, d, stage="init")
    return d


@pytest.fixture(scope="session")
def rm_dir(tmp_path_factory, tiny_policy_dir):
    """A reward-model export (the tiny policy's backbone with a scalar head)."""
    rm, rm_tokenizer = load_scalar_model(tiny_policy_dir)
    d = tmp_path_factory.mktemp("rm") / "rm"
    export_pretrained(rm, rm_tokenizer, d, stage="reward")
    return d


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """``prompts.jsonl`` (OP_PROMPTS) and ``sft.jsonl`` (the same prompts, responses " c" and " a b" in turn)."""
    d = tmp_path_factory.mktemp("stage_data")
    write_jsonl(d / "prompts.jsonl", [{"prompt": p} for p in OP_PROMPTS])
    write_jsonl(
        d / "sft.jsonl",
        [{"prompt": p, "response": " a b" if i % 2 else " c"} for i, p in enumerate(OP_PROMPTS)],
    )
    return d
