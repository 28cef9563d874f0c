"""Records from a ``datasets`` source (a hub dataset or local files) and column mappings.

``dataset: {path: openai/gsm8k, name: main, split: train}`` is passed to ``datasets.load_dataset``,
which also reads local files (``{path: json, data_files: data/train.jsonl.gz, split: train}``). Every
row becomes a :class:`~alignlit.data.records.Record` whose source is ``<path>[<split>]:<row>`` (1-based),
so errors name the row as they do for local files. Offline (``HF_HUB_OFFLINE=1`` or
``HF_DATASETS_OFFLINE=1``) a dataset that is not in the local cache fails in one line naming it.

``columns: {question: prompt, answer: answer}`` renames a record's columns (source name -> the name
the DataModule reads) before parsing; a mapped column a record lacks is an error naming the row.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from alignlit.data.records import DataError, Record, _as_record

DATASET_KEYS = frozenset({"path", "name", "split", "data_files", "data_dir", "revision", "trust_remote_code"})


class DatasetNotFound(FileNotFoundError):
    """A ``dataset`` source that cannot be loaded (not cached offline, unknown, no such split)."""


def _offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def describe(spec: Mapping[str, Any]) -> str:
    """``'openai/gsm8k' (name 'main', split 'train')`` for messages."""
    extra = ", ".join(f"{k} {spec[k]!r}" for k in ("name", "split", "data_files", "revision") if spec.get(k))
    return f"{spec.get('path')!r}" + (f" ({extra})" if extra else "")


def check_dataset_spec(spec: Any, what: str = "dataset") -> dict[str, Any]:
    """``spec`` as a dict of ``datasets.load_dataset`` arguments; ValueError naming the bad key."""
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"{what} must be a mapping such as {{path: openai/gsm8k, name: main, split: train}}, "
            f"got {type(spec).__name__}"
        )
    spec = dict(spec)
    unknown = sorted(set(spec) - DATASET_KEYS)
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; expected some of {sorted(DATASET_KEYS)}")
    if not isinstance(spec.get("path"), str) or not spec["path"]:
        raise ValueError(f"{what}: 'path' (a hub dataset name or a builder such as 'json') is required")
    if not isinstance(spec.get("split"), str) or not spec["split"]:
        raise ValueError(f"{what} {describe(spec)}: 'split' is required (e.g. train, test, train[:90%])")
    if spec.get("trust_remote_code"):
        raise ValueError(f"{what} {describe(spec)}: datasets with loading scripts are not supported")
    spec.pop("trust_remote_code", None)
    return spec


def load_dataset_records(spec: Mapping[str, Any], what: str = "dataset") -> list[Record]:
    """The rows of one split of a ``datasets`` source as records (see the module docstring)."""
    spec = check_dataset_spec(spec, what)
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - a dependency
        raise ImportError(f"{what}: reading a dataset needs the `datasets` package ({e})") from e
    where = describe(spec)
    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()  # a quiet log: one line per DataModule says what was read
    try:
        ds = datasets.load_dataset(**spec)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if "split" in first.lower() and "unknown split" in first.lower():
            raise DatasetNotFound(f"{what} {where}: {first}") from None
        hint = (
            "not in the local datasets cache and the hub is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE); "
            "load it once with network, or point at local files: {path: json, data_files: FILE, split: train}"
            if _offline()
            else "could not be loaded"
        )
        raise DatasetNotFound(f"{what} {where}: {hint} ({type(e).__name__}: {first})") from None
    finally:
        if bars:
            datasets.utils.logging.enable_progress_bar()
    if isinstance(ds, datasets.DatasetDict):  # pragma: no cover - split is required
        raise DataError(f"{what} {where}: a DatasetDict; name one split (have {list(ds)})")
    name = spec["path"] if spec["path"] not in ("json", "parquet", "csv") else str(spec.get("data_files"))
    source = f"{name}[{spec['split']}]"
    return [_as_record(f"{source}:{i + 1}", dict(row)) for i, row in enumerate(ds)]


def check_columns(columns: Any, what: str = "columns") -> dict[str, str] | None:
    """``columns`` as a ``{source column: target name}`` dict of strings (None stays None)."""
    if columns is None:
        return None
    if not isinstance(columns, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in columns.items()
    ):
        raise ValueError(f"{what} must map column names to names, e.g. {{question: prompt}}, got {columns!r}")
    targets = list(columns.values())
    dup = sorted({t for t in targets if targets.count(t) > 1})
    if dup:
        raise ValueError(f"{what}: several columns map to {dup}")
    return dict(columns)


def columns_from_pairs(items: Sequence[str], what: str = "--columns") -> dict[str, str] | None:
    """``["question:prompt", ...]`` (the command-line form) as a checked ``{source: target}`` mapping;
    None for no items. ValueError naming a malformed item."""
    columns = {}
    for item in items:
        src, sep, dst = item.partition(":")
        if not sep or not src or not dst:
            raise ValueError(f"{what} takes SRC:DST pairs, got {item!r}")
        columns[src] = dst
    return check_columns(columns, what) if columns else None


def rename_columns(records: list[Record], columns: Mapping[str, str] | None) -> list[Record]:
    """Records with ``columns`` renamed (source -> target); a record without a mapped column, or one
    that already has a target name as another column, is an error naming its row."""
    if not columns:
        return records
    out = []
    for r in records:
        missing = [c for c in columns if c not in r.fields]
        if missing:
            raise r.error(
                missing[0],
                f"missing; `columns` maps it to {columns[missing[0]]!r} (record has {sorted(r.fields)})",
            )
        fields = {k: v for k, v in r.fields.items() if k not in columns}
        clash = [t for t in columns.values() if t in fields]
        if clash:
            raise r.error(
                clash[0], "the record already has this column, and `columns` maps another column to it"
            )
        fields.update({columns[k]: r.fields[k] for k in columns})
        out.append(Record(r.source, fields))
    return out
