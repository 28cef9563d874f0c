"""Argument checks and resolution shared across layers (this module imports nothing from alignlit)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import TypeVar

#: the largest learning rate accepted: an AdamW step moves each weight by about ``lr``, so anything
#: above this is a typo, and ~1e38 overflows float32 inside the optimizer
MAX_LR = 10.0

E = TypeVar("E", bound=Exception)


def validate_optimizer_args(
    lr: float,
    weight_decay: float = 0.0,
    betas: Sequence[float] = (0.9, 0.999),
    *,
    eps: float | None = None,
    warmup_steps: int | None = None,
    min_lr_ratio: float | None = None,
    max_lr: float = MAX_LR,
    prefix: str = "optim.",
) -> None:
    """Raise ``ValueError`` naming the field (``{prefix}lr``, ...) for optimizer settings AdamW cannot
    use: a learning rate that is not finite, not > 0 or above ``max_lr`` (``lr: 1e38`` overflows inside
    AdamW), a negative or non-finite weight decay, betas outside [0, 1), ``eps`` <= 0, negative warmup,
    or a final-LR ratio outside [0, 1]."""

    def bad(field: str, value, rule: str) -> ValueError:
        return ValueError(f"{prefix}{field} must be {rule}, got {value!r}")

    if (
        isinstance(lr, bool)
        or not isinstance(lr, (int, float))
        or not math.isfinite(lr)
        or not 0 < lr <= max_lr
    ):
        raise bad("lr", lr, f"a finite number in (0, {max_lr:g}]")
    if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise bad("weight_decay", weight_decay, "a finite number >= 0")
    betas = tuple(betas)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise bad("betas", betas, "two numbers in [0, 1)")
    if eps is not None and not (math.isfinite(eps) and eps > 0):
        raise bad("eps", eps, "a finite number > 0")
    if warmup_steps is not None and (isinstance(warmup_steps, bool) or warmup_steps < 0):
        raise bad("warmup_steps", warmup_steps, "an integer >= 0")
    if min_lr_ratio is not None and not (math.isfinite(min_lr_ratio) and 0 <= min_lr_ratio <= 1):
        raise bad("min_lr_ratio", min_lr_ratio, "in [0, 1]")


def import_object(path: str):
    """The object at a dotted path, ``package.module.name`` or ``package.module:name`` (config values
    naming a reward function, a preference loss, ...). Raises ``ImportError`` naming what is missing."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not a dotted path 'package.module.name'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from e


def resolve_registered(name: str, registry: dict, what: str):
    """``name`` when it is a key of ``registry``, else the function at the dotted path ``name``
    (importing it may register it too); ``ValueError`` naming ``what`` otherwise."""
    if name in registry:
        return name
    if "." in name:
        try:
            fn = import_object(name)
        except ImportError as e:
            raise ValueError(f"{what} {name!r} is neither registered nor importable ({e})") from e
        if callable(fn):
            return fn
    raise ValueError(f"unknown {what} {name!r}; expected one of {sorted(registry)} or a dotted function path")


def pinned_range(distribution: str) -> str:
    """The version range of ``distribution`` alignlit's metadata requires (e.g. ``transformers<5.20,>=5.16.1``),
    for messages about a dependency's internals; ``the range in pyproject.toml`` when the metadata is absent."""
    from importlib import metadata

    try:
        requires = metadata.requires("alignlit") or []
    except metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        spec = req.split(";")[0].strip()
        name = spec.split("[")[0]
        for sep in "<>=!~ ":
            name = name.split(sep)[0]
        if name.lower() == distribution.lower():
            return spec
    return f"{distribution} (the range in pyproject.toml)"


def internals_changed(
    error: type[E], library: str, internal: str, detail: str, *, by: str, distribution: str | None = None
) -> E:
    """An ``error`` of a quarantine module (``by``, its ``__name__``): ``internal`` of the installed ``library``
    (an import name) moved or changed (``detail``); names the installed version and the pinned range of
    ``distribution`` (default: ``library``)."""
    version = importlib.import_module(library).__version__
    return error(
        f"{library} {version}: {internal} moved or changed ({detail}); {by} relies on it: install the pinned "
        f"{pinned_range(distribution or library)}, or update {by.rpartition('.')[2]}"
    )
