"""Reading records from local files or memory, and parsing the supported formats.

Every error names where the record came from: ``file:row`` (the 1-based line of a JSONL file, the
1-based element of a JSON list or the row of a Parquet file / ``datasets`` directory) or
``records[i]`` for in-memory records, and the field at fault. Broken bytes (not UTF-8, a truncated
or fake ``.gz``), duplicate keys in one JSON object and lone surrogates (``"\\ud800"``, which no
tokenizer accepts) are reported the same way instead of surfacing as a library traceback.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HH_ASSISTANT = "\n\nAssistant:"
HH_HUMAN = "\n\nHuman:"

SUFFIXES = ".jsonl, .jsonl.gz, .json, .parquet or a datasets.Dataset.save_to_disk directory"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class DataError(ValueError):
    """Bad input data; the message names the file (or ``records[i]``), the row and the field."""


@dataclass(frozen=True)
class Record:
    """One raw record and where it came from (``source`` is ``file:row`` or ``records[i]``)."""

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


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def _lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where (``""``, ``"[2]"``, ``"['content']"``) a string inside ``value`` holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


def _as_record(source: str, obj: Any, *, check_text: bool = True) -> Record:
    if not isinstance(obj, dict):
        raise DataError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    for key in obj:
        if not isinstance(key, str):
            raise DataError(f"{source}: field names must be strings, got {key!r}")
    if check_text:
        for field, value in obj.items():
            inner = _lone_surrogate(value)
            if inner is not None:
                raise DataError(
                    f"{source}, field {field!r}: {'item ' + inner + ' ' if inner else ''}holds a lone "
                    "surrogate (an unpaired \\ud800-\\udfff escape), which is not valid Unicode text"
                )
    return Record(source, obj)


def _parse_json_text(text: str, source: str) -> Record:
    try:
        obj = _DECODER.decode(text)
    except _DuplicateKey as e:
        raise DataError(f"{source}: duplicate key {e.key!r} in one JSON object") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{source}: invalid JSON ({e.msg} at column {e.colno})") from e
    return _as_record(source, obj, check_text=_SURROGATE_ESCAPE.search(text) is not None)


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at byte {e.start + 1} of the line); "
            "save the file as UTF-8"
        ) from None


def _jsonl_lines(p: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a JSONL file, gzip-compressed when the name ends in ``.gz``."""
    gz = p.name.endswith(".gz")
    with gzip.open(p, "rb") if gz else open(p, "rb") as f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except (EOFError, OSError, zlib.error) as e:
                if not gz:
                    raise
                if lineno == 0 and isinstance(e, gzip.BadGzipFile):
                    raise DataError(
                        f"{p}: not a gzip file ({e}); a .gz name needs gzip-compressed JSONL"
                    ) from e
                raise DataError(
                    f"{p}:{lineno + 1}: the gzip data is truncated or corrupt at this line "
                    f"({type(e).__name__}: {e})"
                ) from e
            if not raw:
                return
            lineno += 1
            yield lineno, raw


def _read_jsonl(p: Path) -> list[Record]:
    out = []
    for lineno, raw in _jsonl_lines(p):
        line = _utf8(raw, f"{p}:{lineno}")
        if lineno == 1:
            line = line.removeprefix("\ufeff")
        if line.strip():
            out.append(_parse_json_text(line.rstrip("\r\n"), f"{p}:{lineno}"))
    return out


def _read_json_list(p: Path) -> list[Record]:
    """A JSON list of objects, parsed element by element so that errors name the element (row) and line."""
    data = p.read_bytes()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{p}: not UTF-8 text (byte {data[e.start]:#04x} on line {line}); save it as UTF-8"
        ) from None
    ws = json.decoder.WHITESPACE.match
    pos = ws(text, 0).end()
    if text[pos : pos + 1] != "[":
        raise DataError(f"{p}: expected a JSON list of objects")
    pos = ws(text, pos + 1).end()
    out: list[Record] = []
    if text[pos : pos + 1] == "]":
        return out
    while True:
        row = len(out) + 1
        where = f"{p}:{row}"
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except _DuplicateKey as e:
            raise DataError(f"{where}: duplicate key {e.key!r} in one JSON object") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
        out.append(_as_record(where, obj))
        pos = ws(text, pos).end()
        sep = text[pos : pos + 1]
        if sep == "]":
            break
        if sep != ",":
            line = text.count("\n", 0, pos) + 1
            raise DataError(f"{where}: invalid JSON (expected ',' or ']' after this element, on line {line})")
        pos = ws(text, pos + 1).end()
    if text[pos + 1 :].strip():
        raise DataError(f"{p}: invalid JSON (extra data after the list)")
    return out


def _read_parquet(p: Path) -> list[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{p}: not a readable Parquet file ({type(e).__name__}: {e})") from e
    return [_as_record(f"{p}:{i + 1}", row, check_text=False) for i, row in enumerate(rows)]


def _read_dataset_dir(p: Path) -> list[Record]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise DataError(
            f"{p}: a directory that is not a dataset saved by datasets.Dataset.save_to_disk ({e}); "
            f"data files are {SUFFIXES}"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{p}: a DatasetDict; point at one split's directory (have {list(ds)})")
    return [_as_record(f"{p}:{i + 1}", dict(row), check_text=False) for i, row in enumerate(ds)]


def read_records(path: str | Path) -> list[Record]:
    """Read all records of a local JSONL (optionally .gz), JSON list, Parquet file, or a directory
    written by ``datasets.Dataset.save_to_disk``. Blank JSONL lines are skipped (they are not records)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if p.is_dir():
        return _read_dataset_dir(p)
    name = p.name
    if name.endswith(".parquet"):
        return _read_parquet(p)
    if name.endswith(".json"):
        return _read_json_list(p)
    if name.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(p)
    raise DataError(f"{p}: unsupported file type (use {SUFFIXES})")


def records_from_memory(records: Any, name: str = "records") -> list[Record]:
    """Records given in memory: a list of dicts or a ``datasets.Dataset``. Sources are ``name[i]``."""
    if type(records).__module__.split(".")[0] == "datasets":
        import datasets

        if isinstance(records, datasets.DatasetDict):
            raise DataError(f"{name}: a DatasetDict; pass one split (have {list(records)})")
        if not isinstance(records, datasets.Dataset):
            raise DataError(
                f"{name}: expected a list of dicts or a datasets.Dataset, got {type(records).__name__}"
            )
        return [_as_record(f"{name}[{i}]", dict(row), check_text=False) for i, row in enumerate(records)]
    if not isinstance(records, (list, tuple)):
        raise DataError(
            f"{name}: expected a list of dicts or a datasets.Dataset, got {type(records).__name__}"
        )
    out = []
    for i, row in enumerate(records):
        if not isinstance(row, dict):
            raise DataError(f"{name}[{i}]: expected a dict, got {type(row).__name__}")
        out.append(_as_record(f"{name}[{i}]", dict(row)))
    return out


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
