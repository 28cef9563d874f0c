"""Crash-safe checkpoint files, and clear errors for checkpoints that cannot be used.

Lightning's ``TorchCheckpointIO`` serialises into memory and hands the bytes to fsspec, which for a
local path writes a temporary file in ``$TMPDIR`` and moves it to the destination. When the checkpoint
folder is on another filesystem than ``$TMPDIR`` that move is a copy straight into ``last.ckpt``: a
kill during the copy leaves a truncated ``last.ckpt`` and nothing to resume from.
:class:`AtomicCheckpointIO` writes the temporary file in the destination folder, fsyncs it,
``os.replace``-s it over the destination (atomic within one filesystem) and fsyncs the folder, so the
destination always holds either the previous complete checkpoint or the new complete one.

``alignlit fit`` installs it by default; with a plain ``lightning.Trainer`` pass
``plugins=[AtomicCheckpointIO()]``.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from alignlit.lightning_internals import is_local_path

#: key of the alignlit entry a checkpoint carries (written by :class:`alignlit.callbacks.CheckpointGuard`)
CHECKPOINT_KEY = "alignlit"


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used: truncated, not a checkpoint, or of another stage."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` so that ``path`` is never seen half-written.

    The bytes go to ``.NAME.<random>.tmp`` beside ``path``, are fsynced, and the file is renamed over
    ``path`` (then the folder is fsynced). The file gets the user's umask, as an ``open()`` would. A
    failure or a kill before the rename leaves ``path`` untouched; the temporary file is removed on an
    exception, and leftovers of a killed writer are removed by the next successful save of ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    return path


def read_checkpoint(
    path: str | Path, *, map_location: Any = None, weights_only: bool | None = None, mmap: bool = False
) -> dict:
    """Load a checkpoint file with ``torch.load``, or raise :class:`CheckpointError` naming it.

    ``mmap=True`` maps the file instead of reading it (cheap for a check of its metadata).

    A truncated file (a copy killed half-way), an empty file or anything that is not a torch checkpoint
    gives an error that says so and which file it is, instead of ``OSError: Invalid argument`` or an
    unpickling error from deep inside ``torch.load``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist (or is not a file)")
    size = p.stat().st_size
    try:
        checkpoint = torch.load(p, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {p} ({size} bytes) cannot be read: it is truncated (e.g. a copy that was killed "
            f"half-way) or not a PyTorch checkpoint ({type(e).__name__}: {e}). Resume from an earlier "
            "checkpoint of the same run"
        ) from e
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {p} is not a Lightning checkpoint (it has no 'state_dict')")
    return checkpoint


def checkpoint_module(checkpoint: dict) -> tuple[str | None, str | None]:
    """``(module class path, stage)`` recorded in a Lightning checkpoint of an alignlit stage (None
    where unknown: a checkpoint written before alignlit recorded it, outside the CLI)."""
    meta = checkpoint.get(CHECKPOINT_KEY) or {}
    hparams = checkpoint.get("hyper_parameters") or {}
    return meta.get("module") or hparams.get("_class_path"), meta.get("stage")


def _resolve(class_path: str):
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def check_checkpoint_module(checkpoint: dict, expected: str | type, path: str | Path) -> None:
    """Raise :class:`CheckpointError` when ``checkpoint`` was written by another stage than
    ``expected`` (a class or its class path), naming both and the file."""
    saved, stage = checkpoint_module(checkpoint)
    if saved is None:
        return
    want = expected if isinstance(expected, type) else _resolve(expected)
    have = _resolve(saved)
    if want is not None and have is not None:  # a subclass of the stage resumes its checkpoints, and back
        same = issubclass(want, have) or issubclass(have, want)
    else:
        want_name = expected.__name__ if isinstance(expected, type) else expected.rpartition(".")[2]
        same = saved.rpartition(".")[2] == want_name
    if not same:
        wanted = f"{expected.__module__}.{expected.__qualname__}" if isinstance(expected, type) else expected
        raise CheckpointError(
            f"checkpoint {path} was written by {saved}"
            + (f" (stage {stage!r})" if stage else "")
            + f", but the model to resume is {wanted}: resume a stage only from its own checkpoints "
            "(to start a stage from another stage's result, give that stage's export directory as its model)"
        )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` whose local saves are atomic and durable (:func:`atomic_torch_save`)
    and whose loads fail with a :class:`CheckpointError` naming the file.

    Remote paths (``s3://…``) are left to Lightning's own writer.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}"
            )
        if not is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)
        return None

    def load_checkpoint(
        self, path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict:
        if not is_local_path(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return read_checkpoint(path, map_location=map_location, weights_only=weights_only)
