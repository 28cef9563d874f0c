"""Models by Hugging Face hub id, through a real offline hub cache (tests/hubcache.py; nothing mocked)."""

from __future__ import annotations

import torch
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.hubcache import CHATML_TEMPLATE, DEFAULT_SYSTEM, IM_END, PAD, QWEN, make_hub_cache, snapshot_dir

MESSAGES = [
    {"role": "user", "content": "Natalia sold 48 clips in April. How many in May?"},
    {"role": "assistant", "content": "She sold 48/2 = 24 clips in May.\n#### 24"},
    {"role": "user", "content": "And altogether?"},
]


# ---------------------------------------------------------------------------------------- the fixture
def test_cache_layout_resolves_offline_through_huggingface_hub(hub_cache):
    """The layout the fixture writes is what huggingface_hub and transformers resolve offline."""
    folder = hub_cache / "models--Qwen--Qwen2.5-0.5B-Instruct"
    commit = (folder / "refs" / "main").read_text()
    assert len(commit) == 40 and int(commit, 16) >= 0
    snap = snapshot_download(QWEN, cache_dir=hub_cache, local_files_only=True)
    assert snap == str(folder / "snapshots" / commit) == str(snapshot_dir(hub_cache))
    assert snapshot_download(QWEN, cache_dir=hub_cache, local_files_only=True, revision=commit) == snap
    model = AutoModelForCausalLM.from_pretrained(QWEN)  # HF_HUB_CACHE and HF_HUB_OFFLINE from the fixture
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings and model.config.head_dim == 64
    assert model.config.vocab_size % 128 == 0
    tok = AutoTokenizer.from_pretrained(QWEN)
    assert len(tok) < model.config.vocab_size  # padded embedding, as Qwen2.5's
    assert (tok.pad_token, tok.eos_token) == (PAD, IM_END)
    assert model.config.eos_token_id == tok.eos_token_id


def test_second_repo_id_in_the_same_cache(hub_cache):
    make_hub_cache(hub_cache, "OpenRLHF/tiny-rm", seed=1, head="sequence_classification")
    a = snapshot_dir(hub_cache, QWEN)
    b = snapshot_dir(hub_cache, "OpenRLHF/tiny-rm")
    assert a.name != b.name and (b / "config.json").is_file()
    assert '"Qwen2ForSequenceClassification"' in (b / "config.json").read_text()


def test_chatml_template_ids_equal_the_rendered_text_encoded(hub_cache):
    tok = AutoTokenizer.from_pretrained(QWEN)
    assert tok.chat_template == CHATML_TEMPLATE
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{MESSAGES[0]['content']}<|im_end|>\n"
        f"<|im_start|>assistant\n{MESSAGES[1]['content']}<|im_end|>\n"
        f"<|im_start|>user\n{MESSAGES[2]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tok(text, add_special_tokens=False).input_ids
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", IM_END])
    assert ids.count(im_start) == 5 and ids.count(im_end) == 4  # special tokens are single ids
    system = [{"role": "system", "content": "Be brief."}, MESSAGES[0]]
    assert tok.apply_chat_template(system, tokenize=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    )
    assert tok.decode(tok("48/2 = 24").input_ids) == "48/2 = 24"


def test_tiny_qwen_generates(hub_cache):
    tok = AutoTokenizer.from_pretrained(QWEN)
    model = AutoModelForCausalLM.from_pretrained(QWEN, dtype=torch.float32)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    n = ids["input_ids"].shape[1]
    assert n < out.shape[1] <= n + 4
