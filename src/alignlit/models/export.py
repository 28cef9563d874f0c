"""Export a stage's result as a normal Hugging Face directory plus alignlit metadata.

An export replaces only what is ours: a directory that is an alignlit export (it has ``alignlit.json``)
or an empty one. Anything else at ``export_dir`` (a file, a folder of user files, a symbolic link) is
refused, and :func:`check_export_dir` says so before training starts.

The new export is written in full to a temporary sibling ``.NAME.tmp-*`` and swapped in with two
renames: ``NAME -> .NAME.old``, then ``.NAME.tmp-* -> NAME``; ``.NAME.old`` is removed last. A crash
between the two renames leaves ``.NAME.old`` and no ``NAME``: the next export puts ``.NAME.old`` back
before its own swap, and loading ``NAME`` says how to restore it (:func:`interrupted_export_message`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import alignlit
from alignlit.models.lora import LoRAExport, has_lora, save_lora_model

METADATA_FILE = "alignlit.json"


class ExportDirError(ValueError):
    """``export_dir`` cannot receive an export (empty string, a file, user files, read-only, ...)."""


def _old(out: Path) -> Path:
    return out.with_name(f".{out.name}.old")


def is_export(path: str | Path) -> bool:
    """True for a directory written by :func:`export_pretrained` (it has ``alignlit.json``)."""
    p = Path(path)
    return p.is_dir() and not p.is_symlink() and (p / METADATA_FILE).is_file()


def interrupted_export_message(path: str | Path) -> str | None:
    """For a missing ``path`` whose export was interrupted between its two renames (``.NAME.old`` is
    there), the sentence that says how to restore it; None otherwise."""
    p = Path(path)
    if p.exists() or p.is_symlink() or not is_export(_old(p)):
        return None
    return (
        f"{p} does not exist, but {_old(p)} does: an export to {p} was interrupted between its two renames. "
        f"{_old(p)} is the previous complete export; restore it with `mv {_old(p)} {p}` "
        "(the next export to this path restores it itself)"
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _probe_writable(parent: Path, out: Path) -> None:
    """Create and remove a temporary directory in ``parent`` (the real test: ``os.access`` says yes on a
    read-only filesystem mounted for root)."""
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent)
    except OSError as e:
        raise ExportDirError(
            f"export_dir {str(out)!r}: cannot write in {parent} ({e.strerror or e}); "
            "choose a writable location"
        ) from e
    os.rmdir(probe)


def check_export_dir(out_dir: str | Path, *, inputs: dict[str, str | Path] | None = None) -> Path:
    """Check, without writing anything that stays, that an export can go to ``out_dir``.

    Raises :class:`ExportDirError` naming the path when ``out_dir`` is ``""``, a file, a symbolic link,
    a non-empty directory that is not an alignlit export, under a file, or in a location where
    nothing can be created (read-only filesystem, no permission); and, naming both, when it is (or
    holds) one of the stage's ``inputs`` (``{"policy": dir, "reference": dir, ...}``): the export would
    replace the model the stage starts from. Called by every stage before training
    (:class:`alignlit.callbacks.ExportDirCheck`, with the stage's input directories) and by
    :func:`export_pretrained`.
    """
    if isinstance(out_dir, str) and not out_dir.strip():
        raise ExportDirError(
            f"export_dir is {out_dir!r}: give the directory the stage's result is written to "
            "(or null for no export)"
        )
    out = Path(out_dir)
    _check_not_an_input(out, inputs or {})
    if out.is_symlink():
        raise ExportDirError(f"export_dir {str(out)!r} is a symbolic link; give the real directory")
    if out.exists():
        if not out.is_dir():
            raise ExportDirError(
                f"export_dir {str(out)!r} is a file, not a directory; alignlit will not replace it"
            )
        if not is_export(out) and any(out.iterdir()):
            raise ExportDirError(
                f"export_dir {str(out)!r} is a non-empty directory that is not an alignlit export (it has no "
                f"{METADATA_FILE}); alignlit replaces only its own exports: choose another directory or "
                "empty it yourself"
            )
    old = _old(out)
    if (old.exists() or old.is_symlink()) and not is_export(old):
        raise ExportDirError(
            f"{old} is in the way of the export to {out} and is not an alignlit export; move it away"
        )
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExportDirError(f"export_dir {str(out)!r}: {parent} is a file, not a directory")
    _probe_writable(parent, out)
    return out


def _check_not_an_input(out: Path, inputs: dict[str, str | Path]) -> None:
    """Refuse an export onto (or around) a directory the stage reads its models from."""
    target = Path(os.path.realpath(out))
    for role, path in inputs.items():
        src = Path(os.path.realpath(path))
        if src == target or target in src.parents:
            where = "is" if src == target else "holds"
            raise ExportDirError(
                f"export_dir {str(out)!r} {where} the {role} directory {str(path)!r} this stage starts from: the "
                f"export would replace the {role} it is trained from; choose another export_dir"
            )


def export_pretrained(
    model,
    tokenizer,
    out_dir: str | Path,
    *,
    stage: str,
    config: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    state_dict: dict[str, Any] | None = None,
    lora_export: LoRAExport = "merged",
    source: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` and ``tokenizer`` with ``save_pretrained`` plus ``alignlit.json``.

    The metadata says which stage produced the directory, with what configuration and data. The
    directory is written to a temporary sibling and renamed into place (see the module docstring), so
    a crash never leaves a half-written export; an existing *export* at ``out_dir`` is replaced,
    anything else is refused (:func:`check_export_dir`). Files and folders get the user's umask.
    ``state_dict`` overrides the model's own (pass the gathered full state of a sharded model). A model
    with a LoRA adapter is written merged (a normal Hugging Face directory) or, with
    ``lora_export="adapter"``, as the adapter alone (:func:`alignlit.models.lora.save_lora_model`).
    ``source`` records where the trained model started (``{"spec": ..., "hub_id": ..., "revision":
    <commit>}`` for a hub model, :func:`alignlit.models.loading.describe_source`).
    """
    out = check_export_dir(out_dir)
    old = _old(out)
    if not out.exists() and is_export(old):  # a previous swap was interrupted: put its export back
        os.replace(old, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700
        with _no_progress_bar():  # transformers' "Writing model shards" bar, one line per export
            if has_lora(model):
                save_lora_model(model, tmp, mode=lora_export, state_dict=state_dict)
            else:
                model.save_pretrained(
                    str(tmp), **({"state_dict": state_dict} if state_dict is not None else {})
                )
        tokenizer.save_pretrained(str(tmp))
        meta = {
            "alignlit_version": alignlit.__version__,
            "stage": stage,
            "config": config or {},
            "data": data or {},
            "metrics": metrics or {},
        }
        if source:
            meta["source"] = {k: v for k, v in source.items() if k != "dir"}
        # written last: a directory with alignlit.json is a complete export
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        if out.exists():
            if is_export(old):  # left by a crash after a completed swap
                shutil.rmtree(old)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def _no_progress_bar():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``alignlit.json`` of an exported directory ({} for a plain Hugging Face directory)."""
    f = Path(path) / METADATA_FILE
    return json.loads(f.read_text()) if f.exists() else {}
