"""What a model supports: the fast paths of :mod:`alignlit.models.forward`, probed once per model.

:func:`forward_support` says whether a causal LM can take the fused head and padding-free
packing (and why not); :func:`scalar_parts` and :func:`scalar_support` do the same for the
decoder of a scalar-head model (critic, reward model). The probes compare, on tiny inputs, the
fast path with the model's own forward, so a model that computes otherwise keeps its own.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from alignlit.models import hf_internals
from alignlit.models.modes import eval_mode
from alignlit.models.packing import pack, packed_hidden, prompt_lengths

log = logging.getLogger(__name__)

_UNHANDLED_HEAD_SCALES = ("logits_scaling", "lm_head_multiplier", "output_multiplier", "mup_width_multiplier")
"""Config attributes of models whose LM head output is rescaled in ways the fused head does not reproduce."""


@dataclass(frozen=True)
class ForwardSupport:
    """Which fast paths a model can take, with the reason when it cannot (see :func:`forward_support`).

    Attributes:
        fused_head: None when the fused head applies, else why the full logits are used.
        packing: None when padding-free packing applies, else why padded rows are used.
    """

    fused_head: str | None
    packing: str | None


_SUPPORT: weakref.WeakKeyDictionary[nn.Module, ForwardSupport] = weakref.WeakKeyDictionary()


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, dict] | str:
    """``(backbone, head, head options)`` of a standard Hugging Face causal LM, or why it is not one."""
    get_head = getattr(model, "get_output_embeddings", None)
    get_backbone = getattr(model, "get_decoder", None)
    if not callable(get_head) or not callable(get_backbone):
        return (
            f"{type(model).__name__} is not a Hugging Face causal LM (no get_output_embeddings/get_decoder)"
        )
    head, backbone = get_head(), get_backbone()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or backbone is None or backbone is model:
        return f"{type(model).__name__} has no linear LM head on a separate decoder"
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        # e.g. a LoRA-wrapped head: its weight attribute is not what its forward applies
        return f"the LM head is a {type(head).__name__}, not a plain nn.Linear"
    if any(_is_dtensor(p) for p in (weight, *backbone.parameters())):
        return "the weights are DTensors (tensor parallel / FSDP2): the model's own forward runs the sharded head"
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _UNHANDLED_HEAD_SCALES:
        if getattr(text_config, name, None) not in (None, 1, 1.0):
            return f"{type(model).__name__} rescales its logits ({name}), which the fused head does not reproduce"
    scale = getattr(text_config, "logit_scale", None)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return backbone, head, {"logit_scale": 1.0 if scale is None else float(scale), "softcap": softcap}


def _probe_ids(model: nn.Module, length: int) -> torch.Tensor:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    device = next(model.parameters()).device
    return (torch.arange(3, 3 + length, device=device) * 7919 % vocab)[None]  # (1, length)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, float(b.abs().max()))
    return a.shape == b.shape and bool(((a.float() - b.float()).abs() <= _tolerance(b.dtype) * scale).all())


@torch.no_grad()
def probe_packing(model: nn.Module, backbone: nn.Module) -> str | None:
    """Check on a tiny batch that packing two rows which share a prompt gives the padded forward's
    hidden states (None), or say why packing does not apply."""
    config = getattr(model, "config", None)
    impl = hf_internals.attention_implementation(config)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (packing replaces 'sdpa' or 'eager' attention only)"
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return f"layers with attention other than full causal ({sorted(set(layer_types))})"
    if layer_types is None and getattr(text_config, "sliding_window", None) is not None:
        return f"sliding-window attention (window {text_config.sliding_window})"
    ids = _probe_ids(model, 5)[0]
    rows = torch.stack([ids, torch.cat([ids[:3], ids[1:3]]), ids.flip(0)])  # (3, 5): rows 0, 1 share 3 tokens
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], device=ids.device)
    rows = rows.masked_fill(attention_mask == 0, 0)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 1, 1, 0, 0]], device=ids.device).bool()
    try:
        padded = backbone(input_ids=rows, attention_mask=attention_mask, use_cache=False).last_hidden_state
        packed = pack(rows, attention_mask.bool(), prompt_lengths(attention_mask.bool(), loss_mask))
        hidden = packed_hidden(backbone, packed, config)
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        return f"the decoder refused a packed batch ({type(e).__name__}: {e})"
    real = attention_mask.bool()
    if not _close(hidden[packed.index[real]], padded[real]):
        return "packed rows gave other hidden states than padded ones (the model mixes positions otherwise)"
    return None


@torch.no_grad()
def _probe(model: nn.Module) -> ForwardSupport:
    parts = causal_lm_parts(model)
    if isinstance(parts, str):
        return ForwardSupport(parts, parts)
    backbone, head, options = parts
    with eval_mode(model):
        ids = _probe_ids(model, 4)
        try:
            hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state  # (1, 4, H)
        except (TypeError, ValueError, RuntimeError) as e:
            reason = f"calling the decoder alone failed ({type(e).__name__}: {e})"
            return ForwardSupport(reason, reason)
        logits = model(input_ids=ids, use_cache=False).logits  # (1, 4, V)
        ours = head(hidden).float() * options["logit_scale"]
        if options["softcap"] is not None:
            ours = options["softcap"] * torch.tanh(ours / options["softcap"])
        if not _close(ours, logits.float()):
            reason = f"{type(model).__name__}'s logits are not its LM head applied to its decoder's output"
            return ForwardSupport(reason, reason)
        return ForwardSupport(None, probe_packing(model, backbone))


def forward_support(model: nn.Module) -> ForwardSupport:
    """Whether ``model`` can take the fused-head and packed paths, and why not.

    A standard Hugging Face causal LM (a decoder from ``get_decoder()``, a linear head from
    ``get_output_embeddings()``, optional ``logit_scale`` and ``final_logit_softcapping``) takes the
    fused head when, on a probe input, the head applied to the decoder's output gives the model's
    logits; it also packs when its attention is "sdpa" or "eager" (packed forwards run attention
    per group through SDPA instead), full causal (no sliding window), and a packed probe batch
    gives the padded batch's hidden states. Sharded weights (DTensor) and wrapped heads (LoRA on
    the head) keep the model's own forward. Probed once per model (a few tiny forwards); gradient
    checkpointing turns packing off at call time.
    """
    support = _SUPPORT.get(model)
    if support is None:
        support = _probe(model)
        _SUPPORT[model] = support
        for path, reason in (("fused head", support.fused_head), ("packing", support.packing)):
            if reason is not None:
                log.info("%s: no %s: %s", type(model).__name__, path, reason)
    return support


def scalar_parts(scalar_model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | str:
    """``(hf model, backbone, score head)`` of a decoder :class:`~alignlit.models.ScalarHeadModel`,
    or why it has none (then its own methods run)."""
    hf = getattr(scalar_model, "hf_model", None)
    backbone, score = getattr(hf, "model", None), getattr(hf, "score", None)
    if not isinstance(backbone, nn.Module) or not isinstance(score, nn.Module):
        return f"{type(scalar_model).__name__} is not a scalar-head decoder (no hf_model.model and .score)"
    return hf, backbone, score


def scalar_support(hf: nn.Module, backbone: nn.Module) -> ForwardSupport:
    """Whether the Hugging Face model of a scalar-head model packs (probed once; ``fused_head`` is None:
    its score head has no vocabulary to fuse)."""
    support = _SUPPORT.get(hf)
    if support is None:
        support = ForwardSupport(None, _probe_scalar(hf, backbone))
        _SUPPORT[hf] = support
        if support.packing is not None:
            log.info("%s: no packing: %s", type(hf).__name__, support.packing)
    return support


def _probe_scalar(hf: nn.Module, backbone: nn.Module) -> str | None:
    if any(_is_dtensor(p) for p in backbone.parameters()):
        return "the weights are DTensors (tensor parallel / FSDP2)"
    with eval_mode(hf):
        return probe_packing(hf, backbone)
