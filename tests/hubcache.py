"""A tiny random model placed in a real, offline Hugging Face hub cache under a real hub id.

Tests run the code a user runs: ``policy: Qwen/Qwen2.5-0.5B-Instruct`` with ``HF_HUB_OFFLINE=1`` resolves
through ``huggingface_hub`` (no mock of ``from_pretrained``) to a snapshot this module wrote in the hub
cache layout::

    <cache_root>/models--Qwen--Qwen2.5-0.5B-Instruct/
        blobs/<sha256>                      the files' contents
        snapshots/<40-hex commit>/<file>    symbolic links to ../../blobs/<sha256>, as the hub writes them
        refs/main                           the commit (no newline)

The model has Qwen2.5-0.5B-Instruct's architecture at a tiny size (``Qwen2ForCausalLM``: GQA-free 2 heads
of head_dim 64, as vLLM's CPU backend needs, tied embeddings, attention biases, an embedding padded past
the tokenizer's length as the real one is) and a byte-level BPE tokenizer trained here on GSM8K text,
with Qwen's pre-tokenizer split, its special tokens (``<|endoftext|>`` pad, ``<|im_start|>``,
``<|im_end|>`` eos) and a ChatML chat template (Qwen2.5-Instruct's, without the tools branch). Its
``generation_config.json`` is Qwen2.5-Instruct's (sampling defaults included), as a user gets it.

Usage::

    from tests.hubcache import QWEN, make_hub_cache, hub_env
    root = make_hub_cache(tmp_path / "hub")                  # Qwen/Qwen2.5-0.5B-Instruct
    make_hub_cache(root, "OpenRLHF/tiny-rm", seed=1, head="sequence_classification")
    subprocess.run([...], env=hub_env(root))                 # HF_HUB_CACHE + HF_HUB_OFFLINE=1

or the ``hub_cache`` fixture (tests/conftest.py), which does the first and sets the environment. The
files are built once per session (about a second) and copied into each cache.
"""

from __future__ import annotations

import atexit
import gzip
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
GSM8K_TRAIN = Path("/work/shared/data/gsm8k/train.jsonl.gz")
if not GSM8K_TRAIN.is_file():  # the shared data beside the repository, wherever it is checked out
    GSM8K_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl.gz"

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful assistant."

#: Qwen2.5-Instruct's chat template without its tools branch: a default system message when the
#: conversation has none, ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, and
#: ``<|im_start|>assistant\n`` as the generation prompt.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Qwen2's pre-tokenizer split (single digits, letters with one leading non-letter, ...)
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

#: Qwen2.5-0.5B-Instruct's shape, shrunk: hidden 128 = 2 heads x head_dim 64 (vLLM's CPU attention
#: needs head_dim 64), 2 key-value heads, MLP 256, 2 layers, 1024 positions.
QWEN_TINY = dict(
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=256,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    max_window_layers=2,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    use_sliding_window=False,
    hidden_act="silu",
)

#: Qwen2.5-0.5B-Instruct's generation_config.json, token ids replaced by this tokenizer's
GENERATION_DEFAULTS = dict(do_sample=True, repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20)

#: BPE merges trained (the tokenizer's length adds the 3 special tokens); the embedding is padded to a
#: multiple of EMBEDDING_MULTIPLE, as Qwen2.5's 151,936 rows exceed its tokenizer's 151,665
VOCAB_SIZE = 1024
EMBEDDING_MULTIPLE = 128

Head = Literal["causal_lm", "sequence_classification"]

_BUILT: dict[tuple, Path] = {}
_BUILD_ROOT: list[Path] = []


def _texts(n: int = 1500) -> list[str]:
    """GSM8K questions and answers (the first ``n`` rows of the shared train split; made-up GSM8K-like
    ones where that file is absent) plus plain English and chat words."""
    out = [
        "You are a helpful assistant.",
        "The quick brown fox jumps over the lazy dog.",
        "Hello! How can I help you today? Let me think step by step.",
        "system user assistant Question: Answer: The answer is",
    ]
    if not GSM8K_TRAIN.is_file():  # no shared data here: GSM8K-like sentences made up, same alphabet
        names = ["Natalia", "James", "Weng", "Betty", "Julie", "Mark", "Albert", "Ken"]
        for i in range(n):
            a, b = 3 + i % 47, 2 + i % 11
            out += [
                f"{names[i % 8]} has {a} apples and buys {b} more each day for {i % 5 + 1} days. How many now?",
                f"Each day adds {b}, so {b}*{i % 5 + 1} = <<{b}*{i % 5 + 1}={b * (i % 5 + 1)}>>{b * (i % 5 + 1)}."
                f"\nThen {a}+{b * (i % 5 + 1)} = {a + b * (i % 5 + 1)}.\n#### {a + b * (i % 5 + 1)}",
            ]
        return out
    with gzip.open(GSM8K_TRAIN, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            row = json.loads(line)
            out += [row["question"], row["answer"]]
    return out


def train_chatml_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A Qwen2-style byte-level BPE tokenizer trained on GSM8K text, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(), trainer=trainer)
    tok.add_special_tokens([PAD, IM_START, IM_END])  # after the vocabulary, as Qwen's are
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=QWEN_TINY["max_position_embeddings"],
        split_special_tokens=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _build(seed: int, head: Head, dtype: str) -> Path:
    """Write the snapshot's files into a session directory, once per (seed, head, dtype)."""
    key = (seed, head, dtype)
    if key in _BUILT:
        return _BUILT[key]
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    if not _BUILD_ROOT:
        _BUILD_ROOT.append(Path(tempfile.mkdtemp(prefix="alignlit-hubcache-")))
        atexit.register(shutil.rmtree, _BUILD_ROOT[0], True)
    out = _BUILD_ROOT[0] / f"seed{seed}-{head}-{dtype}"
    tok = train_chatml_tokenizer()
    pad, eos = tok.convert_tokens_to_ids(PAD), tok.convert_tokens_to_ids(IM_END)
    vocab = -(-len(tok) // EMBEDDING_MULTIPLE) * EMBEDDING_MULTIPLE  # padded past the tokenizer
    config = Qwen2Config(vocab_size=vocab, bos_token_id=pad, eos_token_id=eos, **QWEN_TINY)
    torch.manual_seed(seed)
    if head == "causal_lm":
        model = Qwen2ForCausalLM(config)
    else:
        config.num_labels = 1
        config.pad_token_id = pad
        model = Qwen2ForSequenceClassification(config)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad, **GENERATION_DEFAULTS
    )
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    _BUILT[key] = out
    return out


def _commit(repo_id: str, files: dict[str, str]) -> str:
    """A 40-hex commit hash determined by the repo id and the files' contents."""
    return hashlib.sha1(json.dumps([repo_id, sorted(files.items())]).encode()).hexdigest()


def repo_folder(cache_root: str | Path, repo_id: str) -> Path:
    """``<cache_root>/models--ORG--NAME``."""
    return Path(cache_root) / ("models--" + repo_id.replace("/", "--"))


def snapshot_dir(cache_root: str | Path, repo_id: str = QWEN, revision: str = "main") -> Path:
    """The snapshot directory that ``revision`` (a ref name or a commit hash) of ``repo_id`` points to."""
    folder = repo_folder(cache_root, repo_id)
    ref = folder / "refs" / revision
    commit = ref.read_text() if ref.is_file() else revision
    return folder / "snapshots" / commit


def write_snapshot(
    cache_root: str | Path, repo_id: str, source: str | Path, *, refs: tuple[str, ...] = ("main",)
) -> str:
    """Place the files of directory ``source`` into the hub cache as a snapshot of ``repo_id`` (blobs by
    content hash, symbolic links in ``snapshots/<commit>``), point each ref in ``refs`` at it, and return
    the commit hash."""
    source = Path(source)
    folder = repo_folder(cache_root, repo_id)
    blobs = folder / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    digests = {}
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        digests[f.name] = digest
        if not (blobs / digest).exists():
            shutil.copyfile(f, blobs / digest)
    commit = _commit(repo_id, digests)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, digest in digests.items():
        link = snap / name
        if not link.exists():
            try:
                link.symlink_to(Path("..") / ".." / "blobs" / digest)
            except OSError:  # no symbolic links here: a copy resolves the same way
                shutil.copyfile(blobs / digest, link)
    (folder / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return commit


def make_hub_cache(
    cache_root: str | Path,
    repo_id: str = QWEN,
    *,
    seed: int = 0,
    head: Head = "causal_lm",
    dtype: str = "bfloat16",
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Put a tiny random Qwen2.5-shaped model with a ChatML tokenizer into the hub cache at
    ``cache_root`` as ``repo_id`` (call again for more ids in the same cache; a different ``seed`` gives
    different weights and a different commit). ``head="sequence_classification"`` writes a
    ``Qwen2ForSequenceClassification`` with one label (a reward model's layout). Saved in ``dtype``
    (bfloat16, as Qwen ships it). Returns ``cache_root``."""
    root = Path(cache_root)
    write_snapshot(root, repo_id, _build(seed, head, dtype), refs=refs)
    return root


def hub_env(cache_root: str | Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a subprocess (``alignlit fit ...``) that resolves hub ids through the cache at
    ``cache_root`` offline: ``base`` (default ``os.environ``) with ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``
    and ``TRANSFORMERS_OFFLINE=1``."""
    env = dict(os.environ if base is None else base)
    env.update(
        HF_HUB_CACHE=str(cache_root),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env
