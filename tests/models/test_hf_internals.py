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
from tests.helpers import assert_names_the_change


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


@pytest.mark.parametrize(
    ("target", "name"),
    [
        ("transformers.PreTrainedModel", "_hf_peft_config_loaded"),
        ("transformers.CompileConfig", "_compile_all_devices"),
    ],
)
def test_a_missing_private_flag_is_named_with_the_pinned_range(monkeypatch, target, name):
    import importlib

    module, cls = target.rsplit(".", 1)
    owner = next(
        c for c in getattr(importlib.import_module(module), cls).__mro__ if name in vars(c)
    )  # the class that defines the flag
    monkeypatch.delattr(owner, name)
    with pytest.raises(TransformersInternalsChanged) as e:
        hf_internals.check_flags()
    assert_names_the_change(e.value, "transformers", name)


def test_is_fsdp_managed_module_that_stops_reading_the_flag_is_named(monkeypatch):
    from transformers.integrations import fsdp

    monkeypatch.setattr(fsdp, "is_fsdp_managed_module", lambda module: False)
    with pytest.raises(TransformersInternalsChanged, match="_is_fsdp_managed_module"):
        hf_internals.check_flags()


def test_the_flag_helpers_write_what_transformers_reads(tokenizer):
    from transformers import CompileConfig
    from transformers.integrations.fsdp import is_fsdp_managed_module

    from alignlit.models import make_tiny_llama
    from tests.conftest import TINY

    model = make_tiny_llama(tokenizer, **TINY)
    assert not hf_internals.peft_adapter_loaded(model)
    hf_internals.set_peft_adapter_loaded(model, True)
    assert hf_internals.peft_adapter_loaded(model) and model._hf_peft_config_loaded
    assert hf_internals.compile_on_every_device(CompileConfig())._compile_all_devices is True
    hf_internals.mark_fsdp_managed(model)
    assert is_fsdp_managed_module(model)
