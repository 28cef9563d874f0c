"""LoRA adapters through PEFT on the models alignlit trains (Hu et al. 2021, "LoRA: Low-Rank Adaptation
of Large Language Models").

A targeted linear layer ``W`` becomes ``W x + (α/r)·B A x`` with ``A`` (r × in) and ``B`` (out × r)
trainable and ``W`` frozen; ``B`` starts at 0, so the adapted model starts as the base model. The
adapters are injected in place through Hugging Face's adapter integration (``add_adapter``): the model
keeps its class and module tree, so the teacher-forced forward, :class:`~alignlit.models.ScalarHeadModel`
and the FSDP2 / tensor-parallel plans see the same model as without LoRA.

- :func:`apply_lora` adds the adapter (a scalar head is trained in full, PEFT's ``modules_to_save``);
- :func:`adapters_disabled` runs a block on the base model, and :class:`AdapterDisabled` is the base model
  as a model of its own: the frozen reference of a LoRA stage, with no second copy of the base weights;
- :func:`merged_state_dict` is the state dict of the merged model ``W + (α/r)·B A`` under the base
  model's names (exports, weight sync into vLLM), from the live model or from a gathered state dict;
- :func:`save_lora_model` writes a merged Hugging Face directory or the adapter alone (PEFT format),
  and :func:`load_adapter_export` loads such an adapter directory back as a merged model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from alignlit.models.hf_internals import peft_adapter_loaded, set_peft_adapter_loaded
from alignlit.models.state_dict import full_state_dict

ADAPTER = "default"
"""Name of the one adapter a stage trains."""

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama-family decoder layer."""

HEAD_NAMES = ("score", "classifier")
"""Scalar heads (``…ForSequenceClassification``) that are trained in full next to the adapter."""

LoRAExport = Literal["merged", "adapter"]


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on a stage's trained model (Hu et al. 2021), through PEFT.

    In YAML it is a group: ``lora: {rank: 16, alpha: 32}``; ``lora: null`` (the default of every
    stage) is full fine-tuning. Only the adapters (and a scalar model's head) train; the base weights
    are frozen and held once: a stage with a reference policy uses the base model with the adapter
    disabled as the reference (:class:`AdapterDisabled`). Presets: ``configs/lora/*.yaml``.

    Args:
        rank: ``r``, the rank of ``B A``.
        alpha: ``α``; the update ``B A x`` is scaled by ``α / r``.
        dropout: dropout on the adapter's input in train mode (the RL and DPO stages turn every
            dropout off, this one too).
        target_modules: names (last component) of the linear layers that get an adapter; default: every
            projection of a Llama-family decoder layer. The LM head, the embeddings and a scalar head
            cannot be targeted.
        export: ``merged``: the export is a normal Hugging Face directory with ``W + (α/r)·B A`` in
            place of ``W``; ``adapter``: the adapter alone in PEFT's format (``adapter_config.json``,
            ``adapter_model.safetensors``, naming its base directory), which ``load_policy`` /
            ``load_scalar_model`` load merged and ``peft.PeftModel.from_pretrained(base, dir)`` loads
            as an adapter.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LLAMA_PROJECTIONS
    export: LoRAExport = "merged"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the linear layers that get adapters")
        if self.export not in ("merged", "adapter"):
            raise ValueError(f"lora.export must be 'merged' or 'adapter', got {self.export!r}")


torch.serialization.add_safe_globals([LoRA])


def _peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            f"lora needs PEFT: pip install 'alignlit[lora]' (peft); import failed with: {err}"
        ) from err
    return peft


def _hf(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a :class:`~alignlit.models.ScalarHeadModel` (or the model)."""
    return getattr(model, "hf_model", model)


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every PEFT adapter layer of ``model`` (empty without LoRA)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [(n, m) for n, m in _hf(model).named_modules() if isinstance(m, BaseTunerLayer)]


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` (a Hugging Face model or a ScalarHeadModel) carries a LoRA adapter."""
    return peft_adapter_loaded(_hf(model)) and bool(lora_layers(model))


def _check_targets(hf: nn.Module, lora: LoRA) -> None:
    """Raise ``ValueError`` naming ``lora.target_modules`` when a name matches no linear layer of a
    decoder/encoder block, or matches the LM head, the embeddings or a scalar head."""
    excluded = {id(m) for m in (hf.get_output_embeddings(), hf.get_input_embeddings()) if m is not None}
    excluded |= {id(getattr(hf, h)) for h in HEAD_NAMES if isinstance(getattr(hf, h, None), nn.Module)}
    linear = {}
    for name, module in hf.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in excluded:
            linear.setdefault(name.rsplit(".", 1)[-1], name)
    for target in lora.target_modules:
        if target in linear:
            continue
        hit = [n for n, m in hf.named_modules() if n.rsplit(".", 1)[-1] == target]
        what = (
            f"{hit[0]} is the LM head, an embedding or the scalar head (trained in full or frozen, never adapted)"
            if hit
            else "no module has that name"
        )
        raise ValueError(
            f"lora.target_modules: {target!r} is not a linear layer of {type(hf).__name__} that can take an "
            f"adapter ({what}); the model's adaptable linear layers are {sorted(linear)}"
        )


def apply_lora(model: nn.Module, lora: LoRA) -> nn.Module:
    """Inject a LoRA adapter into ``model`` in place and return it.

    ``model`` is a Hugging Face ``PreTrainedModel`` (a causal LM) or a
    :class:`~alignlit.models.ScalarHeadModel` (reward model, critic), whose scalar head stays fully
    trainable (PEFT ``modules_to_save``). Afterwards only the adapter (and that head) require
    gradients; adapter weights are float32 even on a bfloat16/float16 base (PEFT's adapter autocast).
    """
    peft = _peft()
    hf = _hf(model)
    if has_lora(hf):
        raise ValueError(f"{type(hf).__name__} already has a LoRA adapter")
    _check_targets(hf, lora)
    heads = [h for h in HEAD_NAMES if isinstance(getattr(hf, h, None), nn.Module)]
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=heads or None,
        init_lora_weights=True,
    )
    hf.add_adapter(config, adapter_name=ADAPTER)
    return model


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the block on the base model: every adapter layer of ``model`` is switched off (PEFT's
    ``enable_adapters(False)``, what ``PeftModel.disable_adapter()`` does) and back on afterwards,
    with every parameter's ``requires_grad`` restored as it was. A model without LoRA is unchanged."""
    layers = [m for _, m in lora_layers(model)]
    if not layers:
        yield model
        return
    from peft.utils import ModulesToSaveWrapper

    layers += [m for m in _hf(model).modules() if isinstance(m, ModulesToSaveWrapper)]
    params = list(_hf(model).parameters())
    flags = [p.requires_grad for p in params]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in zip(params, flags):
            if p.requires_grad != flag:
                p.requires_grad_(flag)


class _DisabledCall(nn.Module):
    """A submodule of a LoRA model (its decoder) called with the model's adapters disabled."""

    def __init__(self, module: nn.Module, owner: nn.Module):
        super().__init__()
        self.__dict__["_inner"] = module  # not registered: holds no weights of its own
        self.__dict__["_owner"] = owner

    def forward(self, *args, **kwargs):
        with adapters_disabled(self._owner):
            return self._inner(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._inner.parameters(recurse)


class AdapterDisabled(nn.Module):
    """The base model under a LoRA model, as a model: every call runs with the adapters disabled.

    The frozen reference policy ``π_0`` of a LoRA stage (DPO, PPO, every online stage): the same
    weights as the policy's base, held once. It registers no parameters (the LoRA model is not a
    submodule), so it adds nothing to state dicts, checkpoints or the optimizer;
    ``forward``/``generate``/``get_decoder``/``get_output_embeddings``/``parameters``/``config`` are
    the LoRA model's, taken with the adapters off, which is all :mod:`alignlit.models.forward` and
    the HF rollout engine use. Its train/eval mode is its own (the wrapped policy's is untouched),
    and ``requires_grad_``/``zero_grad`` leave the policy's parameters alone.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        if not has_lora(model):
            raise ValueError(f"{type(model).__name__} has no LoRA adapter: its base model is itself")
        self.__dict__["lora_model"] = model

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.lora_model):
            return self.lora_model(*args, **kwargs)

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        with adapters_disabled(self.lora_model):
            return self.lora_model.generate(*args, **kwargs)

    def get_decoder(self) -> nn.Module:
        return _DisabledCall(self.lora_model.get_decoder(), self.lora_model)

    def get_output_embeddings(self) -> nn.Module:
        return self.lora_model.get_output_embeddings()

    def parameters(self, recurse: bool = True):
        return self.lora_model.parameters(recurse)

    def requires_grad_(self, requires_grad: bool = True) -> AdapterDisabled:
        """A no-op: the base weights are frozen already and the adapter is the policy's to train."""
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: the gradients of the shared weights are the policy's."""

    @property
    def config(self):
        return self.lora_model.config

    @property
    def generation_config(self):
        return self.lora_model.generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self.lora_model.generation_config = value

    @property
    def device(self) -> torch.device:
        return next(self.lora_model.parameters()).device

    def state_dict(self, *args, destination=None, **kwargs):
        """The base model's weights under their own names (:func:`base_state_dict`; no copies). Never
        part of a parent's state dict: called by the parent (with ``destination``) it adds nothing."""
        if destination is not None or args:
            return destination if destination is not None else args[0]
        return base_state_dict(self.lora_model)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        raise TypeError(
            "the reference of a LoRA stage is the base model with the adapter disabled and cannot be "
            "replaced by other weights (a moving reference needs full fine-tuning: lora: null)"
        )


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the base model under a LoRA model (adapter keys dropped, ``X.base_layer.*``
    and a scalar head's ``X.original_module.*`` under ``X.*``): the tensors themselves, not copies."""
    from peft.utils import ModulesToSaveWrapper

    hf = _hf(model)
    wrappers = [n for n, m in hf.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    out = {}
    for key, value in hf.state_dict(keep_vars=True).items():
        if ".lora_" in key or any(key.startswith(f"{w}.modules_to_save.") for w in wrappers):
            continue
        key = key.replace(".base_layer.", ".")
        for w in wrappers:
            if key.startswith(f"{w}.original_module."):
                key = f"{w}." + key.removeprefix(f"{w}.original_module.")
        out[key] = value.detach()
    return out


def _merge_key(state: dict[str, torch.Tensor], name: str, scaling: float) -> None:
    """Replace ``name.base_layer.*`` / ``name.lora_{A,B}.<adapter>.weight`` in ``state`` by ``name.*``."""
    weight = state.pop(f"{name}.base_layer.weight")
    a = state.pop(f"{name}.lora_A.{ADAPTER}.weight")  # (r, in)
    b = state.pop(f"{name}.lora_B.{ADAPTER}.weight")  # (out, r)
    delta = (b.float() @ a.float()) * scaling  # (out, in)
    state[f"{name}.weight"] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    if f"{name}.base_layer.bias" in state:
        state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")


def merged_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` with its adapter merged: ``W + (α/r)·B A`` under ``W``'s name, the
    trained copy of a scalar head under the head's name, no adapter keys; the names are those of the
    model without LoRA (the names of its export and of vLLM's checkpoint format).

    Args:
        model: a Hugging Face model (or ScalarHeadModel) with a LoRA adapter.
        state: its full state dict when it is sharded (gathered with
            :func:`alignlit.models.state_dict.full_state_dict`); default ``model.state_dict()`` (whose
            DTensor shards are gathered here, a collective every rank must join).
    """
    hf = _hf(model)
    state = full_state_dict(hf, None) if state is None else dict(state)
    if state and all(k.startswith("hf_model.") for k in state):
        state = {k.removeprefix("hf_model."): v for k, v in state.items()}
    for name, layer in lora_layers(hf):
        if type(layer).__name__ == "ModulesToSaveWrapper":
            continue
        if not isinstance(getattr(layer, "base_layer", None), nn.Linear):
            raise TypeError(
                f"{name}: alignlit merges adapters of linear layers only, not {type(layer).__name__}"
            )
        _merge_key(state, name, float(layer.scaling[ADAPTER]))
    for name, module in hf.named_modules():
        if type(module).__name__ != "ModulesToSaveWrapper":
            continue
        for key in [k for k in state if k.startswith(f"{name}.")]:
            value = state.pop(key)
            rest = key.removeprefix(f"{name}.")
            if rest.startswith(f"modules_to_save.{ADAPTER}."):
                state[f"{name}.{rest.removeprefix(f'modules_to_save.{ADAPTER}.')}"] = value
    return state


@contextmanager
def _as_plain_model(hf: nn.Module) -> Iterator[None]:
    """Let ``save_pretrained`` write the full model (not the adapter alone) for the block."""
    flag = peft_adapter_loaded(hf)
    set_peft_adapter_loaded(hf, False)
    try:
        yield
    finally:
        set_peft_adapter_loaded(hf, flag)


def save_lora_model(
    model: nn.Module,
    out_dir: str | Path,
    *,
    mode: LoRAExport,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write a LoRA model to ``out_dir``: merged into a normal Hugging Face directory, or the adapter
    alone in PEFT's format (see :class:`LoRA`'s ``export``).

    ``state_dict`` is the model's full state dict when it is sharded (keys as ``model.state_dict()``).
    """
    hf = _hf(model)
    if mode == "merged":
        merged = merged_state_dict(hf, state_dict)
        with _as_plain_model(hf):
            hf.save_pretrained(str(out_dir), state_dict=merged)
        return
    if mode != "adapter":
        raise ValueError(f"lora export must be 'merged' or 'adapter', got {mode!r}")
    if state_dict is not None and all(k.startswith("hf_model.") for k in state_dict):
        state_dict = {k.removeprefix("hf_model."): v for k, v in state_dict.items()}
    hf.save_pretrained(str(out_dir), state_dict=state_dict)
    _absolute_base(Path(out_dir) / ADAPTER_CONFIG)


def _absolute_base(config_file: Path) -> None:
    """Record the adapter's base model as an absolute path when it is a local directory: PEFT writes the
    path the base was loaded from (``out/quickstart/sft``), which resolves only from the directory the
    stage ran in."""
    config: dict[str, Any] = json.loads(config_file.read_text())
    base = config.get("base_model_name_or_path")
    if base and not Path(base).is_absolute() and Path(base).is_dir():
        config["base_model_name_or_path"] = str(Path(base).resolve())
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a PEFT adapter (``adapter_config.json``) rather than a full model."""
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def adapter_base(path: str | Path) -> Path:
    """The base-model directory an adapter export names (``base_model_name_or_path``)."""
    config: dict[str, Any] = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        relative = (
            f" (a relative path, read from the current directory {Path.cwd()}: exports written before "
            "alignlit recorded absolute base paths name the base relative to where their stage ran)"
            if base and not Path(base).is_absolute()
            else ""
        )
        raise FileNotFoundError(
            f"{path} is a LoRA adapter whose base model {base!r} is not a local directory{relative}; alignlit "
            f"loads the base from it (edit base_model_name_or_path in {Path(path) / ADAPTER_CONFIG})"
        )
    return Path(base)


def load_adapter_export(path: str | Path, base_model: nn.Module) -> nn.Module:
    """``base_model`` with the adapter at ``path`` loaded and merged into its weights (a plain model)."""
    peft = _peft()
    merged = peft.PeftModel.from_pretrained(base_model, str(path)).merge_and_unload()
    set_peft_adapter_loaded(merged, False)
    return merged


def parameter_bytes(*modules: nn.Module) -> int:
    """Bytes of the distinct parameter and buffer storages reachable from ``modules`` (tensors shared
    between them counted once): the weights a process holds for them."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
