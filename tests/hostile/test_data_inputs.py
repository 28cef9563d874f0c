"""Hostile inputs through every reader and DataModule of alignlit.data.

Each case asserts the exact error class and that the message names the file (or ``records[i]``), the
row and the field where there is one, or the exact count where the policy is to drop. Cases marked
``fix`` gave a silently wrong result, an unclear traceback or no file/row before this suite (checked
against the earlier data layer); the others already gave a clear error and are kept so they stay so.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignlit.data import (
    DataError,
    PairError,
    PreferenceDataModule,
    PromptDataModule,
    RankingDataModule,
    SFTDataModule,
    Truncation,
    read_ranked,
    read_records,
)

SMALL = dict(max_length=32, max_prompt_length=16)
HH = "\n\nHuman: copy a b\n\nAssistant:"


# ---------------------------------------------------------------------------------- file inputs
@dataclass
class FileCase:
    """A file (JSONL lines, raw bytes, or a writer) read by one reader; the expected error class and
    message (a regex, ``{f}`` standing for the escaped file path)."""

    name: str
    reader: str
    content: list[str] | bytes | Callable[[Path], None]
    error: type[Exception]
    match: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    fix: bool = False

    def __str__(self) -> str:
        return self.name


def _line(**fields: Any) -> str:
    return json.dumps(fields)


def _gz(lines: int) -> bytes:
    return gzip.compress(b"".join(b'{"prompt": "p%d", "response": " r"}\n' % i for i in range(lines)))


def _truncated_gz(path: Path) -> None:
    data = _gz(2000)
    path.write_bytes(data[: len(data) // 2])


def _corrupt_gz(path: Path) -> None:
    data = _gz(2000)
    path.write_bytes(data[:200] + bytes(200) + data[400:])


def _parquet_rows(rows: list[dict]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)

    return write


def _not_a_dataset_dir(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("hello")


def _dataset_dict(path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a"}])}).save_to_disk(str(path))


def _tokenizer_dir_with(files: dict[str, str]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.mkdir()
        for name, text in files.items():
            (path / name).write_text(text)

    return write


GOOD_PAIR = _line(prompt="p", chosen=" a", rejected=" b")
GOOD_SFT = _line(prompt="p", response=" a")

FILE_CASES = [
    # ---- non-finite and out-of-range numbers: every reader rejects them, naming file, row and field
    FileCase("pref-margin-infinity", "pref", [GOOD_PAIR, '{"prompt": "p", "chosen": " a", "rejected": " c", "margin": Infinity}'],
             PairError, r"{f}:2, field 'margin': expected a number >= 0 \(finite\), got inf", fix=True),
    FileCase("pref-margin-nan", "pref", ['{"prompt": "p", "chosen": " a", "rejected": " b", "margin": NaN}'],
             PairError, r"{f}:1, field 'margin': expected a number >= 0 \(finite\), got nan"),
    FileCase("pref-margin-huge-int", "pref", ['{"prompt": "p", "chosen": " a", "rejected": " b", "margin": 1' + "0" * 400 + "}"],
             PairError, r"{f}:1, field 'margin': expected a number >= 0 \(finite\), got an integer too large", fix=True),
    FileCase("pref-margin-negative", "pref", [_line(prompt="p", chosen=" a", rejected=" b", margin=-1)],
             PairError, r"{f}:1, field 'margin': expected a number >= 0 \(finite\), got -1"),
    FileCase("pref-ranked-score-nan", "pref", ['{"prompt": "p", "responses": [" a", " b"], "scores": [NaN, 1]}'],
             PairError, r"{f}:1, field 'scores': score 0 is nan, not a finite number", fix=True),
    FileCase("pref-ranked-score-infinity", "pref", ['{"prompt": "p", "responses": [" a", " b"], "scores": [1, -Infinity]}'],
             PairError, r"{f}:1, field 'scores': score 1 is -inf, not a finite number", fix=True),
    FileCase("rank-score-infinity", "rank", [_line(prompt="p", responses=[" a", " b"], scores=[0, 1]), '{"prompt": "p", "responses": [" a", " b"], "scores": [0, Infinity]}'],
             DataError, r"{f}:2, field 'scores': item 1 is inf, not a finite number"),
    FileCase("ranked-score-huge-int", "ranked", ['{"prompt": "p", "responses": [" a", " b"], "scores": [0, 9' + "9" * 400 + "]}"],
             DataError, r"{f}:1, field 'scores': item 1 is an integer too large for a float", fix=True),
    FileCase("ranked-negative-length", "ranked", [_line(prompt="p", responses=[" a", " b"], scores=[0, 1], lengths=[3, -2])],
             DataError, r"{f}:1, field 'lengths': must be token counts >= 0", fix=True),
    FileCase("ranked-scores-not-numbers", "rank", [_line(prompt="p", responses=[" a", " b"], scores=[1.0, "x"])],
             DataError, r"{f}:1, field 'scores': item 1 is 'x', expected a number"),
    FileCase("pref-ranked-score-bool", "pref", [_line(prompt="p", responses=[" a", " b"], scores=[True, 0])],
             PairError, r"{f}:1, field 'scores': score 0 is True, not a number"),
    # ---- duplicate keys inside one JSON object
    FileCase("dup-key-jsonl", "sft", [GOOD_SFT, '{"prompt": "a", "response": " b", "prompt": "c"}'],
             DataError, r"{f}:2: duplicate key 'prompt' in one JSON object", fix=True),
    FileCase("dup-key-json-list", "read", ['[{"prompt": "a", "response": " b"},', '{"prompt": "a", "response": " b", "response": " c"}]'],
             DataError, r"{f}:2: duplicate key 'response' in one JSON object", fix=True),
    FileCase("dup-key-nested-message", "pref", ['{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "role": "user"}], "rejected": []}'],
             DataError, r"{f}:1: duplicate key 'role' in one JSON object", fix=True),
    # ---- broken bytes: encoding, compression, containers
    FileCase("non-utf8-jsonl", "sft", [GOOD_SFT, GOOD_SFT], DataError, r"{f}:3: not UTF-8 text \(byte 0xff at byte 13 of the line\)", fix=True),
    FileCase("latin1-jsonl", "read", b'{"prompt": "a", "response": " b"}\n{"prompt": "caf\xe9", "response": " b"}\n',
             DataError, r"{f}:2: not UTF-8 text \(byte 0xe9", fix=True),
    FileCase("non-utf8-json", "read", b'[\n{"prompt": "a"},\n{"prompt": "\xff"}\n]', DataError, r"{f}: not UTF-8 text \(byte 0xff on line 3\)", fix=True),
    FileCase("truncated-gz", "sft", _truncated_gz, DataError, r"{f}:\d+: the gzip data is truncated or corrupt at this line \(EOFError", fix=True),
    FileCase("corrupt-gz", "read", _corrupt_gz, DataError, r"{f}:1: the gzip data is truncated or corrupt at this line", fix=True),
    FileCase("fake-gz", "read", [GOOD_SFT], DataError, r"{f}: not a gzip file .*a \.gz name needs gzip-compressed JSONL", fix=True),
    FileCase("corrupt-parquet", "read", b"PAR1 this is not parquet", DataError, r"{f}: not a readable Parquet file", fix=True),
    FileCase("lone-surrogate-jsonl", "sft", [GOOD_SFT, '{"prompt": "a", "response": " b\\udc80"}'],
             DataError, r"{f}:2, field 'response': holds a lone surrogate", fix=True),
    FileCase("lone-surrogate-in-list", "rank", ['{"prompt": "p", "responses": [" a", "\\ud800 b"], "scores": [0, 1]}'],
             DataError, r"{f}:1, field 'responses': item \[1\] holds a lone surrogate", fix=True),
    FileCase("lone-surrogate-prompt-file", "prompt", ['{"prompt": "x\\ud83d"}'],
             DataError, r"{f}:1, field 'prompt': holds a lone surrogate", fix=True),
    FileCase("json-truncated-names-row", "read", ['[{"prompt": "a", "response": " b"}, {"prompt": '],
             DataError, r"{f}:2: invalid JSON \(Expecting value at line 2 column 1\)", fix=True),
    FileCase("json-missing-comma", "read", ['[{"prompt": "a"}', '{"prompt": "b"}]'],
             DataError, r"{f}:1: invalid JSON \(expected ',' or '\]' after this element, on line 2\)"),
    FileCase("json-not-a-list", "read", ['{"prompt": "a"}'], DataError, r"{f}: expected a JSON list of objects"),
    FileCase("json-element-not-object", "read", ['[{"prompt": "a"}, 3]'], DataError, r"{f}:2: expected a JSON object, got int"),
    FileCase("json-extra-data", "read", ['[{"prompt": "a"}] x'], DataError, r"{f}: invalid JSON \(extra data after the list\)"),
    FileCase("jsonl-invalid-line", "sft", [GOOD_SFT, '{"prompt": "a", "response": '], DataError, r"{f}:2: invalid JSON \(Expecting value at column 29\)"),
    FileCase("jsonl-line-is-a-list", "read", ["[1, 2]"], DataError, r"{f}:1: expected a JSON object, got list"),
    FileCase("empty-file", "sft", [], DataError, r"{f}: no training examples left \(0 records"),
    FileCase("unsupported-extension", "read", [GOOD_SFT], DataError, r"{f}: unsupported file type \(use \.jsonl"),
    FileCase("directory-not-a-dataset", "read", _not_a_dataset_dir, DataError,
             r"{f}: a directory that is not a dataset saved by datasets\.Dataset\.save_to_disk"),
    FileCase("dataset-dict-directory", "read", _dataset_dict, DataError, r"{f}: a DatasetDict; point at one split's directory \(have \['train'\]\)"),
    FileCase("parquet-row-wrong-type", "sft", _parquet_rows([{"prompt": "a", "response": " b"}, {"prompt": "a", "response": None}]),
             DataError, r"{f}:2, field 'response': expected a string, got NoneType"),
    # ---- records that are malformed for their format
    FileCase("sft-unknown-format", "sft", [_line(prompt="a")], DataError, r"{f}:1: unknown format: expected fields 'prompt'\+'response'"),
    FileCase("sft-response-not-string", "sft", [_line(prompt="a", response=3)], DataError, r"{f}:1, field 'response': expected a string, got int"),
    FileCase("sft-empty-response", "sft", [GOOD_SFT, _line(prompt="a", response="  ")], DataError, r"{f}:2, field 'response': is empty"),
    FileCase("sft-not-hh", "sft", [_line(chosen="\n\nHuman: hi")], DataError, r"{f}:1, field 'chosen': not in HH-RLHF format"),
    FileCase("sft-hh-empty-last-turn", "sft", [_line(text="\n\nHuman: hi\n\nAssistant:  ")], DataError, r"{f}:1, field 'text': the last Assistant turn is empty"),
    FileCase("pref-chosen-equals-rejected", "pref", [GOOD_PAIR, _line(prompt="q", chosen=" same", rejected=" same ")],
             DataError, r"{f}:2, field 'rejected': identical to 'chosen' \(a tie"),
    FileCase("pref-hh-prompts-differ", "pref", [_line(chosen=HH + " a b", rejected="\n\nHuman: copy b a\n\nAssistant: b a")],
             PairError, r"{f}:1, field 'rejected': its dialogue before the last Assistant turn differs"),
    FileCase("pref-not-hh", "pref", [_line(chosen="no turns here", rejected="none")], PairError, r"{f}:1, field 'chosen': not in HH-RLHF format"),
    FileCase("pref-unknown-format", "pref", [_line(text="x")], PairError, r"{f}:1: unknown preference format"),
    FileCase("pref-missing-rejected", "pref", [_line(prompt="p", chosen=" a")], PairError, r"{f}:1, field 'rejected': missing"),
    FileCase("pref-empty-chosen", "pref", [_line(prompt="p", chosen="", rejected=" b")], PairError, r"{f}:1, field 'chosen': is empty"),
    FileCase("pref-bad-message", "pref", [json.dumps({"chosen": [{"role": "user"}], "rejected": [{"role": "user", "content": "x"}]})],
             PairError, r"{f}:1, field 'chosen': message 0 is not a \{'role', 'content'\} object of strings"),
    FileCase("rank-more-than-k", "rank", [_line(prompt="p", responses=[" a", " b"], scores=[0, 1]), _line(prompt="q", responses=[" a", " b", " c"], scores=[0, 1, 2])],
             DataError, r"{f}:2, field 'responses': has 3 responses, more than num_responses=2", {"num_responses": 2}),
    FileCase("rank-scores-count", "rank", [_line(prompt="p", responses=[" a", " b"], scores=[0])],
             DataError, r"{f}:1, field 'scores': has 1 entries for 2 responses"),
    FileCase("sft-overflow-error", "sft", [_line(prompt="a", response=" a" * 40)], DataError,
             r"{f}:1: prompt \(\d+ tokens after truncation\) \+ response \(41 tokens\) exceed max_length=32", {"overflow": "error"}),
    FileCase("prompt-over-limit-error", "prompt", [_line(prompt="short"), _line(prompt=HH * 20)], DataError,
             r"{f}:2: the prompt has \d+ tokens, more than max_prompt_length=8 tokens \(overflow='error'\)",
             {"max_prompt_length": 8, "overflow": "error"}, fix=True),
    # ---- tokenizer folders
    FileCase("tokenizer-folder-empty", "tokenizer", _tokenizer_dir_with({}), FileNotFoundError,
             r"tokenizer folder '{f}' has no tokenizer files: expected tokenizer\.json .* it holds nothing", fix=True),
    FileCase("tokenizer-config-only", "tokenizer", _tokenizer_dir_with({"tokenizer_config.json": "{}"}), FileNotFoundError,
             r"tokenizer folder '{f}' has no tokenizer files.* it holds \['tokenizer_config\.json'\]", fix=True),
    FileCase("tokenizer-json-corrupt", "tokenizer", _tokenizer_dir_with({"tokenizer.json": "{corrupt"}), DataError,
             r"{f}/tokenizer\.json: not valid JSON", fix=True),
    FileCase("tokenizer-not-a-directory", "tokenizer", [GOOD_SFT], FileNotFoundError, r"tokenizer '{f}' is not a directory"),
]  # fmt: skip

FILE_NAMES = {
    "fake-gz": "f.jsonl.gz",
    "truncated-gz": "f.jsonl.gz",
    "corrupt-gz": "f.jsonl.gz",
    "unsupported-extension": "f.csv",
    "non-utf8-json": "f.json",
    "corrupt-parquet": "f.parquet",
    "parquet-row-wrong-type": "f.parquet",
    "directory-not-a-dataset": "ds",
    "dataset-dict-directory": "ds",
    "tokenizer-folder-empty": "tok",
    "tokenizer-config-only": "tok",
    "tokenizer-json-corrupt": "tok",
}


def _write(case: FileCase, tmp_path: Path) -> Path:
    name = FILE_NAMES.get(
        case.name, "f.json" if case.name.startswith(("json-", "dup-key-json-list")) else "f.jsonl"
    )
    path = tmp_path / name
    if callable(case.content):
        case.content(path)
    elif isinstance(case.content, bytes):
        path.write_bytes(case.content)
    else:
        text = "".join(line + "\n" for line in case.content)
        if case.name == "non-utf8-jsonl":
            text += '{"prompt": "\xff", "response": " b"}\n'
            path.write_bytes(text.encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
            return path
        path.write_text(text)
    return path


def _reader(kind: str, path: Path, tokenizer_dir: Path, kwargs: dict[str, Any]):
    from alignlit.data.tokenizer import load_tokenizer

    common = dict(tokenizer=str(tokenizer_dir), val_fraction=0.0)
    if kind == "read":
        return read_records(path)
    if kind == "ranked":
        return read_ranked(path)
    if kind == "tokenizer":
        return load_tokenizer(path)
    if kind == "prompt":
        dm = PromptDataModule(str(path), **{**common, **kwargs})
    else:
        cls = {"sft": SFTDataModule, "pref": PreferenceDataModule, "rank": RankingDataModule}[kind]
        dm = cls(str(path), **{**common, **SMALL, **kwargs})
    dm.setup()
    return dm


@pytest.mark.parametrize("case", FILE_CASES, ids=str)
def test_hostile_file(case: FileCase, tmp_path, tokenizer_dir):
    path = _write(case, tmp_path)
    pattern = "^" + case.match.replace("{f}", re.escape(str(path)))
    with pytest.raises(case.error) as err:
        _reader(case.reader, path, tokenizer_dir, case.kwargs)
    assert type(err.value) is case.error
    assert re.search(pattern, str(err.value)), f"{err.value!s} !~ {pattern}"


def test_the_suite_is_large_and_every_reader_is_in_it():
    readers = {c.reader for c in FILE_CASES}
    assert readers == {"read", "ranked", "sft", "pref", "rank", "prompt", "tokenizer"}
    assert len(FILE_CASES) + len(DROP_CASES) + len(CALL_CASES) >= 60
    assert len({c.name for c in FILE_CASES}) == len(FILE_CASES)


# ------------------------------------------------------------------------ counted drops (exact)
DROP_CASES = [
    # name, reader, lines, kwargs, {count name: exact count}, attribute holding the counts
    ("pref-skip-invalid-counts-by-reason", "pref",
     [GOOD_PAIR, _line(prompt="p", chosen=" a"), _line(prompt="p", chosen=" x", rejected=""),
      _line(prompt="q", chosen=" a", rejected="  "), '{"prompt": "q", "chosen": " a", "rejected": " b", "margin": Infinity}'],
     {"skip_invalid": True}, {"invalid_missing_field": 1, "invalid_empty_response": 2, "invalid_bad_margin": 1, "kept": 1}),
    ("pref-ties-dropped", "pref", [GOOD_PAIR, _line(prompt="q", chosen=" s", rejected=" s")],
     {"drop_ties": True}, {"ties": 1, "kept": 1}),
    ("pref-overflow-drop", "pref", [GOOD_PAIR, _line(prompt="q", chosen=" a" * 40, rejected=" b")],
     {"overflow": "drop"}, {"over_max_length": 1, "kept": 1}),
    ("sft-overflow-drop", "sft", [GOOD_SFT, _line(prompt="a", response=" a" * 40), _line(prompt="b", response=" b" * 40)],
     {"overflow": "drop"}, {"dropped_over_max_length": 2}),
    ("rank-fewer-than-k", "rank", [_line(prompt="p", responses=[" a", " b", " c"], scores=[0, 1, 2]),
                                   _line(prompt="q", responses=[" a", " b"], scores=[0, 1])],
     {}, {"dropped_fewer_than_k_responses": 1}),
    ("rank-blank-response", "rank", [_line(prompt="p", responses=[" a", " b"], scores=[0, 1]),
                                     _line(prompt="q", responses=[" a", "  "], scores=[0, 1])],
     {}, {"dropped_blank_response": 1}),
    ("prompt-over-limit-drop", "prompt", [_line(prompt="short"), _line(prompt=HH * 20), _line(prompt="x" * 5000)],
     {"max_prompt_length": 8, "overflow": "drop"}, {"prompts_dropped_over_max_length": 2}),
    ("prompt-over-limit-truncate", "prompt", [_line(prompt="short"), _line(prompt=HH * 20)],
     {"max_prompt_length": 8}, {"prompts_left_truncated": 1}),
]  # fmt: skip


@pytest.mark.parametrize("name, reader, lines, kwargs, expected", DROP_CASES, ids=[c[0] for c in DROP_CASES])
def test_hostile_drops_are_counted_exactly(name, reader, lines, kwargs, expected, tmp_path, tokenizer_dir):
    path = tmp_path / "f.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    dm = _reader(reader, path, tokenizer_dir, kwargs)
    counts = dm.drops()
    assert {k: counts.get(k, 0) for k in expected} == expected, counts


def test_a_prompt_within_the_limit_is_kept_and_an_overlong_one_keeps_its_last_whole_turn(
    tmp_path, tokenizer, tokenizer_dir
):
    turn = len(tokenizer(HH, add_special_tokens=False).input_ids)
    path = tmp_path / "f.jsonl"
    path.write_text(_line(prompt="short") + "\n" + _line(prompt=HH * 20) + "\n")
    dm = _reader("prompt", path, tokenizer_dir, {"max_prompt_length": turn + 3})
    assert dm.train_prompts == ["short", HH]  # cut at the turn boundary inside the fitting suffix
    assert dm.truncation_counts == {"prompts_left_truncated": 1}


# ------------------------------------------------------------- in-memory records, arguments, calls
def _memory(records, **kwargs):
    def run(tokenizer_dir):
        dm = SFTDataModule(records=records, tokenizer=str(tokenizer_dir), val_fraction=0.0, **SMALL, **kwargs)
        dm.setup()

    return run


def _dataset_dict_records(tokenizer_dir):
    import datasets

    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a", "response": " b"}])})
    SFTDataModule(records=ds, tokenizer=str(tokenizer_dir)).setup()


def _truncate_prompts(prompts, **kwargs):
    def run(tokenizer_dir):
        from alignlit.data import load_tokenizer, truncate_prompts

        return truncate_prompts(load_tokenizer(tokenizer_dir), prompts, **kwargs)

    return run


def _encode_prompts(prompts, max_length):
    def run(tokenizer_dir):
        from alignlit.data import load_tokenizer
        from alignlit.rollout.postprocess import encode_prompts

        return encode_prompts(load_tokenizer(tokenizer_dir), prompts, max_length=max_length)

    return run


def _truncation(**kwargs):
    def run(tokenizer_dir):
        from alignlit.data import load_tokenizer

        return Truncation(load_tokenizer(tokenizer_dir), **kwargs)

    return run


def _construct(cls, **kwargs):
    return lambda tokenizer_dir: cls(**kwargs)


CALL_CASES = [
    # name, call(tokenizer_dir), error class, message regex (from the start), fix
    ("records-lone-surrogate", _memory([{"prompt": "a\ud800", "response": " b"}]), DataError, r"records\[0\], field 'prompt': holds a lone surrogate", True),
    ("records-bad-row", _memory([{"prompt": "a", "response": " b"}, ["a", "b"]]), DataError, r"records\[1\]: expected a dict, got list", True),
    ("records-non-string-key", _memory([{1: "a", "prompt": "a", "response": " b"}]), DataError, r"records\[0\]: field names must be strings, got 1", True),
    ("records-empty-response", _memory([{"prompt": "a", "response": " b"}, {"prompt": "a", "response": ""}]), DataError, r"records\[1\], field 'response': is empty", True),
    ("records-a-string", _memory("prompt,response"), DataError, r"records: expected a list of dicts or a datasets\.Dataset, got str", True),
    ("records-dataset-dict", _dataset_dict_records, DataError, r"records: a DatasetDict; pass one split \(have \['train'\]\)", True),
    ("records-and-file", _construct(SFTDataModule, train_file="f.jsonl", records=[]), ValueError, r"SFTDataModule: give exactly one of train_file, dataset and records", True),
    ("truncation-max-prompt-length-0", _truncation(max_length=8, max_prompt_length=0), ValueError, r"Truncation: max_prompt_length must be an integer >= 1, got 0", True),
    ("truncation-negative-max-prompt-length", _truncation(max_length=8, max_prompt_length=-3), ValueError, r"Truncation: max_prompt_length must be an integer >= 1, got -3", True),
    ("truncation-negative-max-length", _truncation(max_length=-8, max_prompt_length=-9), ValueError, r"Truncation: max_length must be an integer >= 2, got -8", True),
    ("sft-max-examples-minus-one", _construct(SFTDataModule, train_file="f.jsonl", max_examples=-1), ValueError, r"SFTDataModule: max_examples must be an integer >= 1, got -1", True),
    ("pref-batch-size-zero", _construct(PreferenceDataModule, train_file="f.jsonl", batch_size=0), ValueError, r"PreferenceDataModule: batch_size must be an integer >= 1, got 0", True),
    ("prompt-val-fraction-one", _construct(PromptDataModule, train_file="f.jsonl", val_fraction=1.5), ValueError, r"PromptDataModule: val_fraction must be a number in \[0, 1\), got 1\.5", True),
    ("truncate-prompts-error", _truncate_prompts(["ok", HH * 20], max_prompt_length=8, overflow="error"), DataError, r"prompts\[1\]: the prompt has \d+ tokens, more than max_prompt_length=8", True),
    ("truncate-prompts-names-sources", _truncate_prompts([HH * 20], max_prompt_length=8, overflow="error", sources=["p.jsonl:7"]), DataError, r"p\.jsonl:7: the prompt has", True),
    ("truncate-prompts-lone-surrogate", _truncate_prompts(["a\udc00"], max_prompt_length=8), DataError, r"prompts\[0\]: holds a lone surrogate", True),
    ("truncate-prompts-max-0", _truncate_prompts(["a"], max_prompt_length=0), ValueError, r"PromptTruncation: max_prompt_length must be an integer >= 1, got 0", True),
    ("encode-prompts-over-max-length", _encode_prompts(["short", HH * 20], max_length=8), ValueError, r"prompts\[1\] \('.*'\.\.\.\) encodes to \d+ tokens, more than max_length=8", True),
]  # fmt: skip


@pytest.mark.parametrize("name, call, error, match, fix", CALL_CASES, ids=[c[0] for c in CALL_CASES])
def test_hostile_call(name, call, error, match, fix, tokenizer_dir):
    with pytest.raises(error) as err:
        call(tokenizer_dir)
    assert type(err.value) is error
    assert re.search("^" + match, str(err.value)), str(err.value)


def test_a_one_megabyte_prompt_is_cut_without_tokenising_it_whole(tokenizer):
    """1 MB of text: the policy tokenises only a window of (max + 16) x the longest token's characters
    (288 characters here), never the whole prompt, and returns a suffix that fits, counted."""
    from alignlit.data import truncate_prompts

    class Spy:
        def __init__(self):
            self.longest = 0

        def __call__(self, text, **kwargs):
            self.longest = max(self.longest, len(text))
            return tokenizer(text, **kwargs)

        def get_vocab(self):
            return tokenizer.get_vocab()

    prompt = ("a b c d " * 131072) + HH
    spy = Spy()
    (kept,), counts = truncate_prompts(spy, [prompt], 16)
    assert spy.longest <= (16 + 16) * max(len(t) for t in tokenizer.get_vocab()) < 1000
    assert prompt.endswith(kept) and len(tokenizer(kept, add_special_tokens=False).input_ids) <= 16
    assert counts == {"prompts": 1, "prompts_left_truncated": 1, "prompts_dropped_over_max_length": 0}


# ------------------------------------------------------------------------- properties (hypothesis)
WORDS = st.sampled_from(
    ["a", "b", " c", " dd", "ok", " done", "\n\nHuman:", "\n\nAssistant:", " sort", "é", "😀", " "]
)
TEXTS = st.lists(WORDS, min_size=0, max_size=60).map("".join)
PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(prompts=st.lists(TEXTS, min_size=1, max_size=4), limit=st.integers(1, 24))
def test_truncate_prompts_keeps_a_fitting_suffix(tokenizer, prompts, limit):
    from alignlit.data import truncate_prompts

    def n(text):
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    if any(n(p) > limit and n(p[-1]) > limit for p in prompts):
        # a character that needs more tokens than the limit (a byte-level 4-byte emoji and limit 3)
        with pytest.raises(DataError, match=r"prompts\[\d\]: not even the prompt's last character fits"):
            truncate_prompts(tokenizer, prompts, limit)
        return
    kept, counts = truncate_prompts(tokenizer, prompts, limit)
    assert len(kept) == len(prompts) and counts["prompts_left_truncated"] == sum(
        n(p) > limit for p in prompts
    )
    for original, out in zip(prompts, kept):
        assert original.endswith(out) and n(out) <= limit
        if n(original) <= limit:
            assert out == original
        else:
            assert out


@PROPERTY
@given(prompt=TEXTS.filter(str.strip), response=TEXTS.filter(str.strip), max_length=st.integers(2, 40),
       data=st.data())  # fmt: skip
def test_truncation_encoding_fits_and_keeps_the_prompt_end(tokenizer, prompt, response, max_length, data):
    max_prompt_length = data.draw(st.integers(1, max_length - 1))
    trunc = Truncation(tokenizer, max_length=max_length, max_prompt_length=max_prompt_length)
    full_prompt = tokenizer(prompt, add_special_tokens=False).input_ids
    full_response = [*tokenizer(response, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    enc = trunc.encode(prompt, response, "f:1")
    ids, p = enc.input_ids, enc.prompt_length
    assert len(ids) <= max_length and p <= max_prompt_length
    assert ids[:p] == full_prompt[len(full_prompt) - p :]  # the most recent prompt tokens
    assert p == min(len(full_prompt), max_prompt_length)
    assert ids[p:] == full_response[: len(ids) - p]  # the response from its start


KEYS = st.text(alphabet="abcxyz_", min_size=1, max_size=6)
VALUES = st.one_of(st.text(max_size=20).filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)),
                   st.integers(-(10**6), 10**6), st.booleans(), st.none())  # fmt: skip


@PROPERTY
@given(rows=st.lists(st.dictionaries(KEYS, VALUES, max_size=5), min_size=1, max_size=6), data=st.data())
def test_jsonl_round_trip_and_duplicate_keys_named(tmp_path_factory, rows, data):
    path = tmp_path_factory.mktemp("rt") / "f.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert [r.fields for r in read_records(path)] == rows
    row = data.draw(st.integers(0, len(rows) - 1))
    key = data.draw(KEYS)
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    lines[row] = lines[row][:-1] + (", " if rows[row] else "") + f'"{key}": 1, "{key}": 2}}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}:{row + 1}: duplicate key '{key}'"):
        read_records(path)
