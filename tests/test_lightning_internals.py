"""The Lightning and torch internals alignlit relies on (alignlit.lightning_internals) are still there.

``test_the_installed_lightning_and_torch_have_every_internal`` is the guard: when a release in (or beyond)
the pinned range moves one, it fails with the version, the pinned range and the name of what moved. The
other tests take each internal away and check that the guard says so.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning
import pytest
from torch import nn

from alignlit import lightning_internals
from alignlit.lightning_internals import LightningInternalsChanged
from tests.helpers import assert_names_the_change


def test_the_installed_lightning_and_torch_have_every_internal():
    lightning_internals.check()


@pytest.mark.parametrize(
    ("constant", "renamed", "named"),
    [
        ("_TRAINER", "_trainer_renamed", "LightningModule._trainer_renamed"),
        ("_STEPPED", "_steps_renamed", "epoch_loop.state_dict._steps_renamed"),
        ("_FIT_LOOP_KEYS", ("epoch_loop.renamed_progress",), "epoch_loop.renamed_progress"),
        ("_COUNTS", ("ready", "renamed"), "epoch_progress.total"),
    ],
)
def test_a_lightning_internal_that_moved_is_named_with_the_pinned_range(
    monkeypatch, constant, renamed, named
):
    monkeypatch.setattr(lightning_internals, constant, renamed)  # as if a release renamed it
    with pytest.raises(LightningInternalsChanged) as e:
        lightning_internals.check()
    assert_names_the_change(e.value, "lightning", named)


def test_a_missing_dropout_base_class_is_named(monkeypatch):
    monkeypatch.delattr(nn.modules.dropout, "_DropoutNd")
    with pytest.raises(LightningInternalsChanged) as e:
        lightning_internals.check()
    assert_names_the_change(e.value, "torch", "_DropoutNd")


def test_the_helpers():
    module = lightning.LightningModule()
    assert lightning_internals.attached_trainer(module) is None
    assert all(lightning_internals.is_dropout(m) for m in (nn.Dropout(), nn.Dropout2d(), nn.AlphaDropout()))
    assert not lightning_internals.is_dropout(nn.Linear(1, 1))


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("lightning.fabric.utilities.cloud_io", "_is_local_file_protocol"),
        ("lightning.pytorch.utilities.imports", "_RICH_AVAILABLE"),
        ("lightning.pytorch.cli.LightningCLI", "_instantiate_trainer"),
    ],
)
def test_a_missing_lightning_name_is_named(monkeypatch, module, name):
    import importlib

    path, _, cls = module.rpartition(".")
    owner = (
        getattr(importlib.import_module(path), cls) if cls[0].isupper() else importlib.import_module(module)
    )
    monkeypatch.delattr(owner, name)
    with pytest.raises(LightningInternalsChanged) as e:
        lightning_internals.check()
    assert_names_the_change(e.value, "lightning", name)


def test_a_changed_instantiate_trainer_signature_is_named(monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(LightningCLI, "_instantiate_trainer", lambda self, config, callbacks, extra: None)
    with pytest.raises(LightningInternalsChanged) as e:
        lightning_internals.check()
    assert_names_the_change(e.value, "lightning", "_instantiate_trainer")


def test_lightning_cli_that_stops_keeping_subcommand_parsers_is_named(monkeypatch):
    monkeypatch.setattr(lightning_internals, "_SUBCOMMAND_PARSERS", "_parsers_renamed")
    with pytest.raises(LightningInternalsChanged, match="_parsers_renamed"):
        lightning_internals.check()


def test_the_io_and_cli_helpers():
    assert lightning_internals.is_local_path("/tmp/a.ckpt") and not lightning_internals.is_local_path(
        "s3://b/a"
    )
    assert isinstance(lightning_internals.rich_available(), bool)
    cli = SimpleNamespace(_subcommand_parsers={"fit": "fit parser"})
    assert lightning_internals.subcommand_parser(cli, "fit", "root") == "fit parser"
    assert lightning_internals.subcommand_parser(cli, "validate", "root") == "root"
