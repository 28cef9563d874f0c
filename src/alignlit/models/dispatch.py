"""The one place the forward functions choose their path: :func:`plan_forward`.

Every function of :mod:`alignlit.models.forward` runs its model one of three ways, which give the
same values: the fast path (the decoder called directly, packed padding-free, only the scored
positions through the head), the direct path on padded rows, or the fallback (the model's own
forward: full logits of a causal LM, a scalar-head model's own values or scores).
:func:`plan_forward` makes that choice from the settings in effect
(:mod:`alignlit.models.forward_settings`), what the model supports
(:mod:`alignlit.models.support`) and whether the batch can be packed, and says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from alignlit.models.forward_settings import forward_settings
from alignlit.models.support import (
    ForwardSupport,
    causal_lm_parts,
    forward_support,
    scalar_parts,
    scalar_support,
)

CHECKPOINTING = "gradient checkpointing recomputes the attention outside the packed forward"


@dataclass(frozen=True)
class ForwardPlan:
    """How one call of a forward function runs its model (see :func:`plan_forward`).

    Attributes:
        direct: the decoder is called directly and only the scored positions go through the head
            (a causal LM's LM head fused with the log-softmax, a scalar-head model's score head).
            False: the model's own forward.
        packed: the decoder runs padding-free (:mod:`alignlit.models.packing`); only when ``direct``.
        reason: why a fast path is not taken (None when both are).
        backbone: the decoder called directly (None unless ``direct``).
        head: the LM head (an ``nn.Linear``) or the score head (None unless ``direct``).
        head_options: ``logit_scale`` and ``softcap`` of an LM head (empty for a score head).
        config: the Hugging Face config of the model whose decoder runs (packed forwards set its
            attention implementation).
    """

    direct: bool
    packed: bool
    reason: str | None = None
    backbone: nn.Module | None = None
    head: nn.Module | None = None
    head_options: dict = field(default_factory=dict)
    config: Any = None


def _packing_reason(model: nn.Module, support: ForwardSupport) -> str | None:
    if getattr(model, "is_gradient_checkpointing", False):
        return CHECKPOINTING
    return support.packing


def plan_forward(
    model: nn.Module,
    *,
    scalar: bool = False,
    fused_head: bool | None = None,
    packing: bool | Literal["auto"] | None = None,
    layout: Callable[[], str | None] | None = None,
    saving: Callable[[], float] | None = None,
) -> ForwardPlan:
    """Choose how one call runs ``model``: fused head or full logits, packed or padded, and why.

    A causal LM runs directly when the fused head is on and :func:`~alignlit.models.support.forward_support`
    allows it; it also packs when packing is on, the model supports it, gradient checkpointing is
    off and the batch allows it. A scalar-head model (``scalar``) runs directly only when it can
    pack (its score head has no vocabulary to fuse, so ``fused_head`` does not apply to it).

    Args:
        model: a causal LM, or with ``scalar`` a :class:`~alignlit.models.ScalarHeadModel`.
        scalar: ``model`` is a scalar-head model.
        fused_head: override :attr:`ForwardSettings.fused_head` (None: the settings in effect).
        packing: override :attr:`ForwardSettings.packing` (None: the settings in effect).
        layout: says why the batch cannot be packed (None when it can); called only when
            everything else allows packing.
        saving: with ``packing="auto"``, the share of the padded batch's token positions packing removes
            (:func:`~alignlit.models.packing.packing_saving`); packed only from
            :attr:`ForwardSettings.min_packing_saving` (None: packed).
    """
    settings = forward_settings()
    fused = settings.fused_head if fused_head is None else fused_head
    pack = settings.packing if packing is None else packing
    if scalar:
        if not pack:
            return ForwardPlan(False, False, "packing is off")
        parts = scalar_parts(model)
        if isinstance(parts, str):
            return ForwardPlan(False, False, parts)
        hf, backbone, score = parts
        reason = _packing_reason(hf, scalar_support(hf, backbone))
        if reason is not None:
            return ForwardPlan(False, False, reason)
        plan = ForwardPlan(True, True, None, backbone, score, {}, hf.config)
    else:
        if not fused:
            return ForwardPlan(False, False, "the fused head is off")
        support = forward_support(model)
        if support.fused_head is not None:
            return ForwardPlan(False, False, support.fused_head)
        backbone, head, options = causal_lm_parts(model)
        plan = ForwardPlan(True, True, None, backbone, head, options, getattr(model, "config", None))
        reason = _packing_reason(model, support) if pack else "packing is off"
        if reason is not None:
            return dataclasses.replace(plan, packed=False, reason=reason)
    reason = layout() if layout is not None else None
    if reason is None and pack == "auto" and saving is not None:
        removed = saving()
        if removed < settings.min_packing_saving:
            reason = (
                f"packing would remove {removed:.0%} of the batch's token positions (auto packs from "
                f"{settings.min_packing_saving:.0%})"
            )
    return plan if reason is None else dataclasses.replace(plan, packed=False, reason=reason)
