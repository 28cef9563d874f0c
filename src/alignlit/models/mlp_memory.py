"""Gated MLPs that keep less for the backward pass: :func:`recompute_mlp_activations`.

A gated MLP (Llama, Qwen2/3, Mistral, Gemma: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) keeps
five tensors of its forward for the backward pass: ``x``, ``g = gate_proj(x)`` (for ``act_fn``'s
gradient), ``a = act_fn(g)`` and ``u = up_proj(x)`` (for the product's), and ``h = a * u`` (for
``down_proj``'s weight gradient). ``a`` and ``h`` are one elementwise op away from ``g`` and ``u``, which
are kept anyway, so with the hooks installed here neither is kept: each is recomputed from ``g`` and ``u``
when the backward pass needs it. That frees two ``(tokens, intermediate_size)`` tensors per layer, the
largest activations of a decoder layer, for two elementwise ops per layer in the backward pass (the
memory-saving SwiGLU of Liger Kernel, Hsu et al. 2024, on any device). The recomputed values are the
same bits, so the gradients are the same bits (``tests/models/test_mlp_memory.py``).

Only through public APIs: module forward hooks mark ``a`` (after ``act_fn``) and ``h`` (before
``down_proj``) while they are alive, and ``torch.autograd.graph.saved_tensors_hooks`` pushed for the
MLP's forward swaps a marked tensor (or a view of it) for its recipe. The first forward with gradients
of every MLP checks that ``h`` is ``act_fn(g) * u`` bit for bit; an MLP computing something else keeps
its tensors, with one warning. Off (the MLP keeps everything) with
``use_forward_settings(recompute_mlp=False)``, without gradients, under gradient checkpointing (which
recomputes the whole layer) and while ``torch.compile`` traces.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from alignlit.models.forward_settings import forward_settings

GATED_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")
"""The submodules of a gated MLP, as Hugging Face's Llama-family models name them."""


@dataclass
class _Recipe:
    """A marked tensor's recomputation: ``act_fn(g)`` (``u`` None) or ``act_fn(g) * u``."""

    act: nn.Module
    g: torch.Tensor
    u: torch.Tensor | None
    offset: int

    def value(self) -> torch.Tensor:
        with torch.no_grad():
            a = self.act(self.g)
            return a if self.u is None else a * self.u


@dataclass
class _Saved:
    """What the backward pass keeps instead of a marked tensor (or a view of it)."""

    recipe: _Recipe
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int

    def value(self) -> torch.Tensor:
        full = self.recipe.value()
        return full.as_strided(self.shape, self.stride, self.offset - self.recipe.offset)


class _GatedMLPHooks:
    """The hooks of one gated MLP (see the module docstring)."""

    def __init__(self, mlp: nn.Module, model: nn.Module):
        self.mlp, self.model = mlp, model
        # storage address -> (recipe, the marked tensor): the reference keeps the address from being
        # reused by another tensor while it is marked
        self.marks: dict[int, tuple[_Recipe, torch.Tensor]] = {}
        self.g: torch.Tensor | None = None
        self.u: torch.Tensor | None = None
        self.context = None
        self.verified = False
        self.disabled = False
        self.attached: dict[str, tuple[nn.Module, list]] = {}
        self.handles = [
            mlp.register_forward_pre_hook(self.mlp_pre),
            mlp.register_forward_hook(self.mlp_post, always_call=True),
        ]
        self.attach()

    def attach(self) -> None:
        """Hooks on the MLP's current ``act_fn``, ``up_proj`` and ``down_proj`` (a LoRA adapter injected
        after :func:`recompute_mlp_activations` replaces the projections by wrappers: the hooks move to
        them, and the MLP is checked again)."""
        for name in GATED_MLP[1:]:
            module = getattr(self.mlp, name)
            held = self.attached.get(name)
            if held is not None and held[0] is module:
                continue
            for handle in held[1] if held else []:
                handle.remove()
            if name == "act_fn":
                handles = [module.register_forward_hook(self.act_post)]
            elif name == "up_proj":
                handles = [module.register_forward_hook(self.up_post)]
            else:
                handles = [
                    module.register_forward_pre_hook(self.down_pre),
                    module.register_forward_hook(self.down_post, always_call=True),
                ]
            self.attached[name] = (module, handles)
            self.verified = self.disabled = False

    # --- saved-tensor hooks, pushed for the MLP's forward ------------------------------------------
    def pack(self, t: torch.Tensor):
        if type(t) is torch.Tensor and self.marks:
            recipe, marked = self.marks.get(t.untyped_storage().data_ptr(), (None, None))
            if recipe is not None and t.dtype == marked.dtype and t.numel() <= marked.numel():
                return _Saved(recipe, t.shape, t.stride(), t.storage_offset())
        return t

    @staticmethod
    def unpack(saved):
        return saved.value() if isinstance(saved, _Saved) else saved

    # --- module hooks --------------------------------------------------------------------------------
    def active(self) -> bool:
        return (
            torch.is_grad_enabled()
            and forward_settings().recompute_mlp
            and not torch.compiler.is_compiling()
            and not getattr(self.model, "is_gradient_checkpointing", False)
        )

    def mlp_pre(self, module, args):
        if not self.active():  # nothing to do on forwards without gradients (generation's decode steps)
            return
        self.attach()  # first: a changed projection (a LoRA wrapper) re-enables a disabled MLP's check
        if not self.disabled:
            self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.context.__enter__()

    def mlp_post(self, module, args, output):
        if self.context is not None:
            context, self.context = self.context, None
            context.__exit__(None, None, None)
        self.marks.clear()
        self.g = self.u = None

    def act_post(self, module, args, output):
        if (
            self.context is None
            or not torch.is_grad_enabled()  # our own recomputations (the first forward's check, a recipe)
            or not args
            or type(output) is not torch.Tensor
            or type(args[0]) is not torch.Tensor
        ):
            return
        self.g = args[0]
        if output.is_contiguous():
            self.mark(output, None)

    def up_post(self, module, args, output):
        if self.context is not None:
            self.u = output

    def down_pre(self, module, args):
        if self.context is None:
            return
        self.marks.clear()  # the product is done: ``a`` is no longer marked (its storage may be reused)
        h, g, u = args[0] if args else None, self.g, self.u
        if not all(type(t) is torch.Tensor for t in (h, g, u)) or not h.is_contiguous():
            return  # tensor-parallel MLPs (DTensor activations) keep their tensors
        if not self.verified:
            with torch.no_grad():
                same = torch.equal(h, self.mlp.act_fn(g) * u)
            self.verified = True
            if not same:
                self.disabled = True
                warnings.warn(
                    f"{type(self.mlp).__name__} does not compute down_proj(act_fn(gate_proj(x)) * up_proj(x)): "
                    "its activations are kept (alignlit.models.mlp_memory)",
                    stacklevel=2,
                )
                return
        self.mark(h, u)

    def down_post(self, module, args, output):
        self.marks.clear()  # ``h`` is kept by down_proj (or replaced by its recipe) from here on

    def mark(self, t: torch.Tensor, u: torch.Tensor | None) -> None:
        recipe = _Recipe(self.mlp.act_fn, self.g, u, t.storage_offset())
        self.marks[t.untyped_storage().data_ptr()] = (recipe, t)


def is_gated_mlp(module: nn.Module) -> bool:
    """``module`` has the submodules of a gated MLP, each an ``nn.Module``."""
    return all(isinstance(getattr(module, name, None), nn.Module) for name in GATED_MLP)


def recompute_mlp_activations(model: nn.Module) -> int:
    """Install the hooks of the module docstring on every gated MLP of ``model`` that has none yet;
    returns how many MLPs of ``model`` have them."""
    count, root = 0, getattr(model, "hf_model", model)
    for module in model.modules():
        if not is_gated_mlp(module):
            continue
        count += 1
        if getattr(module, "_alignlit_mlp_hooks", None) is not None:
            continue
        module._alignlit_mlp_hooks = _GatedMLPHooks(module, root)
    return count
