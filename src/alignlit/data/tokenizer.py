"""Tokenizers: loading one from a Hugging Face directory or hub id, with errors that say what is missing
(:func:`load_tokenizer`), and training a byte-level BPE one locally, nothing downloaded
(:func:`train_bpe_tokenizer`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from alignlit.data.records import DataError
from alignlit.hub import Pretrained, check_remote_code, resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# files from which transformers can build a tokenizer: the `tokenizers` serialisation, or a
# tokenizer_config.json with the vocabulary files of its class
_SERIALISED = "tokenizer.json"
_VOCABULARIES = (
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def check_dir(path: str | Path | Pretrained, what: str, *, revision: str | None = None) -> Path:
    """The local directory of ``path``: a directory is itself, a hub id ``org/name[@revision]`` (or a
    :class:`~alignlit.hub.Pretrained`) its snapshot in the hub cache (:func:`alignlit.hub.resolve_model`);
    anything else is a one-line ``FileNotFoundError`` naming ``what``."""
    return resolve_model(path, what=what, revision=revision)


def _check_files(p: Path) -> None:
    names = sorted(f.name for f in p.iterdir())
    if _SERIALISED not in names and not any(v in names for v in _VOCABULARIES):
        raise FileNotFoundError(
            f"tokenizer folder {str(p)!r} has no tokenizer files: expected {_SERIALISED} (or "
            f"tokenizer_config.json with its vocabulary, e.g. {', '.join(_VOCABULARIES[:3])}); "
            f"it holds {names or 'nothing'}"
        )
    for name in (_SERIALISED, "tokenizer_config.json", "special_tokens_map.json"):
        f = p / name
        if f.is_file():
            try:
                json.loads(f.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{f}: not valid JSON ({e}); the tokenizer folder is damaged") from e


def load_tokenizer(
    path: str | Path | Pretrained, *, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory or a hub id ``org/name[@revision]`` (a model's tokenizer
    comes from the model's own directory) and make sure it can pad. A tokenizer whose config names its own
    code is refused unless ``trust_remote_code`` (:class:`~alignlit.hub.RemoteCodeError`).

    Raises ``FileNotFoundError`` naming the folder when it is missing or holds no tokenizer files,
    :class:`~alignlit.data.DataError` naming the file when one is not valid JSON, and ``ValueError``
    naming the folder when transformers cannot build a tokenizer from what is there.
    """
    from transformers import AutoTokenizer

    if isinstance(path, Pretrained):
        trust_remote_code = trust_remote_code or path.trust_remote_code
    p = check_dir(path, "tokenizer", revision=revision)
    check_remote_code(
        p, what="tokenizer", spec=str(path), trust_remote_code=trust_remote_code, tokenizer=True
    )
    _check_files(p)
    try:
        tok = AutoTokenizer.from_pretrained(
            str(p), **({"trust_remote_code": True} if trust_remote_code else {})
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"tokenizer folder {str(p)!r}: transformers cannot build a tokenizer from "
            f"{sorted(f.name for f in p.iterdir())} ({type(e).__name__}: {str(e).strip().splitlines()[0]})"
        ) from e
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|eos|>"
BOS_TOKEN = "<|bos|>"

#: HH-RLHF dialogue format as a chat template: ``\n\nHuman: …\n\nAssistant: …``.
HH_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '\n\nHuman: ' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '\n\nAssistant: ' + message['content'] }}"
    "{% else %}{{ '\n\n' + message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n\nAssistant:' }}{% endif %}"
)


def train_bpe_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 512, out_dir: str | Path | None = None
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``.

    The tokenizer knows every byte (no unknown tokens), has ``<|pad|>``, ``<|bos|>`` and ``<|eos|>``
    special tokens (pad distinct from eos, so a reward head can find the last real token), and the
    HH-RLHF chat template. Nothing is added automatically around encoded text: callers append EOS
    where a response ends. Saved with ``save_pretrained`` when ``out_dir`` is given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = HH_CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast
