"""Every touch of Lightning's and torch's internals, in one place.

alignlit relies on a few things Lightning and torch do not promise across releases; nothing else in
alignlit touches them, and :func:`check` (run by ``tests/test_lightning_internals.py``) fails with the
installed version, the pinned range and the name of what moved when a release changes one:

1. ``LightningModule._trainer``: the trainer a module is attached to, or None (the public ``trainer``
   property raises when there is none); read by :func:`attached_trainer`.
2. The fit loop's checkpoint state (``checkpoint["loops"]["fit_loop"]``): the keys
   ``epoch_progress``, ``epoch_loop.batch_progress`` (``total``/``current`` counts of ``ready``,
   ``started``, ``processed``, ``completed``; ``is_last_batch``), ``epoch_loop.state_dict``'s
   ``_batches_that_stepped``, ``epoch_loop.scheduler_progress``, ``epoch_loop.val_loop.batch_progress``
   and ``state_dict``'s ``combined_loader``, rewritten by :func:`finish_epoch_in_checkpoint`.
3. ``torch.nn.modules.dropout._DropoutNd``: the base class of every torch dropout layer
   (:func:`is_dropout`).
4. ``lightning.fabric.utilities.cloud_io._is_local_file_protocol``: whether a checkpoint path is on the
   local file system (:func:`is_local_path`).
5. ``lightning.pytorch.utilities.imports._RICH_AVAILABLE``: whether Lightning's rich progress bar can run
   (:func:`rich_available`).
6. ``LightningCLI._subcommand_parsers`` (the parser of each subcommand, read by :func:`subcommand_parser`)
   and ``LightningCLI._instantiate_trainer(config, callbacks)``, which ``alignlit.cli.lightning.AlignCLI``
   overrides to add its checkpoint plugin and progress bar (its presence is checked here).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import lightning
from torch import nn

from alignlit.checks import internals_changed

_TRAINER = "_trainer"
_STEPPED = "_batches_that_stepped"
_FIT_LOOP_KEYS = (
    "epoch_progress",
    "epoch_loop.batch_progress",
    "epoch_loop.state_dict",
    "epoch_loop.scheduler_progress",
    "epoch_loop.val_loop.batch_progress",
    "state_dict",
)
_COUNTS = ("ready", "started", "processed", "completed")
_SUBCOMMAND_PARSERS = "_subcommand_parsers"


class LightningInternalsChanged(RuntimeError):
    """The installed Lightning or torch no longer has an internal alignlit relies on (module docstring)."""


_changed = functools.partial(internals_changed, LightningInternalsChanged, by=__name__)
"""``_changed(library, internal, detail)``: the library is ``"lightning"`` or ``"torch"``."""


def attached_trainer(module: lightning.LightningModule) -> lightning.Trainer | None:
    """The trainer ``module`` is attached to, or None (``module.trainer`` raises then)."""
    return getattr(module, _TRAINER)


def is_local_path(path) -> bool:
    """Whether ``path`` is on the local file system (no ``s3://``-style protocol), as Lightning decides."""
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

    return _is_local_file_protocol(str(path))


def rich_available() -> bool:
    """Whether Lightning's rich progress bar can run (the ``rich`` package is installed)."""
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    return bool(_RICH_AVAILABLE)


def subcommand_parser(cli, subcommand: str | None, default):
    """The parser of ``subcommand`` of a ``LightningCLI`` (``default`` when it has none)."""
    return getattr(cli, _SUBCOMMAND_PARSERS, {}).get(subcommand, default)


def is_dropout(module: nn.Module) -> bool:
    """Whether ``module`` is a torch dropout layer (``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout``...)."""
    return isinstance(module, nn.modules.dropout._DropoutNd)


def finish_epoch_in_checkpoint(checkpoint: dict[str, Any]) -> bool:
    """Make a checkpoint written after the last batch of an epoch resume at the start of the next one.

    Lightning 2.6 writes ``every_n_train_steps`` checkpoints in ``on_train_batch_end``, before it marks
    the batch completed and the epoch processed. Resumed from one written at the *last* batch of epoch
    ``e``, its fit loop counts that epoch as finished twice and continues in epoch ``e + 2``: a whole
    epoch is never trained, silently (with ``max_steps`` the same happens even from its own
    end-of-epoch checkpoints). This rewrites the loop state to the one Lightning has at the start of
    epoch ``e + 1`` (the epoch ready, not started; a fresh batch count; the step counted; no loader
    position, so the loader starts the new epoch's order), from which it resumes correctly. The
    end-of-epoch validation of epoch ``e``, which ran after the checkpoint was written, is not
    repeated. Returns whether the checkpoint was rewritten.
    """
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if not loop or "epoch_loop.batch_progress" not in loop or "epoch_progress" not in loop:
        return False
    batches, epochs = loop["epoch_loop.batch_progress"], loop["epoch_progress"]
    total, done = batches["total"], epochs["total"]
    after_batch_end = total["started"] == total["processed"] in (total["completed"], total["completed"] + 1)
    epoch_open = done["ready"] == done["started"] == done["completed"] + 1 and done["processed"] in (
        done["completed"],
        done["completed"] + 1,
    )
    if not (batches.get("is_last_batch") and after_batch_end and epoch_open):
        return False
    if total["completed"] < total["processed"]:  # written in on_train_batch_end: count the batch
        total["completed"] += 1
        loop["epoch_loop.state_dict"]["_batches_that_stepped"] += 1
    batches["current"] = {key: 0 for key in batches["current"]}
    batches["is_last_batch"] = False
    for part in ("total", "current"):  # epoch e processed and completed, e + 1 ready
        epochs[part].update(started=epochs[part]["ready"], processed=epochs[part]["ready"])
        epochs[part].update(completed=epochs[part]["ready"], ready=epochs[part]["ready"] + 1)
    for key in ("epoch_loop.scheduler_progress", "epoch_loop.val_loop.batch_progress"):
        if key in loop:
            loop[key]["current"] = {k: 0 for k in loop[key]["current"]}
    loop.setdefault("state_dict", {})["combined_loader"] = []
    return True


def check() -> None:
    """Raise :class:`LightningInternalsChanged`, naming the internal, if the installed Lightning or torch no
    longer has one of those of the module docstring."""
    if not hasattr(lightning.LightningModule(), _TRAINER):
        raise _changed("lightning", f"LightningModule.{_TRAINER}", "a module has no such attribute")
    loop = lightning.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False).fit_loop
    state = loop.state_dict()
    missing = [key for key in _FIT_LOOP_KEYS if key not in state]
    if missing:
        raise _changed("lightning", f"the fit loop's checkpoint state {missing}", "keys not written")
    if _STEPPED not in state["epoch_loop.state_dict"]:
        raise _changed("lightning", f"epoch_loop.state_dict.{_STEPPED}", "not in the epoch loop's state")
    for key in ("epoch_progress", "epoch_loop.batch_progress"):
        for part in ("total", "current"):
            counts = state[key].get(part, {})
            if any(c not in counts for c in _COUNTS):
                raise _changed(
                    "lightning", f"{key}.{part}", f"has {sorted(counts)}, expected {list(_COUNTS)}"
                )
    if "is_last_batch" not in state["epoch_loop.batch_progress"]:
        raise _changed("lightning", "epoch_loop.batch_progress.is_last_batch", "not in the batch progress")
    _check_cli_and_io()
    base = getattr(nn.modules.dropout, "_DropoutNd", None)
    if not (isinstance(base, type) and issubclass(nn.Dropout, base)):
        raise _changed("torch", "torch.nn.modules.dropout._DropoutNd", "not the base class of nn.Dropout")


def _check_cli_and_io() -> None:
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch import cli
    from lightning.pytorch.utilities import imports

    if not callable(getattr(cloud_io, "_is_local_file_protocol", None)):
        raise _changed("lightning", "lightning.fabric.utilities.cloud_io._is_local_file_protocol", "gone")
    if not (is_local_path("/tmp/x.ckpt") and not is_local_path("s3://bucket/x.ckpt")):
        raise _changed("lightning", "cloud_io._is_local_file_protocol", "no longer tells local paths")
    if not hasattr(imports, "_RICH_AVAILABLE"):
        raise _changed("lightning", "lightning.pytorch.utilities.imports._RICH_AVAILABLE", "gone")
    if not callable(getattr(cli.LightningCLI, "_instantiate_trainer", None)):
        raise _changed("lightning", "LightningCLI._instantiate_trainer", "AlignCLI overrides it")
    if list(inspect.signature(cli.LightningCLI._instantiate_trainer).parameters) != [
        "self",
        "config",
        "callbacks",
    ]:
        raise _changed(
            "lightning",
            "LightningCLI._instantiate_trainer",
            "AlignCLI overrides it as (self, config, callbacks)",
        )
    source = inspect.getsource(cli.LightningCLI)
    if f"self.{_SUBCOMMAND_PARSERS}" not in source:
        raise _changed("lightning", f"LightningCLI.{_SUBCOMMAND_PARSERS}", "no longer set by LightningCLI")
