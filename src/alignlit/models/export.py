"""Export a stage's result as a normal Hugging Face directory plus alignlit metadata."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import alignlit

METADATA_FILE = "alignlit.json"


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
) -> Path:
    """Write ``model`` and ``tokenizer`` with ``save_pretrained`` plus ``alignlit.json``.

    The metadata says which stage produced the directory, with what configuration and data. The
    directory is written to a temporary sibling and renamed into place, so a crash never leaves a
    half-written export; an existing export at ``out_dir`` is replaced. ``state_dict`` overrides the
    model's own (pass the gathered full state of a sharded model).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(str(tmp), **({"state_dict": state_dict} if state_dict is not None else {}))
        tokenizer.save_pretrained(str(tmp))
        meta = {
            "alignlit_version": alignlit.__version__,
            "stage": stage,
            "config": config or {},
            "data": data or {},
            "metrics": metrics or {},
        }
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            if old.exists():
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


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``alignlit.json`` of an exported directory ({} for a plain Hugging Face directory)."""
    f = Path(path) / METADATA_FILE
    return json.loads(f.read_text()) if f.exists() else {}
