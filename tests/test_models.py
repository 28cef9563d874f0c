import json

import pytest
import torch

from alignlit.models import (
    TinyLlama,
    export_pretrained,
    last_token_index,
    load_policy,
    load_scalar_model,
    make_tiny_llama,
    read_metadata,
)
from tests.conftest import TINY


def test_tokenizer_round_trip_and_specials(tokenizer):
    text = "\n\nHuman: sort c a d\n\nAssistant: a c d"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    # pad distinct from eos (the reward head finds the last real token by the mask, and HF's
    # sequence-classification pooling by pad id)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    # nothing is added implicitly: callers append EOS themselves
    assert (
        tokenizer("a", add_special_tokens=True).input_ids
        == tokenizer("a", add_special_tokens=False).input_ids
    )
    # unseen characters are still encodable (byte-level)
    assert tokenizer.decode(tokenizer("é✓").input_ids) == "é✓"


def test_chat_template_is_hh_format(tokenizer):
    msgs = [{"role": "user", "content": "sort b a"}, {"role": "assistant", "content": " a b"}]
    assert tokenizer.apply_chat_template(msgs, tokenize=False) == "\n\nHuman: sort b a\n\nAssistant:  a b"
    assert (
        tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        == "\n\nHuman: sort b a\n\nAssistant:"
    )


def test_tiny_llama_size_and_head_dim(tokenizer):
    model = make_tiny_llama(tokenizer)
    assert model.config.head_dim == 64  # vLLM on CPU needs head_dim in {32, 64, 80, ...}
    n = sum(p.numel() for p in model.parameters())
    # embeddings 2*V*128 + 4 layers * (4*128*128 attention + 3*128*384 MLP + 2*128 norms) + final norm
    v = len(tokenizer)
    assert n == 2 * v * 128 + 4 * (4 * 128 * 128 + 3 * 128 * 384 + 2 * 128) + 128


def test_export_then_load_gives_identical_logits(tmp_path, tokenizer):
    model = make_tiny_llama(tokenizer, seed=3, **TINY)
    out = export_pretrained(
        model, tokenizer, tmp_path / "pol", stage="sft", config={"lr": 0.1}, data={"f": "x"}
    )
    loaded, tok = load_policy(out)
    ids = torch.tensor([tokenizer("\n\nHuman: reverse a b\n\nAssistant: b a").input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    meta = read_metadata(out)
    assert meta["stage"] == "sft" and meta["config"] == {"lr": 0.1} and meta["data"] == {"f": "x"}
    assert tok.get_vocab() == tokenizer.get_vocab()
    # the metadata file is plain JSON next to the HF files
    assert json.loads((out / "alignlit.json").read_text())["stage"] == "sft"


def test_export_replaces_atomically(tmp_path, tokenizer):
    out = tmp_path / "pol"
    export_pretrained(make_tiny_llama(tokenizer, seed=1, **TINY), tokenizer, out, stage="a")
    export_pretrained(make_tiny_llama(tokenizer, seed=2, **TINY), tokenizer, out, stage="b")
    assert read_metadata(out)["stage"] == "b"
    # no temporary or old directories are left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pol"]


def test_tiny_spec_builds_same_model_as_factory(tokenizer_dir, tokenizer):
    spec = TinyLlama(tokenizer=str(tokenizer_dir), seed=5, **TINY)
    model, _ = load_policy(spec)
    ref = make_tiny_llama(tokenizer, seed=5, **TINY)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_load_policy_missing_dir_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_policy(tmp_path / "nope")


def test_last_token_index_left_and_right_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 0]


def test_scalar_head_reads_last_real_token_and_matches_hf(tiny_policy_dir, tokenizer):
    rm, _ = load_scalar_model(tiny_policy_dir)
    rm.eval()
    ids = torch.tensor([tokenizer("\n\nHuman: copy a b\n\nAssistant: a b").input_ids])
    one = torch.ones_like(ids)
    pad = tokenizer.pad_token_id
    right = torch.cat([ids, torch.full((1, 3), pad)], 1)
    left = torch.cat([torch.full((1, 3), pad), ids], 1)
    zeros = torch.zeros(1, 3, dtype=one.dtype)
    with torch.no_grad():
        s = rm(ids, one)
        values = rm.values(ids, one)
        assert torch.allclose(s, values[:, -1])
        assert torch.allclose(rm(right, torch.cat([one, zeros], 1)), s, atol=1e-5)
        assert torch.allclose(rm(left, torch.cat([zeros, one], 1)), s, atol=1e-5)
        # Hugging Face's own sequence-classification pooling gives the same score
        assert torch.allclose(
            rm.hf_model(input_ids=right, attention_mask=torch.cat([one, zeros], 1)).logits[:, 0], s, atol=1e-5
        )


def test_scalar_model_export_round_trip(tmp_path, tiny_policy_dir, tokenizer):
    rm, tok = load_scalar_model(tiny_policy_dir)
    out = export_pretrained(rm, tok, tmp_path / "rm", stage="reward")
    rm2, _ = load_scalar_model(out)
    ids = torch.tensor([tokenizer("\n\nHuman: x\n\nAssistant: y").input_ids])
    with torch.no_grad():
        assert torch.equal(rm(ids, torch.ones_like(ids)), rm2(ids, torch.ones_like(ids)))
