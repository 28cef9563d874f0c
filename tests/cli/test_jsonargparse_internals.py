"""The jsonargparse internals alignlit relies on (alignlit.cli.jsonargparse_internals) are still there.

``test_the_installed_jsonargparse_has_every_internal`` is the guard: when a release in (or beyond) the
pinned range moves one, it fails with the version, the pinned range and the name of what moved. The other
tests take each internal away and check that the guard says so.
"""

from __future__ import annotations

import jsonargparse
import pytest

from alignlit.cli import jsonargparse_internals
from alignlit.cli.jsonargparse_internals import JsonargparseInternalsChanged
from tests.helpers import assert_names_the_change


def test_the_installed_jsonargparse_has_every_internal():
    jsonargparse_internals.check()


@pytest.mark.parametrize(
    ("constant", "named"),
    [("_ACTIONS", "ArgumentParser._actions_renamed"), ("_TYPEHINT", "ActionTypeHint._typehint_renamed")],
)
def test_an_internal_that_moved_is_named_with_the_pinned_range(monkeypatch, constant, named):
    monkeypatch.setattr(jsonargparse_internals, constant, named.rsplit(".", 1)[1])  # as if renamed
    with pytest.raises(JsonargparseInternalsChanged) as e:
        jsonargparse_internals.check()
    assert_names_the_change(e.value, "jsonargparse", named)


def test_a_missing_debug_mode_function_is_named(monkeypatch):
    from jsonargparse import _common

    monkeypatch.delattr(_common, "debug_mode_active")
    with pytest.raises(JsonargparseInternalsChanged, match="debug_mode_active"):
        jsonargparse_internals.check()


def test_set_typehint_changes_how_an_option_parses():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--x", type=float | None)
    (action,) = [a for a in jsonargparse_internals.parser_actions(parser) if a.dest == "x"]
    assert parser.parse_args(["--x", "1"]).x == 1.0
    assert jsonargparse_internals.set_typehint(action, int | float | None)
    assert type(parser.parse_args(["--x", "1"]).x) is int
    assert not jsonargparse_internals.set_typehint(object(), int)
