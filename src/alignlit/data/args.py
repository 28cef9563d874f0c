"""Checks of size, count and choice arguments, run when an object is built (not when data is read).

Each raises ``ValueError`` naming the argument and the value it got: ``max_prompt_length=0`` or
``max_examples=-1`` must fail at construction, not cut the wrong end of a prompt or drop a record.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any


def resolve_seed(seed: int | None) -> int:
    """``seed``, or with None the run's global seed: the one ``seed_everything`` set before the object was
    built (``alignlit fit``: the config's ``seed_everything``; Lightning keeps it in ``PL_GLOBAL_SEED``),
    else 0. So two runs that differ only in ``seed_everything`` differ in every seeded choice."""
    if seed is not None:
        return seed
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value not in (None, "") else 0


def check_int(name: str, value: Any, minimum: int, *, owner: str = "") -> int:
    """``value`` if it is an integer (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{owner}{': ' if owner else ''}{name} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def check_optional_int(name: str, value: Any, minimum: int, *, owner: str = "") -> int | None:
    """``value`` if it is None or an integer ``>= minimum``."""
    return None if value is None else check_int(name, value, minimum, owner=owner)


def check_fraction(name: str, value: Any, *, owner: str = "") -> float:
    """``value`` if it is a number in ``[0, 1)``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0.0 <= value < 1.0
    if not ok:
        raise ValueError(f"{owner}{': ' if owner else ''}{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: Iterable[str], *, owner: str = "") -> str:
    """``value`` if it is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(
            f"{owner}{': ' if owner else ''}{name} must be one of {list(choices)}, got {value!r}"
        )
    return value


def number_problem(value: Any) -> str | None:
    """Why ``value`` is not a finite number (``"is 'x', not a number"``, ``"is nan, not a finite number"``),
    or None when it is one. Bools are not numbers; an integer too large for a float is refused too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {value!r}, not a number"
    try:
        as_float = float(value)
    except OverflowError:
        return "is an integer too large for a float"
    if not math.isfinite(as_float):
        return f"is {value!r}, not a finite number"
    return None
