"""Every touch of jsonargparse's (and argparse's) internals, in one place.

The command line relies on three things jsonargparse does not promise across releases; nothing else in
alignlit touches them, and :func:`check` (run by ``tests/cli/test_jsonargparse_internals.py``) fails with
the installed version, the pinned range and the name of what moved when a release changes one:

1. ``parser._actions``: argparse's list of a parser's actions, which jsonargparse parsers keep
   (:func:`parser_actions`; the option names an unrecognized argument is matched against).
2. ``ActionTypeHint._typehint``: the type an option parses its value with; the ``int | float`` options of
   the trainer are set to try ``int`` first (:func:`set_typehint`).
3. ``jsonargparse._common.debug_mode_active``: whether ``JSONARGPARSE_DEBUG`` asks for jsonargparse's own
   error messages (:func:`debug_mode_active`).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import jsonargparse

from alignlit.checks import internals_changed

_ACTIONS = "_actions"
_TYPEHINT = "_typehint"


class JsonargparseInternalsChanged(RuntimeError):
    """The installed jsonargparse no longer has an internal alignlit relies on (module docstring)."""


_changed = functools.partial(internals_changed, JsonargparseInternalsChanged, "jsonargparse", by=__name__)


def parser_actions(parser) -> list:
    """The actions of ``parser`` (argparse's ``parser._actions``)."""
    return list(getattr(parser, _ACTIONS))


def set_typehint(action, hint: Any) -> bool:
    """Make ``action`` parse with ``hint`` when it is a type-hint action; returns whether it is one."""
    if not hasattr(action, _TYPEHINT):
        return False
    setattr(action, _TYPEHINT, hint)
    return True


def debug_mode_active() -> bool:
    """Whether jsonargparse's debug mode (``JSONARGPARSE_DEBUG``) is on."""
    from jsonargparse._common import debug_mode_active as active

    return bool(active())


def check() -> None:
    """Raise :class:`JsonargparseInternalsChanged`, naming the internal, if the installed jsonargparse no
    longer has one of those of the module docstring."""
    try:
        debug_mode_active()
    except (ImportError, AttributeError, TypeError) as e:
        raise _changed("jsonargparse._common.debug_mode_active", f"{type(e).__name__}: {e}") from e
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--x", type=int | float | None)
    actions = [a for a in getattr(parser, _ACTIONS, []) if getattr(a, "dest", None) == "x"]
    if not actions:
        raise _changed(f"ArgumentParser.{_ACTIONS}", "the parser's actions are not listed there")
    if not hasattr(actions[0], _TYPEHINT):
        raise _changed(f"ActionTypeHint.{_TYPEHINT}", "a type-hint option has no such attribute")
    set_typehint(actions[0], int | None)
    try:
        parser.parse_args(["--x", "1.5"])
    except argparse.ArgumentError:
        pass  # the option now parses with the hint set
    else:
        raise _changed(f"ActionTypeHint.{_TYPEHINT}", "setting it does not change the option's type")
