import gzip
import json

import pytest

from alignlit.data import (
    DataError,
    PromptDataModule,
    ResumableDataLoader,
    ResumableSampler,
    SFTDataModule,
    Truncation,
    collate_lm,
    parse_prompt,
    parse_prompt_response,
    read_records,
    split_indices,
)
from alignlit.data.records import Record
from tests.helpers import write_jsonl


def test_read_jsonl_gz_json_parquet(tmp_path):
    rows = [{"prompt": "p1", "response": "r1"}, {"prompt": "p2", "response": "r2"}]
    write_jsonl(tmp_path / "a.jsonl", rows)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for name in ["a.jsonl", "a.jsonl.gz", "a.json", "a.parquet", "ds"]:
        recs = read_records(tmp_path / name)
        assert [r.fields for r in recs] == rows, name
        assert recs[1].source.endswith(f"{name}:2")


def test_malformed_json_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "response": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        read_records(p)
    p.write_text('{"prompt": "a", "response": "b"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: expected a JSON object, got list"):
        read_records(p)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt": "a"}, "unknown format"),
        ({"prompt": "a", "response": ""}, r"field 'response': is empty"),
        ({"prompt": "a", "response": 3}, r"field 'response': expected a string, got int"),
        ({"chosen": "\n\nHuman: hi"}, r"field 'chosen': not in HH-RLHF format"),
        ({"chosen": "\n\nHuman: hi\n\nAssistant:   "}, r"field 'chosen': the last Assistant turn is empty"),
    ],
)
def test_bad_records_name_row_and_field(fields, message):
    with pytest.raises(DataError, match=r"f\.jsonl:7, " + message if "unknown" not in message else message):
        parse_prompt_response(Record("f.jsonl:7", fields))


def test_hh_split_at_last_assistant_turn():
    text = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: sort b a\n\nAssistant: a b"
    prompt, response = parse_prompt_response(Record("x:1", {"chosen": text}))
    assert prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: sort b a\n\nAssistant:"
    assert response == " a b"
    assert parse_prompt(Record("x:1", {"chosen": text})) == prompt
    assert parse_prompt(Record("x:1", {"prompt": "p"})) == "p"


def test_truncation_policy(tokenizer):
    prompt = "\n\nHuman: sort a b c d e f g h a b c d\n\nAssistant:"
    response = " a a b b c c d d"
    p_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    r_ids = [*tokenizer(response, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    # prompt keeps its last 6 tokens, response kept whole with EOS
    t = Truncation(tokenizer, max_length=64, max_prompt_length=6)
    enc = t.encode(prompt, response, "f:1")
    assert enc.input_ids == p_ids[-6:] + r_ids and enc.prompt_length == 6
    assert t.counts == {"prompts_left_truncated": 1}
    # response over the remaining budget: truncate / drop / error
    max_len = 6 + len(r_ids) - 2
    t = Truncation(tokenizer, max_length=max_len, max_prompt_length=6, overflow="truncate")
    enc = t.encode(prompt, response, "f:1")
    assert enc.input_ids == p_ids[-6:] + r_ids[: len(r_ids) - 2]
    assert t.counts["responses_right_truncated"] == 1
    t = Truncation(tokenizer, max_length=max_len, max_prompt_length=6, overflow="drop")
    assert t.encode(prompt, response, "f:1") is None and t.counts["dropped_over_max_length"] == 1
    t = Truncation(tokenizer, max_length=max_len, max_prompt_length=6, overflow="error")
    with pytest.raises(DataError, match=r"f:1: prompt \(6 tokens after truncation\) \+ response"):
        t.encode(prompt, response, "f:1")
    with pytest.raises(ValueError, match="max_prompt_length"):
        Truncation(tokenizer, max_length=8, max_prompt_length=8)


def test_collate_masks_prompt_and_padding(tokenizer):
    from alignlit.data.encoding import Encoded

    batch = collate_lm([Encoded([5, 6, 7, 8], 2), Encoded([5, 6, 7], 1)], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 7, 0]]
    assert batch.attention_mask.tolist() == [[True] * 4, [True, True, True, False]]
    assert batch.loss_mask.tolist() == [[False, False, True, True], [False, True, True, False]]


def test_split_indices_deterministic_and_disjoint():
    tr, va = split_indices(100, 0.1, seed=3)
    assert len(va) == 10 and len(tr) == 90 and not set(tr) & set(va)
    assert (tr, va) == split_indices(100, 0.1, seed=3)
    assert va != split_indices(100, 0.1, seed=4)[1]


def test_sampler_epochs_ranks_and_skip():
    s = ResumableSampler(10, shuffle=True, seed=0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    s.set_epoch(0)
    assert list(s) == e0
    s.skip = 4
    assert list(s) == e0[4:] and list(s) == e0  # skip applies to one pass only
    r0 = list(ResumableSampler(10, shuffle=True, seed=0, rank=0, world=3))
    r1 = list(ResumableSampler(10, shuffle=True, seed=0, rank=1, world=3))
    r2 = list(ResumableSampler(10, shuffle=True, seed=0, rank=2, world=3))
    assert len(r0) == len(r1) == len(r2) == 4 and set(r0 + r1 + r2) == set(range(10))


def test_loader_state_counts_trained_batches():
    s = ResumableSampler(10, shuffle=False, seed=0)
    loader = ResumableDataLoader(list(range(10)), batch_size=2, sampler=s)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()  # torchdata's StatefulDataLoader state; the sampler's pass inside it
    assert state["_num_yielded"] == 2
    assert state["_sampler_iter_state"]["sampler_iter_state"] == {"epoch": 0, "yielded": 4}
    for saved in (state, {"epoch": 0, "batches": 2}):  # and the state alignlit's loaders wrote before
        fresh = ResumableDataLoader(
            list(range(10)), batch_size=2, sampler=ResumableSampler(10, shuffle=False, seed=0)
        )
        fresh.load_state_dict(saved)
        assert [b.tolist() for b in fresh] == [[4, 5], [6, 7], [8, 9]]


def _sft_rows(n):
    return [
        {"prompt": f"\n\nHuman: copy {'abcd'[i % 4]} b\n\nAssistant:", "response": f" {'abcd'[i % 4]} b"}
        for i in range(n)
    ]


def test_sft_datamodule_split_and_batches(tmp_path, tokenizer_dir):
    f = write_jsonl(tmp_path / "sft.jsonl", _sft_rows(40))
    dm = SFTDataModule(str(f), tokenizer=str(tokenizer_dir), val_fraction=0.25, batch_size=8, seed=1)
    dm.setup("fit")
    assert len(dm.train_set) == 30 and len(dm.val_set) == 10
    batch = next(iter(dm.train_dataloader()))
    assert batch.input_ids.shape[0] == 8
    # every response ends with EOS and the loss covers exactly the response tokens
    eos = dm.tokenizer.eos_token_id
    for ids, lm, am in zip(batch.input_ids, batch.loss_mask, batch.attention_mask):
        resp = ids[lm]
        assert resp[-1].item() == eos
        assert dm.tokenizer.decode(resp[:-1]) in {" a b", " b b", " c b", " d b"}
        assert lm.sum() < am.sum()


def test_sft_datamodule_reports_bad_row(tmp_path, tokenizer_dir):
    rows = _sft_rows(5)
    rows[3] = {"prompt": "x", "response": "  "}
    f = write_jsonl(tmp_path / "sft.jsonl", rows)
    dm = SFTDataModule(str(f), tokenizer=str(tokenizer_dir))
    with pytest.raises(DataError, match=r"sft\.jsonl:4, field 'response': is empty"):
        dm.setup("fit")


def test_prompt_datamodule(tmp_path):
    rows = [{"prompt": f"p{i}"} for i in range(10)] + [{"chosen": "\n\nHuman: q\n\nAssistant: a"}]
    f = write_jsonl(tmp_path / "prompts.jsonl", rows)
    dm = PromptDataModule(str(f), batch_size=4, val_fraction=0.2)
    dm.setup("fit")
    assert len(dm.train_prompts) == 9 and len(dm.val_prompts) == 2
    assert "\n\nHuman: q\n\nAssistant:" in dm.train_prompts + dm.val_prompts
    batches = list(dm.train_dataloader())
    assert [len(b) for b in batches] == [4, 4, 1] and all(isinstance(p, str) for b in batches for p in b)
