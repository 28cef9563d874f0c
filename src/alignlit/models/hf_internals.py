"""Every touch of transformers beyond its public model API, in one place.

The padding-free forwards (:mod:`alignlit.models.packing`) run a Hugging Face decoder with an
attention function of their own. That relies on four things transformers does not promise
across releases; nothing else in alignlit touches them (nor the flags listed after them), and :func:`check` (run by
``tests/models/test_hf_internals.py``) fails with the transformers version and the name of what moved
when a release changes one:

1. ``transformers.AttentionInterface.register(name, fn)``: adds the grouped attention to the
   process-wide attention registry. Done on first use (:func:`use_attention`), not at import.
2. The attention-function calling convention decoder layers follow:
   ``fn(module, query (B, H, S, D), key, value (B, H_kv, S, D), attention_mask, dropout=...,
   scaling=..., **kwargs) -> (output (B, S, H, D), weights)``.
3. ``config._attn_implementation_internal``: the private attribute behind the private
   ``config._attn_implementation`` property, which decoder layers read to pick their attention
   function. :func:`use_attention` writes it for one call, on the config and its text
   sub-config, and restores it afterwards (the public ``model.set_attn_implementation`` is a
   lasting, validated switch of the whole model); :func:`attention_implementation` reads it
   (packing replaces "sdpa" and "eager" attention only).
4. A 4D ``attention_mask`` is passed to the attention function as given (mask construction in
   ``transformers.masking_utils`` returns a prepared 4D mask as-is), so a one-element
   placeholder (:func:`mask_placeholder`) skips building an ``(S, S)`` mask the grouped
   attention would not use.

And three private flags transformers (with peft) reads, each written here only:

5. ``model._hf_peft_config_loaded`` (``PeftAdapterMixin``): whether a model carries a peft adapter
   (:func:`peft_adapter_loaded`); cleared for ``save_pretrained`` to write the full model and on a model
   whose adapter was merged (:func:`set_peft_adapter_loaded`).
6. ``CompileConfig._compile_all_devices``: ``generate`` compiles its forward on accelerators only unless
   it is set (:func:`compile_on_every_device`).
7. ``model._is_fsdp_managed_module``: ``transformers.integrations.fsdp.is_fsdp_managed_module`` reads it;
   ``generate`` then keeps every rank stepping while any rank's sequences are unfinished
   (:func:`mark_fsdp_managed`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from alignlit.checks import internals_changed

_INTERNAL = "_attn_implementation_internal"
_PEFT_FLAG = "_hf_peft_config_loaded"
_COMPILE_ALL = "_compile_all_devices"
_FSDP_FLAG = "_is_fsdp_managed_module"
_REGISTERED: set[str] = set()


class TransformersInternalsChanged(RuntimeError):
    """The installed transformers no longer has an internal alignlit relies on (see the module docstring)."""


_changed = functools.partial(internals_changed, TransformersInternalsChanged, "transformers", by=__name__)


def _register(name: str, fn: Callable) -> None:
    import transformers  # looked up now: transformers may replace its lazy module in sys.modules

    registry = getattr(transformers, "AttentionInterface", None)
    register = getattr(registry, "register", None)
    if not callable(register):
        raise _changed("AttentionInterface.register", "no attention-function registry to add to")
    register(name, fn)


def _configs(config) -> list:
    """``config`` and, for a multimodal model, its text sub-config (which its decoder layers read)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def attention_implementation(config) -> str | None:
    """The attention implementation a model's decoder layers use ("sdpa", "eager", ...)."""
    return getattr(config, "_attn_implementation", None)


@contextmanager
def use_attention(config, name: str, fn: Callable) -> Iterator[None]:
    """Run the block with the decoder layers of ``config``'s model calling ``fn`` as their attention.

    Registers ``fn`` under ``name`` on first use, sets ``name`` as the attention implementation of
    ``config`` (and its text sub-config) and restores the previous one afterwards.
    """
    configs = _configs(config)
    for c in configs:
        if _INTERNAL not in vars(c):
            raise _changed(f"config.{_INTERNAL}", f"{type(c).__name__} has no such attribute")
    if name not in _REGISTERED:
        _register(name, fn)
        _REGISTERED.add(name)
    previous = [getattr(c, _INTERNAL) for c in configs]
    try:
        for c in configs:
            setattr(c, _INTERNAL, name)
        yield
    finally:
        for c, impl in zip(configs, previous):
            setattr(c, _INTERNAL, impl)


def mask_placeholder(device: torch.device) -> torch.Tensor:
    """A (1, 1, 1, 1) attention mask: 4D, so transformers passes it to the attention function as given."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def peft_adapter_loaded(model: torch.nn.Module) -> bool:
    """Whether transformers counts ``model`` as carrying a peft adapter (``model._hf_peft_config_loaded``)."""
    return bool(getattr(model, _PEFT_FLAG, False))


def set_peft_adapter_loaded(model: torch.nn.Module, loaded: bool) -> None:
    """Set ``model._hf_peft_config_loaded`` (False: ``save_pretrained`` writes the full model)."""
    setattr(model, _PEFT_FLAG, loaded)


def compile_on_every_device(compile_config):
    """``compile_config`` with ``_compile_all_devices`` set: ``generate`` compiles on CPU too."""
    setattr(compile_config, _COMPILE_ALL, True)
    return compile_config


def mark_fsdp_managed(model: torch.nn.Module) -> None:
    """Mark ``model`` as FSDP-managed for ``generate`` (``model._is_fsdp_managed_module``): it then keeps
    every rank stepping until all ranks' sequences are done (synced_gpus), since each step all-gathers
    the sharded weights."""
    setattr(model, _FSDP_FLAG, True)


def check_flags() -> None:
    """Raise :class:`TransformersInternalsChanged`, naming the flag, if transformers no longer has or reads
    one of the private flags of the module docstring (5-7)."""
    from transformers import CompileConfig, PreTrainedModel
    from transformers.integrations import fsdp

    if not hasattr(PreTrainedModel, _PEFT_FLAG):
        raise _changed(f"PreTrainedModel.{_PEFT_FLAG}", "the model class no longer has the flag")
    if not hasattr(CompileConfig(), _COMPILE_ALL):
        raise _changed(f"CompileConfig.{_COMPILE_ALL}", "the compile config no longer has the flag")
    probe = torch.nn.Module()
    if fsdp.is_fsdp_managed_module(probe):
        raise _changed(f"module.{_FSDP_FLAG}", "a plain module counts as FSDP-managed")
    mark_fsdp_managed(probe)
    if torch.distributed.is_available() and not fsdp.is_fsdp_managed_module(probe):
        raise _changed(f"module.{_FSDP_FLAG}", "is_fsdp_managed_module no longer reads it")


@torch.no_grad()
def check() -> None:
    """Raise :class:`TransformersInternalsChanged`, naming the internal, if the installed transformers
    no longer behaves as the module docstring lists: a 1-layer Llama decoder runs with an attention
    function set through :func:`use_attention` and gets :func:`mask_placeholder` as its mask; and the
    private flags are there (:func:`check_flags`)."""
    from transformers import LlamaConfig, LlamaModel

    check_flags()
    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.random.fork_rng():  # building the probe's weights leaves the caller's RNG where it was
        decoder = LlamaModel(config).eval()
    calls: list[tuple] = []

    def recorder(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        calls.append((query.shape, key.shape, attention_mask))
        return query.transpose(1, 2), None

    _register("alignlit_check", recorder)  # every time: the registry itself is what is checked
    mask = mask_placeholder(torch.device("cpu"))
    with use_attention(config, "alignlit_check", recorder):
        try:
            decoder(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=mask, use_cache=False)
        except (TypeError, ValueError, RuntimeError, KeyError) as e:
            raise _changed("the attention-function calling convention", f"{type(e).__name__}: {e}") from e
    if attention_implementation(config) != "sdpa":
        raise _changed(f"config.{_INTERNAL}", "restoring it did not restore config._attn_implementation")
    if not calls:
        raise _changed(f"config.{_INTERNAL}", "decoder layers no longer pick their attention from it")
    query_shape, key_shape, seen = calls[0]
    if tuple(query_shape) != (1, 2, 3, 4) or tuple(key_shape) != (1, 1, 3, 4):
        raise _changed(
            "the attention-function calling convention",
            f"query {tuple(query_shape)} and key {tuple(key_shape)}, expected (1, 2, 3, 4) and (1, 1, 3, 4)",
        )
    if seen is not mask:
        raise _changed("4D attention masks used as given", "the decoder built its own mask from a 4D one")
