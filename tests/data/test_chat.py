"""Chat formats end to end: one rendering path, assistant-only SFT loss, prompts that carry their record,
datasets through ``datasets.load_dataset`` with column mappings, and what set-up prints."""

from __future__ import annotations

import gzip
import json
import pickle
from collections import Counter

import pytest
import torch

from alignlit.data import (
    DataError,
    Prompt,
    PromptDataModule,
    SFTDataModule,
    encode_conversation,
    load_tokenizer,
    make_prompt,
)
from alignlit.data.encoding import collate_lm
from alignlit.data.sources import DatasetNotFound
from alignlit.rollout.postprocess import encode_prompts
from alignlit.rollout.reward_protocol import score_texts
from tests.hubcache import GSM8K_TRAIN, snapshot_dir

GSM8K_TEST = GSM8K_TRAIN.with_name("test.jsonl.gz")


@pytest.fixture
def tok(hub_cache):
    tokenizer = load_tokenizer(snapshot_dir(hub_cache))
    assert tokenizer.chat_template is not None
    return tokenizer


def test_prompt_ids_equal_apply_chat_template(tok):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+3?"}]
    prompt = make_prompt(messages, tok, where="x", chat=False)
    expected = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    ids, mask = encode_prompts(tok, [prompt])
    assert ids[0][mask[0]].tolist() == expected
    # a string prompt with chat=True is the same conversation as one user message (+ the system prompt)
    as_text = make_prompt("What is 2+3?", tok, where="x", chat=True, system_prompt="Answer briefly.")
    assert str(as_text) == str(prompt) and as_text.messages == messages
    assert str(prompt).endswith("<|im_start|>assistant\n")


def test_sft_two_turn_assistant_only_mask_by_hand(tok):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Add 2 and 2"},
        {"role": "assistant", "content": "4"},
    ]
    counts = Counter()
    enc = encode_conversation(tok, messages, "r:1", max_length=512, overflow="error", counts=counts)
    ids = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
    assert enc.input_ids == ids
    # by hand: the tokens of "Hello there<|im_end|>\n" and "4<|im_end|>\n" are trained, nothing else
    trained = [t for t, m in zip(enc.input_ids, enc.loss_mask) if m]
    want = (
        tok("Hello there<|im_end|>\n", add_special_tokens=False).input_ids
        + tok("4<|im_end|>\n", add_special_tokens=False).input_ids
    )
    assert trained == want
    # the two trained runs sit right after each assistant header
    header = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    text_ids = enc.input_ids
    starts = [i + len(header) for i in range(len(text_ids)) if text_ids[i : i + len(header)] == header]
    assert [i for i, m in enumerate(enc.loss_mask) if m and (i == 0 or not enc.loss_mask[i - 1])] == starts
    batch = collate_lm([enc], tok.pad_token_id)
    assert batch.loss_mask[0].tolist() == enc.loss_mask
    # right truncation keeps the mask aligned and is counted
    short = encode_conversation(
        tok, messages, "r:1", max_length=len(ids) - 3, overflow="truncate", counts=counts
    )
    assert short.loss_mask == enc.loss_mask[: len(ids) - 3]
    assert counts["conversations_right_truncated"] == 1
    with pytest.raises(DataError, match=r"r:1.*max_length"):
        encode_conversation(tok, messages, "r:1", max_length=10, overflow="error", counts=counts)
    with pytest.raises(DataError, match="no assistant turn"):
        encode_conversation(tok, messages[:1], "r:2", max_length=512, overflow="error", counts=counts)


def test_sft_datamodule_messages(tok, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]}
        for i in range(4)
    ]
    f = tmp_path / "sft.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    dm = SFTDataModule(
        str(f), tokenizer=str(snapshot_dir(tok.hub_root)) if hasattr(tok, "hub_root") else None
    )
    dm.tokenizer = tok
    examples = dm.encode(dm.read()[0], "train")
    assert len(examples) == 4 and all(e.loss_mask is not None for e in examples)
    trained = [t for t, m in zip(examples[0].input_ids, examples[0].loss_mask) if m]
    assert trained == tok("A0<|im_end|>\n", add_special_tokens=False).input_ids
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    dm = SFTDataModule(str(bad))
    dm.tokenizer = tok
    with pytest.raises(DataError, match=r"bad.jsonl:1, field 'messages': message 0"):
        dm.encode(dm.read()[0], "train")


def _gsm8k_rows(n: int) -> list[dict]:
    with gzip.open(GSM8K_TEST, "rt") as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_gsm8k_dataset_columns_and_answers_travel(tok, capsys):
    dm = PromptDataModule(
        dataset={"path": "json", "data_files": str(GSM8K_TEST), "split": "train[:20]"},
        columns={"question": "prompt"},
        chat=True,
        system_prompt="Solve the problem. Put the final answer after ####.",
        max_prompt_length=512,
    )
    dm.tokenizer = tok
    dm._ready = False
    dm.hparams.tokenizer = None
    train, _ = dm.read()
    prompts = dm.encode(train, "train")
    rows = _gsm8k_rows(20)
    assert len(prompts) == 20
    for p, row in zip(prompts, rows):
        assert isinstance(p, Prompt) and p.templated
        assert p.fields == {"answer": row["answer"]}
        assert row["question"] in p and p.startswith("<|im_start|>system\nSolve the problem.")
        assert p.source.endswith(f":{rows.index(row) + 1}")

    # the reward receives the answers as a keyword column, row for row (TRL's convention)
    seen = {}

    def reward(prompts, responses, answer):
        seen["answer"] = answer
        return [float(a.endswith(r)) for a, r in zip(answer, responses)]

    responses = [row["answer"].rsplit("#### ", 1)[1] if i % 2 == 0 else "nope" for i, row in enumerate(rows)]
    scores = score_texts(reward, prompts, responses)
    assert seen["answer"] == [row["answer"] for row in rows]
    assert scores.tolist() == [1.0 if i % 2 == 0 else 0.0 for i in range(20)]
    # a reward that does not name the column is called as before
    assert score_texts(lambda p, r: [0.0] * len(r), prompts, responses).tolist() == [0.0] * 20


def test_prompt_survives_pickle_and_checkpoint(tmp_path):
    p = Prompt("text", fields={"answer": "#### 3"}, source="f:1", messages=[{"role": "user", "content": "t"}])
    q = pickle.loads(pickle.dumps([p, p]))[0]
    assert isinstance(q, Prompt) and q == "text" and q.fields == p.fields and q.messages == p.messages
    torch.save({"prompts": [p]}, tmp_path / "c.pt")
    r = torch.load(tmp_path / "c.pt", weights_only=True)["prompts"][0]  # as checkpoints are read
    assert r.fields == {"answer": "#### 3"} and r.source == "f:1"
    assert hash(p) == hash("text") and {p: 1}["text"] == 1


def test_chat_prompt_truncation_drops_whole_turns(tok):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "long " * 60},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "short question"},
    ]
    p = make_prompt(messages, tok, where="r:1", chat=False, fields={"answer": "1"})
    from alignlit.data import PromptTruncation

    limit = len(tok(str(p), add_special_tokens=False).input_ids) - 5
    cut = PromptTruncation(tok, limit, "truncate")(p, "r:1")
    assert cut.messages == [messages[0], messages[3]] and cut.fields == {"answer": "1"}
    assert len(tok(str(cut), add_special_tokens=False).input_ids) <= limit
    drop = PromptTruncation(tok, 5, "drop")
    assert drop(p, "r:1") is None and drop.counts["prompts_dropped_over_max_length"] == 1


def test_drops_are_printed_and_warned(tok, capsys, tmp_path):
    rows = _gsm8k_rows(20)
    f = tmp_path / "g.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": r["question"], "answer": r["answer"]}) for r in rows))
    dm = PromptDataModule(str(f), max_prompt_length=40, overflow="drop", tokenizer=None)
    dm.tokenizer = tok
    dm.uses_tokenizer = lambda: False
    lengths = [len(tok(r["question"], add_special_tokens=False).input_ids) for r in rows]
    kept = sum(n <= 40 for n in lengths)
    assert 0 < kept < 20
    with pytest.warns(UserWarning, match=f"{20 - kept} of 20 records"):
        dm.setup("fit")
    out = capsys.readouterr().out
    assert f"20 records -> {kept} train / 0 val examples; prompts_dropped_over_max_length {20 - kept}" in out


def test_missing_hub_dataset_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    dm = PromptDataModule(dataset={"path": "NoSuchOrg/no-such-dataset", "split": "train"})
    with pytest.raises(DatasetNotFound) as err:
        dm.read()
    msg = str(err.value)
    assert "NoSuchOrg/no-such-dataset" in msg and "offline" in msg and "\n" not in msg
    assert err.value.__cause__ is None


def test_dataset_spec_and_columns_checked():
    with pytest.raises(ValueError, match="'split' is required"):
        PromptDataModule(dataset={"path": "openai/gsm8k", "name": "main"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['nme'\]"):
        PromptDataModule(dataset={"path": "openai/gsm8k", "nme": "main", "split": "train"})
    with pytest.raises(ValueError, match="exactly one of train_file, dataset and records"):
        PromptDataModule("a.jsonl", dataset={"path": "x", "split": "train"})
    with pytest.raises(ValueError, match="several columns map to"):
        PromptDataModule("a.jsonl", columns={"a": "prompt", "b": "prompt"})


def test_missing_mapped_column_names_the_row(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"question": "q1"}) + "\n" + json.dumps({"text": "q2"}) + "\n")
    dm = PromptDataModule(str(f), columns={"question": "prompt"})
    with pytest.raises(DataError, match=r"q.jsonl:2, field 'question': missing"):
        dm.read()


def test_hh_pairs_as_conversations(tok, tmp_path):
    from alignlit.data import PreferenceDataModule

    with gzip.open(GSM8K_TRAIN.parents[1] / "hh-rlhf-harmless-base-dev.jsonl.gz", "rt") as f:
        rows = [json.loads(next(f)) for _ in range(6)]
    dm = PreferenceDataModule(
        records=rows, chat=True, val_fraction=0.0, max_length=1024, max_prompt_length=768
    )
    dm.tokenizer = tok
    train, _ = dm.read()
    pairs, _ = dm._parse(train)
    assert len(pairs) == 6
    first = rows[0]["chosen"]
    last_human = first[: first.rfind("\n\nAssistant:")].rsplit("\n\nHuman:", 1)[1].strip()
    assert pairs[0].prompt.endswith(f"<|im_start|>user\n{last_human}<|im_end|>\n<|im_start|>assistant\n")
    assert pairs[0].chosen == first[first.rfind("\n\nAssistant:") + len("\n\nAssistant:") :].strip()
    bad = PreferenceDataModule(records=[{"chosen": "no turns", "rejected": "x"}], chat=True, val_fraction=0.0)
    bad.tokenizer = tok
    with pytest.raises(DataError, match=r"records\[0\].*not an HH-RLHF dialogue"):
        bad._parse(bad.read()[0])
