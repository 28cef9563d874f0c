"""Loading a tokenizer from a local Hugging Face directory, with errors that say what is missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from alignlit.data.records import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


def check_dir(path: str | Path, what: str) -> Path:
    """``path`` as a Path if it is a directory; a clear error otherwise (nothing is downloaded)."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"{what} {str(path)!r} is not a directory; alignlit loads models and tokenizers only from local "
            "Hugging Face directories (nothing is downloaded)"
        )
    return p


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


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory and make sure it can pad.

    Raises ``FileNotFoundError`` naming the folder when it is missing or holds no tokenizer files,
    :class:`~alignlit.data.DataError` naming the file when one is not valid JSON, and ``ValueError``
    naming the folder when transformers cannot build a tokenizer from what is there.
    """
    from transformers import AutoTokenizer

    p = check_dir(path, "tokenizer")
    _check_files(p)
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
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
