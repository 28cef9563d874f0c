"""How the forward functions of :mod:`alignlit.models.forward` run a model: :class:`ForwardSettings`.

The settings are a context variable: :func:`use_forward_settings` changes them for a block, and
the ``fused_head`` / ``packing`` arguments of each forward function override them for a call.
The values computed are the same either way; only time and memory change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

MIN_PACKING_SAVING = 0.25
"""With ``packing="auto"``: the smallest share of a padded batch's token positions a packed forward must
remove (padding, repeated prompts) for it to run packed (measured: ``benchmarks/bench_packing.py``)."""


@dataclass(frozen=True)
class ForwardSettings:
    """How the functions of :mod:`alignlit.models.forward` run a model (the results are the same either way).

    Attributes:
        fused_head: compute log-probs (and entropies) from the final hidden states with the LM head
            fused in, chunk by chunk (:func:`~alignlit.ops.logprobs.linear_logprobs`), for the scored
            positions only: no ``(N, T, V)`` logits. Off: the model's full logits, then log-probs.
        packing: padding-free forwards: the real tokens of the batch go through the decoder as one
            sequence without padding (positions restart for every row), and rows that share a
            prompt (a preference pair, the ``n`` samples of a prompt) hold it once, which each of
            their responses attends to. Attention runs per group of rows sharing a prompt
            (:func:`~alignlit.models.packing.grouped_attention`), so its cost is that of the padded
            batch. Needs ``fused_head`` for causal LMs (the decoder is called directly). ``"auto"``
            (the default): per batch, packed when that removes at least ``min_packing_saving`` of the
            padded batch's token positions (:func:`~alignlit.models.packing.packing_saving`), else padded
            rows; True: packed whenever possible; False: never.
        min_packing_saving: the threshold of ``packing="auto"``.
        recompute_mlp: gated MLPs with :func:`~alignlit.models.mlp_memory.recompute_mlp_activations`
            installed (every model a stage trains) keep neither ``act_fn(gate)`` nor the product
            ``act_fn(gate) * up`` for the backward pass and recompute them there, from tensors kept anyway.
            Off: they keep both.
    """

    fused_head: bool = True
    packing: bool | Literal["auto"] = "auto"
    min_packing_saving: float = MIN_PACKING_SAVING
    recompute_mlp: bool = True

    def __post_init__(self) -> None:
        if self.packing not in (True, False, "auto"):
            raise ValueError(f"ForwardSettings.packing must be True, False or 'auto', got {self.packing!r}")
        if not 0.0 <= self.min_packing_saving < 1.0:
            raise ValueError(
                f"ForwardSettings.min_packing_saving must be in [0, 1), got {self.min_packing_saving}"
            )


_DEFAULT_SETTINGS = ForwardSettings()
_SETTINGS: ContextVar[ForwardSettings | None] = ContextVar("alignlit_forward_settings", default=None)


def forward_settings() -> ForwardSettings:
    """The :class:`ForwardSettings` in effect."""
    return _SETTINGS.get() or _DEFAULT_SETTINGS


@contextmanager
def use_forward_settings(**changes) -> Iterator[ForwardSettings]:
    """Run the block with some :class:`ForwardSettings` fields changed, e.g.
    ``with use_forward_settings(packing=False): ...``; restores the previous settings afterwards."""
    settings = dataclasses.replace(forward_settings(), **changes)
    token = _SETTINGS.set(settings)
    try:
        yield settings
    finally:
        _SETTINGS.reset(token)
