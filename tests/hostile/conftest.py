"""Fixtures of the command-line tests in tests/hostile (test_commands.py defines its own ``world``)."""

from __future__ import annotations

import pytest

from tests.hostile.stage_world import make_world


@pytest.fixture(scope="session")
def world(tmp_path_factory, tokenizer_dir, tokenizer):
    """Data, a 48-position policy and a reward model, made once (read-only for tests)."""
    return make_world(tmp_path_factory.mktemp("world"), tokenizer_dir, tokenizer)
