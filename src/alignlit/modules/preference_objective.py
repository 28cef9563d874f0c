"""The per-batch objective of every preference-optimisation stage (algorithms.md §5, §6, §9).

On a (2B, T) preference batch (rows ``[0, B)`` chosen, ``[B, 2B)`` rejected; a
:class:`~alignlit.data.preference.PreferenceBatch` or anything with the same ``input_ids``,
``attention_mask`` and ``loss_mask``): the policy's per-token log-probs from ONE concatenated
forward, the reference's sequence log-probs from a frozen model or a
:class:`~alignlit.models.reference_cache.ReferenceCache` (none for a reference-free loss), the
registered preference loss (:mod:`alignlit.losses.preference_registry`), plus the SFT term of RPO
``α·NLL(y_w|x)/|y_w|``, added here so that no loss can drop it. Offline DPO and online iterative
DPO call the same :class:`PreferenceObjective`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from alignlit.losses import (
    PairLogps,
    PreferenceLoss,
    ReferenceLogps,
    preference_loss,
    rpo_sft_term,
)
from alignlit.models.forward import token_logprobs
from alignlit.models.modes import eval_mode
from alignlit.models.reference_cache import ReferenceCache

NO_REFERENCE = "none"
"""The value of a stage's ``reference`` that says: no reference model (reference-free losses)."""


def pair_logprobs(model: nn.Module, batch) -> PairLogps:
    """Per-token log-probs of the chosen and rejected responses from ONE forward over the (2B, T) batch.

    Returns a :class:`~alignlit.losses.PairLogps` of (B, T-1) log-probs and masks per side
    (:func:`alignlit.models.forward.token_logprobs`); gradients flow unless called under no_grad.
    """
    rows = batch.input_ids.shape[0]
    if rows % 2:
        raise ValueError(f"a preference batch needs 2B rows (chosen then rejected), got {rows}")
    scored = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)  # (2B, T-1)
    half = rows // 2
    return PairLogps(scored.logprobs[:half], scored.mask[:half], scored.logprobs[half:], scored.mask[half:])


class PreferenceObjective:
    """A preference loss plus the RPO SFT term on one preference batch.

    ``objective(policy, batch, reference)`` returns ``(loss, metrics)``: ``loss`` the loss's value
    plus ``sft_weight·mean_b NLL(y_w)/|y_w|``; ``metrics`` (detached) the loss's own (``rewards/*``,
    ``logps/*``), ``loss`` (the total), and with ``sft_weight > 0`` ``sft_loss`` and
    ``preference_loss``. Models should have dropout off
    (:func:`~alignlit.models.modes.disable_dropout`), so that the policy's log-probs equal the
    reference's when their weights are equal.

    Args:
        loss: a registered preference loss name, the dotted path of a registered function, or a loss
            object (see :func:`~alignlit.losses.preference_loss`).
        loss_args: hyperparameters of a registered loss.
        beta: shortcut for ``loss_args["beta"]`` (None: not given).
        sft_weight: ``α >= 0``.
    """

    def __init__(
        self,
        loss: str | PreferenceLoss = "dpo",
        loss_args: Mapping[str, Any] | None = None,
        *,
        beta: float | None = None,
        sft_weight: float = 0.0,
    ):
        if sft_weight < 0:
            raise ValueError(f"sft_weight must be >= 0, got {sft_weight}")
        args = dict(loss_args or {})
        if beta is not None:
            if not isinstance(loss, str):
                raise ValueError(
                    "beta applies to registered losses; give a loss object's beta in its init_args"
                )
            if "beta" in args:
                raise ValueError(f"beta is given twice: beta={beta} and loss_args.beta={args['beta']}")
            args["beta"] = beta
        self.loss = preference_loss(loss, args)
        self.sft_weight = sft_weight

    @property
    def name(self) -> str:
        """The loss's registered name (or its class path)."""
        return self.loss.name

    @property
    def needs_reference(self) -> bool:
        return self.loss.needs_reference

    def reference_source(self, reference: str | None, default: Any) -> Any:
        """What a stage builds its reference policy from, given its ``reference`` argument: None for a
        reference-free loss, ``default`` (the policy's starting weights) when ``reference`` is None.

        Raises ``ValueError`` for ``reference: none`` with a loss that needs a reference, and for a
        reference model given to a reference-free loss.
        """
        if not self.needs_reference:
            if reference not in (None, NO_REFERENCE):
                raise ValueError(
                    f"preference loss {self.name!r} is reference-free: drop reference={reference!r} "
                    f"(or set it to {NO_REFERENCE!r})"
                )
            return None
        if reference == NO_REFERENCE:
            raise ValueError(
                f"preference loss {self.name!r} needs a reference policy: set reference to a model "
                "directory, or leave it unset for the policy's starting weights"
            )
        return default if reference is None else reference

    def reference_logps(self, reference: nn.Module | ReferenceCache | None, batch) -> ReferenceLogps | None:
        """The reference's sequence log-probs of ``batch``: looked up in a cache, or a no-grad forward of
        a frozen model in eval mode; None when the loss is reference-free."""
        if not self.needs_reference:
            return None
        if reference is None:
            raise ValueError(
                f"preference loss {self.name!r} needs a reference: a frozen model or a ReferenceCache"
            )
        if isinstance(reference, ReferenceCache):
            return reference.lookup(batch)
        with torch.no_grad(), eval_mode(reference):
            return pair_logprobs(reference, batch).as_reference()

    def compute(
        self, policy: PairLogps, reference: ReferenceLogps | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss plus the SFT term, from log-probs already computed."""
        loss, metrics = self.loss(policy, reference)
        if self.sft_weight > 0:
            sft, sft_metrics = rpo_sft_term(-policy.chosen_sum, policy.chosen_length)
            metrics = {**metrics, "preference_loss": loss.detach(), **sft_metrics}
            loss = loss + self.sft_weight * sft
        return loss, {**metrics, "loss": loss.detach()}

    def __call__(
        self, policy: nn.Module, batch, reference: nn.Module | ReferenceCache | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metrics)`` of ``policy`` on a (2B, T) preference batch (see the class docstring)."""
        reference_logps = self.reference_logps(reference, batch)
        return self.compute(pair_logprobs(policy, batch), reference_logps)
