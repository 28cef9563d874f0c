import json
import os

import pytest
import torch

from alignlit.models import (
    ExportDirError,
    NotARewardModelError,
    TinyLlama,
    check_export_dir,
    export_pretrained,
    last_token_index,
    load_policy,
    load_reward_model,
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


# ---------------------------------------------------------------- exports replace only what is ours


def _export(tokenizer, out, stage="a", seed=1):
    return export_pretrained(make_tiny_llama(tokenizer, seed=seed, **TINY), tokenizer, out, stage=stage)


def test_export_refuses_a_folder_of_user_files(tmp_path, tokenizer):
    out = tmp_path / "results"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(
        ExportDirError, match=r"results' is a non-empty directory that is not an alignlit export"
    ):
        _export(tokenizer, out)
    assert (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no temporary left either


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_text("x"), r"is a file, not a directory"),
        (lambda p: p.symlink_to(p.parent), r"is a symbolic link"),
    ],
    ids=["file", "symlink"],
)
def test_export_refuses_files_and_links(tmp_path, tokenizer, make, message):
    out = tmp_path / "out"
    make(out)
    with pytest.raises(ExportDirError, match=message):
        check_export_dir(out)


def test_export_dir_empty_string_and_under_a_file(tmp_path):
    with pytest.raises(ExportDirError, match=r"export_dir is '': give the directory"):
        check_export_dir("")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ExportDirError, match=r"f is a file, not a directory"):
        check_export_dir(tmp_path / "f" / "sub" / "out")


def test_export_into_an_empty_directory_and_with_the_users_umask(tmp_path, tokenizer):
    out = tmp_path / "empty"
    out.mkdir()
    old = os.umask(0o022)
    try:
        _export(tokenizer, out)
    finally:
        os.umask(old)
    assert read_metadata(out)["stage"] == "a"
    assert (out.stat().st_mode & 0o777) == 0o755  # mkdtemp's 0700 is not kept
    assert ((out / "config.json").stat().st_mode & 0o777) == 0o644


def test_unwritable_location_fails_the_check(tmp_path, monkeypatch):
    import errno
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(ExportDirError, match=r"cannot write in .*\(Read-only file system\)"):
        check_export_dir(tmp_path / "out")


def test_crash_between_the_two_renames_is_recovered(tmp_path, tokenizer, monkeypatch):
    """The second rename of the swap dies: the previous export sits at .pol.old and pol is missing.
    Loading pol says how to restore it; the next export restores it and swaps as usual."""
    out = tmp_path / "pol"
    _export(tokenizer, out, stage="first")
    real_replace = os.replace
    calls = []

    def crash_on_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies here
        return real_replace(src, dst)

    monkeypatch.setattr("alignlit.models.export.os.replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        _export(tokenizer, out, stage="second")
    monkeypatch.undo()
    assert not out.exists() and read_metadata(tmp_path / ".pol.old")["stage"] == "first"
    with pytest.raises(
        FileNotFoundError, match=r"export to .*pol was interrupted .* `mv .*\.pol\.old .*pol`"
    ):
        load_policy(out)
    _export(tokenizer, out, stage="third")
    assert read_metadata(out)["stage"] == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pol"]


def test_a_stray_old_folder_that_is_not_ours_is_never_deleted(tmp_path, tokenizer):
    out = tmp_path / "pol"
    _export(tokenizer, out)
    (tmp_path / ".pol.old").mkdir()
    (tmp_path / ".pol.old" / "keep.txt").write_text("not ours")
    with pytest.raises(ExportDirError, match=r"\.pol\.old is in the way .* not an alignlit export"):
        _export(tokenizer, out)
    assert (tmp_path / ".pol.old" / "keep.txt").read_text() == "not ours"


# ---------------------------------------------------------------- reward models need a trained head


def test_a_policy_is_not_a_reward_model(tiny_policy_dir):
    with pytest.raises(
        NotARewardModelError,
        match=r"tiny is not a reward model: it is a LlamaForCausalLM, alignlit stage 'init'",
    ):
        load_reward_model(tiny_policy_dir)
    with pytest.raises(NotARewardModelError, match="not a reward model"):
        load_scalar_model(tiny_policy_dir, head="trained")
    rm, _ = load_scalar_model(tiny_policy_dir, head="fresh")  # a critic or a reward model to train
    assert rm.per_token
    with pytest.raises(ValueError, match="head must be 'trained' or 'fresh'"):
        load_scalar_model(tiny_policy_dir, head="maybe")


def test_a_classification_config_without_head_weights_is_refused(tmp_path, tiny_policy_dir):
    """The config alone is not trusted: a causal-LM checkpoint whose config claims a 1-label
    sequence-classification head still lacks the head's weights."""
    import shutil

    fake = tmp_path / "fake_rm"
    shutil.copytree(tiny_policy_dir, fake)
    (fake / "alignlit.json").unlink()
    config = json.loads((fake / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], num_labels=1)
    (fake / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotARewardModelError, match=r"lacks the weights \['score\.weight'\]"):
        load_reward_model(fake)


def test_a_plain_hf_classifier_with_its_head_is_a_reward_model(tmp_path, tiny_policy_dir, tokenizer):
    """A …ForSequenceClassification with one label saved by Hugging Face itself (no alignlit.json)."""
    rm, _ = load_scalar_model(tiny_policy_dir, head="fresh")
    rm.save_pretrained(tmp_path / "hf_rm")
    tokenizer.save_pretrained(tmp_path / "hf_rm")
    loaded = load_reward_model(tmp_path / "hf_rm")
    ids = torch.tensor([tokenizer("\n\nHuman: x\n\nAssistant: y").input_ids])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids, torch.ones_like(ids)), rm.eval()(ids, torch.ones_like(ids)))
