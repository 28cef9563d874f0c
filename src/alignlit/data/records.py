"""Reading records from local files and parsing the supported formats.

Every error names the file, the row (1-based line for JSONL) and the field at fault.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HH_ASSISTANT = "\n\nAssistant:"
HH_HUMAN = "\n\nHuman:"


class DataError(ValueError):
    """A malformed record; the message names file, row and field."""


@dataclass(frozen=True)
class Record:
    """One raw record and where it came from (``source`` is ``file:row``)."""

    source: str
    fields: dict[str, Any]

    def error(self, field: str | None, problem: str) -> DataError:
        where = f"{self.source}" + (f", field {field!r}" if field else "")
        return DataError(f"{where}: {problem}")

    def text(self, field: str, *, allow_empty: bool = False) -> str:
        """The string in ``field``; a clear error when it is missing, not a string, or empty."""
        if field not in self.fields:
            raise self.error(field, f"missing (record has {sorted(self.fields)})")
        value = self.fields[field]
        if not isinstance(value, str):
            raise self.error(field, f"expected a string, got {type(value).__name__}")
        if not allow_empty and not value.strip():
            raise self.error(field, "is empty")
        return value


def read_records(path: str | Path) -> list[Record]:
    """Read all records of a local JSONL (optionally .gz), JSON list, Parquet file, or a directory
    written by ``datasets.Dataset.save_to_disk``."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if p.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"{p}: a DatasetDict; point at one split's directory (have {list(ds)})")
        return [Record(f"{p}:{i + 1}", dict(row)) for i, row in enumerate(ds)]
    name = p.name
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
        return [Record(f"{p}:{i + 1}", row) for i, row in enumerate(rows)]
    if name.endswith(".json"):
        try:
            rows = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: invalid JSON ({e})") from e
        if not isinstance(rows, list):
            raise DataError(f"{p}: expected a JSON list of objects")
        return [_as_record(p, i + 1, row) for i, row in enumerate(rows)]
    if name.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if name.endswith(".gz") else open
        out = []
        with opener(p, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
                out.append(_as_record(p, lineno, row))
        return out
    raise DataError(f"{p}: unsupported file type (use .jsonl, .jsonl.gz, .json, .parquet or a datasets dir)")


def _as_record(path: Path, row: int, obj: Any) -> Record:
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{row}: expected a JSON object, got {type(obj).__name__}")
    return Record(f"{path}:{row}", obj)


def split_hh(record: Record, field: str) -> tuple[str, str]:
    """Split an HH-RLHF dialogue into (prompt, response) at the last ``\\n\\nAssistant:``.

    The prompt keeps the ``\\n\\nAssistant:`` marker; the response is what follows it.
    """
    text = record.text(field)
    cut = text.rfind(HH_ASSISTANT)
    if cut < 0:
        raise record.error(field, "not in HH-RLHF format: no '\\n\\nAssistant:' turn")
    cut += len(HH_ASSISTANT)
    return text[:cut], text[cut:]


def parse_prompt_response(record: Record) -> tuple[str, str]:
    """(prompt, response) from a generic ``{"prompt", "response"}`` record or an HH-RLHF record
    (``{"chosen": dialogue}`` or ``{"text": dialogue}``). Empty responses are errors."""
    f = record.fields
    if "prompt" in f and "response" in f:
        prompt, response = record.text("prompt"), record.text("response")
    elif "chosen" in f or "text" in f:
        field = "chosen" if "chosen" in f else "text"
        prompt, response = split_hh(record, field)
        if not response.strip():
            raise record.error(field, "the last Assistant turn is empty")
    else:
        raise record.error(
            None,
            f"unknown format: expected fields 'prompt'+'response' or HH-RLHF 'chosen'/'text', got {sorted(f)}",
        )
    return prompt, response


def parse_prompt(record: Record) -> str:
    """The prompt of a ``{"prompt"}`` record, or of an HH-RLHF dialogue (``chosen``/``text``)."""
    f = record.fields
    if "prompt" in f:
        return record.text("prompt")
    if "chosen" in f or "text" in f:
        return split_hh(record, "chosen" if "chosen" in f else "text")[0]
    raise record.error(None, f"unknown format: expected 'prompt' or HH-RLHF 'chosen'/'text', got {sorted(f)}")
