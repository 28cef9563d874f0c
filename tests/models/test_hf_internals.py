"""The transformers internals alignlit relies on (alignlit.models.hf_internals) are still there.

``test_the_installed_transformers_has_every_internal`` is the guard: when a transformers release
in (or beyond) the pinned range moves one, it fails with the version and the name of what moved.
The other tests take each internal away and check that the guard says so.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import transformers

from alignlit.models import hf_internals
from alignlit.models.hf_internals import TransformersInternalsChanged


def test_the_installed_transformers_has_every_internal():
    hf_internals.check()


def test_a_missing_attention_registry_is_named(monkeypatch):
    monkeypatch.setattr("transformers.AttentionInterface", SimpleNamespace())
    with pytest.raises(TransformersInternalsChanged) as e:
        hf_internals.check()
    assert f"transformers {transformers.__version__}" in str(e.value)
    assert "AttentionInterface.register" in str(e.value)


def test_decoder_layers_that_stop_reading_the_attribute_are_named(monkeypatch):
    # as if a release renamed the attribute behind config._attn_implementation
    renamed = property(
        lambda self: getattr(self, "_attn_implementation_renamed", None),
        lambda self, value: setattr(self, "_attn_implementation_renamed", value),
    )
    monkeypatch.setattr(transformers.PreTrainedConfig, "_attn_implementation", renamed)
    with pytest.raises(
        TransformersInternalsChanged, match=r"transformers \S+: config\._attn_implementation_internal"
    ):
        hf_internals.check()


def test_a_config_without_the_attribute_is_named(monkeypatch):
    config = transformers.LlamaConfig()
    monkeypatch.delattr(config, "_attn_implementation_internal")
    with (
        pytest.raises(TransformersInternalsChanged, match=r"config\._attn_implementation_internal"),
        hf_internals.use_attention(config, "alignlit_test", lambda *a, **k: None),
    ):
        pass
    assert "alignlit_test" not in transformers.AttentionInterface()  # checked before registering anything


def test_a_4d_mask_rebuilt_by_transformers_is_named(monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(
        modeling_llama, "create_causal_mask", lambda **kwargs: kwargs["attention_mask"].clone()
    )
    with pytest.raises(TransformersInternalsChanged, match="4D attention masks used as given"):
        hf_internals.check()


def test_importing_the_forward_functions_registers_nothing_with_transformers():
    code = (
        "import alignlit.models, alignlit.models.forward, alignlit.models.support, alignlit.models.dispatch\n"
        "from transformers import AttentionInterface\n"
        "from alignlit.models.packing import GROUPED_ATTENTION\n"
        "assert GROUPED_ATTENTION not in AttentionInterface(), 'registered at import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
