"""Pairwise preference losses as a registry of pure functions (algorithms.md §5 and §9).

A preference loss scores B pairs ``(x, y_w, y_l)`` (``y_w`` preferred)::

    fn(policy: PairLogps, reference: ReferenceLogps | None, *, <hyperparameters>) -> (loss, metrics)

``policy`` holds the trained policy's per-token log-probs and masks of both responses, so sequence
sums, lengths and length-normalised log-probs are at hand; ``reference`` the reference policy's
sequence log-probs, or None for a loss registered with ``needs_reference=False``. ``loss`` is a scalar
averaged over the pairs; ``metrics`` are detached scalars, the implicit-reward metrics of
:func:`~alignlit.losses.dpo.reward_metrics` where they make sense. The SFT term of RPO is not part of
a loss: the stage adds it to whichever loss it trains.

:func:`register_preference_loss` adds a function under a name; :func:`preference_loss` turns a
config value (a registered name, the dotted path of a registered function, or a loss object, see
:class:`PreferenceLoss`) and its hyperparameters into a :class:`BoundPreferenceLoss`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from alignlit.checks import import_object
from alignlit.losses.dpo import dpo_loss, implicit_rewards, ipo_loss, reward_metrics
from alignlit.ops.stats import check_ndim, check_same_shape

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PairLogps:
    """Per-token log-probs of the chosen and rejected responses of B pairs under one policy.

    Attributes:
        chosen: (B, L) ``log π(y_w,t | x, y_w,<t)``, 0 where ``chosen_mask`` is False.
        chosen_mask: (B, L) bool, True on the chosen response's tokens.
        rejected: (B, L') the same for ``y_l``.
        rejected_mask: (B, L') bool.
    """

    chosen: torch.Tensor
    chosen_mask: torch.Tensor
    rejected: torch.Tensor
    rejected_mask: torch.Tensor

    def __post_init__(self) -> None:
        for side in ("chosen", "rejected"):
            logps, mask = getattr(self, side), getattr(self, f"{side}_mask")
            check_ndim(f"PairLogps.{side}", logps, 2, "(B, L)")
            check_same_shape(**{f"PairLogps.{side}": logps, f"PairLogps.{side}_mask": mask})
            if mask.dtype != torch.bool:
                raise TypeError(f"PairLogps.{side}_mask must be a bool tensor, got {mask.dtype}")
        if self.chosen.shape[0] != self.rejected.shape[0]:
            raise ValueError(
                f"PairLogps.chosen has {self.chosen.shape[0]} rows but PairLogps.rejected has "
                f"{self.rejected.shape[0]}; a pair needs one of each"
            )

    def __len__(self) -> int:
        return self.chosen.shape[0]

    @property
    def chosen_sum(self) -> torch.Tensor:
        """(B,) ``ℓ_w = log π(y_w|x)``."""
        return (self.chosen * self.chosen_mask).sum(-1)

    @property
    def rejected_sum(self) -> torch.Tensor:
        """(B,) ``ℓ_l = log π(y_l|x)``."""
        return (self.rejected * self.rejected_mask).sum(-1)

    @property
    def chosen_length(self) -> torch.Tensor:
        """(B,) long, ``|y_w|``."""
        return self.chosen_mask.sum(-1)

    @property
    def rejected_length(self) -> torch.Tensor:
        """(B,) long, ``|y_l|``."""
        return self.rejected_mask.sum(-1)

    @property
    def chosen_mean(self) -> torch.Tensor:
        """(B,) ``ℓ_w/|y_w|``; raises when a chosen response has no token."""
        return _per_token(self.chosen_sum, self.chosen_length, "chosen")

    @property
    def rejected_mean(self) -> torch.Tensor:
        """(B,) ``ℓ_l/|y_l|``; raises when a rejected response has no token."""
        return _per_token(self.rejected_sum, self.rejected_length, "rejected")

    def as_reference(self) -> ReferenceLogps:
        """The detached sequence sums, as the reference log-probs of a loss."""
        return ReferenceLogps(self.chosen_sum.detach(), self.rejected_sum.detach())


def _per_token(total: torch.Tensor, length: torch.Tensor, side: str) -> torch.Tensor:
    empty = torch.nonzero(length == 0).flatten().tolist()
    if empty:
        raise ValueError(f"PairLogps: the {side} responses at batch indices {empty} have no token")
    return total / length.to(total.dtype)


@dataclass(frozen=True)
class ReferenceLogps:
    """Sequence log-probs of the chosen and rejected responses of B pairs under the reference ``π_0``.

    Attributes:
        chosen_sum: (B,) ``log π_0(y_w|x)``.
        rejected_sum: (B,) ``log π_0(y_l|x)``.
    """

    chosen_sum: torch.Tensor
    rejected_sum: torch.Tensor

    def __post_init__(self) -> None:
        check_ndim("ReferenceLogps.chosen_sum", self.chosen_sum, 1, "(B,)")
        check_same_shape(
            **{"ReferenceLogps.chosen_sum": self.chosen_sum, "ReferenceLogps.rejected_sum": self.rejected_sum}
        )

    def __len__(self) -> int:
        return self.chosen_sum.shape[0]


@runtime_checkable
class PreferenceLoss(Protocol):
    """A preference loss object, for losses with state or for a YAML ``class_path``: the constructor
    takes the hyperparameters (``init_args``), ``__call__(policy: PairLogps, reference: ReferenceLogps
    | None)`` returns ``(loss, metrics)``. A class attribute ``needs_reference = False`` marks it
    reference-free (it then receives None).

    ``__call__`` is declared with positional, unannotated parameters returning ``Any``, so that a class
    matches whatever its parameter names and annotations (jsonargparse checks a ``class_path`` against
    the protocol, and documents its ``init_args`` with ``--model.init_args.loss_type.help``).
    """

    def __call__(self, policy, reference, /) -> Any: ...


PreferenceLossFn = Callable[..., tuple[torch.Tensor, Metrics]]
"""``fn(policy: PairLogps, reference: ReferenceLogps | None, *, **hyperparameters) -> (loss, metrics)``."""


@dataclass(frozen=True)
class RegisteredLoss:
    """A registry entry: the function and whether it reads reference log-probs."""

    fn: PreferenceLossFn
    needs_reference: bool


PREFERENCE_LOSSES: dict[str, RegisteredLoss] = {}
"""Preference losses by name (the value of a stage's ``loss_type``)."""


def _hyperparameters(name: str, fn: Callable) -> dict[str, inspect.Parameter] | None:
    """The keyword-only hyperparameters of ``fn`` (None: it takes ``**kwargs``); checks the signature."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != 2 or any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(
            f"preference loss {name!r} must have the signature fn(policy, reference, *, <hyperparameters>), "
            f"got {name}{inspect.signature(fn)}"
        )
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name: p for p in params if p.kind is p.KEYWORD_ONLY}


def register_preference_loss(
    name: str, *, needs_reference: bool = True
) -> Callable[[PreferenceLossFn], PreferenceLossFn]:
    """Decorator adding ``fn(policy, reference, *, <hyperparameters>) -> (loss, metrics)`` to
    :data:`PREFERENCE_LOSSES` as ``name``; ``needs_reference=False`` for a reference-free loss (it then
    receives ``reference=None`` and a stage builds no reference model).

    Raises ``ValueError`` when ``name`` is taken and ``TypeError`` for another signature.
    """

    def decorate(fn: PreferenceLossFn) -> PreferenceLossFn:
        if name in PREFERENCE_LOSSES:
            raise ValueError(f"preference loss {name!r} is already registered")
        _hyperparameters(name, fn)
        PREFERENCE_LOSSES[name] = RegisteredLoss(fn, needs_reference)
        return fn

    return decorate


@dataclass(frozen=True)
class BoundPreferenceLoss:
    """A preference loss with its hyperparameters: ``bound(policy, reference) -> (loss, metrics)``.

    Calls ``fn`` with ``reference=None`` when it is reference-free (otherwise checks that ``reference``
    has one row per pair), and checks what it returns: a scalar loss and a dict of tensors, which
    come back detached.

    Attributes:
        name: the registered name, or the class/function path of a loss object.
        fn: the loss function or object.
        args: hyperparameters passed to ``fn`` as keywords.
        needs_reference: whether ``fn`` reads reference log-probs.
    """

    name: str
    fn: Callable
    args: Mapping[str, Any] = field(default_factory=dict)
    needs_reference: bool = True

    def __call__(self, policy: PairLogps, reference: ReferenceLogps | None) -> tuple[torch.Tensor, Metrics]:
        if self.needs_reference and reference is None:
            raise ValueError(f"preference loss {self.name!r} needs reference log-probs, got None")
        if self.needs_reference and len(reference) != len(policy):
            raise ValueError(
                f"reference log-probs have {len(reference)} pairs but the policy's have {len(policy)}"
            )
        out = self.fn(policy, reference if self.needs_reference else None, **self.args)
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and torch.is_tensor(out[0])
            and out[0].dim() == 0
            and isinstance(out[1], Mapping)
            and all(torch.is_tensor(v) for v in out[1].values())
        ):
            raise TypeError(
                f"preference loss {self.name!r} must return (loss, metrics): a scalar tensor and a dict "
                f"of tensors; got {type(out).__name__}"
            )
        return out[0], {k: v.detach() for k, v in out[1].items()}


def _import(path: str) -> Any:
    try:
        return import_object(path)
    except ImportError as e:
        raise ValueError(f"loss_type {path!r}: cannot import it ({e})") from e


def _registered(loss: str) -> tuple[str, RegisteredLoss]:
    """The registry entry of a name, or of the dotted path of a registered function (imported first)."""
    if loss in PREFERENCE_LOSSES:
        return loss, PREFERENCE_LOSSES[loss]
    if "." not in loss and ":" not in loss:
        raise ValueError(
            f"loss_type {loss!r} is not a registered preference loss (one of {sorted(PREFERENCE_LOSSES)}); "
            "give the dotted path of a function decorated with @register_preference_loss, or a class_path"
        )
    fn = _import(loss)
    for name, entry in PREFERENCE_LOSSES.items():
        if entry.fn is fn:
            return name, entry
    raise ValueError(f"loss_type {loss!r} is not registered: decorate it with @register_preference_loss")


def preference_loss(loss: str | PreferenceLoss, args: Mapping[str, Any] | None = None) -> BoundPreferenceLoss:
    """The loss a config names, with its hyperparameters, checked on a two-pair example.

    Args:
        loss: a registered name (``"dpo"``, ``"simpo"``, ...), the dotted path of a registered function
            (``mypkg.losses.my_loss``: importing the module registers it), or a loss object
            (:class:`PreferenceLoss`; reference-free when its ``needs_reference`` is False).
        args: hyperparameters of a registered loss (keyword arguments of its function); a loss
            object takes its own in its constructor, so they must be empty for one.

    Raises:
        ValueError: unknown loss or hyperparameter, or a value the loss rejects (the loss's message,
            e.g. ``beta must be > 0, got 0``).
    """
    args = dict(args or {})
    if isinstance(loss, str):
        name, entry = _registered(loss)
        accepted = _hyperparameters(name, entry.fn)
        unknown = sorted(set(args) - set(accepted)) if accepted is not None else []
        if unknown:
            raise ValueError(
                f"loss_args: preference loss {name!r} has no argument {unknown[0]!r} "
                f"(its arguments: {', '.join(accepted) or 'none'})"
            )
        bound = BoundPreferenceLoss(name, entry.fn, args, entry.needs_reference)
    elif callable(loss):
        if args:
            raise ValueError(
                f"loss_args {sorted(args)} apply to registered losses only; a loss object takes its "
                "hyperparameters in its constructor (init_args)"
            )
        owner = loss if inspect.isfunction(loss) else type(loss)
        name = f"{owner.__module__}.{owner.__qualname__}"
        bound = BoundPreferenceLoss(name, loss, {}, bool(getattr(loss, "needs_reference", True)))
    else:
        raise TypeError(f"loss_type must be a name or a callable loss object, got {type(loss).__name__}")
    _check_on_example(bound)
    return bound


def _check_on_example(bound: BoundPreferenceLoss) -> None:
    """Call ``bound`` once on two pairs, so a bad hyperparameter fails at configuration time."""
    logps = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])  # (2, 2)
    mask = torch.tensor([[True, True], [True, False]])
    policy = PairLogps(logps, mask, logps.flip(0), mask.flip(0))
    reference = ReferenceLogps(torch.tensor([-2.0, -1.0]), torch.tensor([-1.0, -2.0]))
    bound(policy, reference)


def _check_nonnegative(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be >= 0, got {value}")


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be > 0, got {value}")


@register_preference_loss("dpo")
def dpo(
    policy: PairLogps, reference: ReferenceLogps, *, beta: float = 0.1, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, Metrics]:
    """DPO ``-log σ(h)``; with ``label_smoothing = ε > 0`` conservative DPO (algorithms.md §5).

    See :func:`~alignlit.losses.dpo.dpo_loss` (``beta > 0``, ``label_smoothing ∈ [0, 0.5]``).
    """
    return dpo_loss(
        policy.chosen_sum,
        policy.rejected_sum,
        reference.chosen_sum,
        reference.rejected_sum,
        beta=beta,
        label_smoothing=label_smoothing,
    )


@register_preference_loss("ipo")
def ipo(policy: PairLogps, reference: ReferenceLogps, *, beta: float = 0.1) -> tuple[torch.Tensor, Metrics]:
    """IPO ``(h/β - 1/(2β))²`` (algorithms.md §5; :func:`~alignlit.losses.dpo.ipo_loss`)."""
    return ipo_loss(
        policy.chosen_sum, policy.rejected_sum, reference.chosen_sum, reference.rejected_sum, beta=beta
    )


@register_preference_loss("hinge")
def hinge(policy: PairLogps, reference: ReferenceLogps, *, beta: float = 0.1) -> tuple[torch.Tensor, Metrics]:
    """Hinge DPO ``max(0, 1 - h)``, ``h`` the DPO logit with ``β > 0`` included (algorithms.md §9).

    Rewards and metrics are DPO's implicit rewards ``β(log π_θ - log π_0)``.
    """
    _check_positive(beta=beta)
    chosen_rewards, rejected_rewards = implicit_rewards(
        policy.chosen_sum, policy.rejected_sum, reference.chosen_sum, reference.rejected_sum, beta
    )  # (B,) x2
    loss = F.relu(1.0 - (chosen_rewards - rejected_rewards)).mean()
    return loss, reward_metrics(
        loss, chosen_rewards, rejected_rewards, policy.chosen_sum, policy.rejected_sum
    )


@register_preference_loss("simpo", needs_reference=False)
def simpo(
    policy: PairLogps, reference: None, *, beta: float = 2.0, gamma: float = 0.5
) -> tuple[torch.Tensor, Metrics]:
    """SimPO ``-log σ(β(ℓ_w/|y_w| - ℓ_l/|y_l|) - γ)`` (SimPO; algorithms.md §9), reference-free.

    The rewards are the length-normalised ``β·ℓ/|y|``; ``β > 0``, target margin ``γ >= 0``.
    """
    _check_positive(beta=beta)
    _check_nonnegative(gamma=gamma)
    chosen_rewards = beta * policy.chosen_mean  # (B,)
    rejected_rewards = beta * policy.rejected_mean  # (B,)
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma).mean()
    return loss, reward_metrics(
        loss, chosen_rewards, rejected_rewards, policy.chosen_sum, policy.rejected_sum
    )


@register_preference_loss("orpo", needs_reference=False)
def orpo(policy: PairLogps, reference: None, *, beta: float = 0.1) -> tuple[torch.Tensor, Metrics]:
    """ORPO's odds-ratio term ``β · mean(-log σ(logodds_w - logodds_l))`` (Hong et al. 2024),
    reference-free, with ``logodds(y) = ℓ̄ - log(1 - exp(ℓ̄))`` and ``ℓ̄ = ℓ/|y|`` the mean per-token
    log-prob of the response. ORPO trains it with the chosen responses' NLL at weight 1: the stage's SFT
    term (``sft_weight: 1.0``), as the configs set it.

    ``log(1 - exp(ℓ̄))`` is computed as ``log(-expm1(ℓ̄))``; a response of probability 1 (``ℓ̄ = 0``)
    would have infinite odds, so ``ℓ̄`` is clamped to ``-1e-6`` first. Rewards reported are ``β·ℓ̄``.
    """
    _check_positive(beta=beta)
    chosen_mean = policy.chosen_mean.clamp(max=-1e-6)  # (B,)
    rejected_mean = policy.rejected_mean.clamp(max=-1e-6)  # (B,)

    def log_odds(mean: torch.Tensor) -> torch.Tensor:
        return mean - torch.log(-torch.expm1(mean))

    ratio = log_odds(chosen_mean) - log_odds(rejected_mean)  # (B,)
    loss = beta * F.softplus(-ratio).mean()
    metrics = reward_metrics(
        loss, beta * chosen_mean, beta * rejected_mean, policy.chosen_sum, policy.rejected_sum
    )
    metrics["orpo/log_odds_ratio"] = ratio.detach().mean()
    return loss, metrics


@register_preference_loss("slic", needs_reference=False)
def slic(policy: PairLogps, reference: None, *, delta: float = 1.0) -> tuple[torch.Tensor, Metrics]:
    """SLiC-HF calibration loss ``max(0, δ - ℓ_w + ℓ_l)`` (SLiC-HF; algorithms.md §9), reference-free.

    The rewards reported are the sequence log-probs ``ℓ``; ``δ >= 0``. SLiC-HF's regulariser is the
    stage's SFT term (``sft_weight``).
    """
    _check_nonnegative(delta=delta)
    chosen, rejected = policy.chosen_sum, policy.rejected_sum  # (B,) x2
    loss = F.relu(delta - chosen + rejected).mean()
    return loss, reward_metrics(loss, chosen, rejected, chosen, rejected)
