"""Fixtures of the stage tests: a second tiny policy and a reward-model export, made once (read-only)."""

from __future__ import annotations

import pytest

from alignlit.models import export_pretrained, load_scalar_model, make_tiny_llama
from tests.conftest import TINY


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
