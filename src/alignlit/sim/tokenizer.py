"""The tokenizer of the simulated task's tiny policies, trained on the written data."""

from __future__ import annotations

from pathlib import Path

from alignlit.data.records import read_records
from alignlit.models.tokenizer import train_bpe_tokenizer


def write_tokenizer(out_dir: str, *, vocab_size: int) -> None:
    """Train the tokenizer for tiny policies on the SFT, pair and prompt text under ``out_dir``."""
    texts = [
        value
        for f in sorted(Path(out_dir).glob("*_train.jsonl"))
        for record in read_records(f)
        for value in record.fields.values()
        if isinstance(value, str)
    ]
    train_bpe_tokenizer(texts, vocab_size=vocab_size, out_dir=Path(out_dir) / "tokenizer")
