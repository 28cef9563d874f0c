"""Load causal LMs and scalar-head models from local Hugging Face directories."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from alignlit.data.tokenizer import load_tokenizer
from alignlit.models.tiny import TinyLlama

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_dir(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"{what} {str(path)!r} is not a directory; alignlit loads models and tokenizers only from local "
            "Hugging Face directories (nothing is downloaded)"
        )
    return p


def load_policy(
    path: str | Path | TinyLlama, *, dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a Hugging Face directory (any stage's export works).

    ``path`` may also be a :class:`TinyLlama` spec, which builds a fresh tiny model instead.
    """
    if isinstance(path, TinyLlama):
        return path.build()
    p = _check_dir(path, "policy")
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=DTYPES[dtype])
    tok = load_tokenizer(p)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def load_scalar_model(
    path: str | Path, *, dtype: str = "float32"
) -> tuple[ScalarHeadModel, PreTrainedTokenizerBase]:
    """Load a scalar-head model (reward model or critic).

    From a causal-LM directory (e.g. the SFT export) the backbone is kept and a fresh linear head
    is added; from an exported reward model the trained head is loaded too. Any encoder with a
    sequence-classification class (e.g. MiniLM) works as well.
    """
    p = _check_dir(path, "model")
    tok = load_tokenizer(p)
    hf = AutoModelForSequenceClassification.from_pretrained(str(p), num_labels=1, dtype=DTYPES[dtype])
    if hf.config.pad_token_id is None:
        hf.config.pad_token_id = tok.pad_token_id
    return ScalarHeadModel(hf), tok


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last real token of each row (works for left and right padding)."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


class ScalarHeadModel(nn.Module):
    """A backbone with a linear head giving one scalar per position (reward model, critic).

    Wraps a Hugging Face ``…ForSequenceClassification`` model with ``num_labels=1`` so that the
    exported directory loads in any Hugging Face code. For decoder backbones (which have a
    per-token ``score`` head) :meth:`values` gives the head at every position and :meth:`forward`
    reads it at the last non-padding token; encoder backbones (e.g. BERT/MiniLM) use their own
    pooled classifier output and have no per-token values.
    """

    def __init__(self, hf_model: PreTrainedModel):
        super().__init__()
        self.hf_model = hf_model

    @property
    def config(self):
        return self.hf_model.config

    @property
    def per_token(self) -> bool:
        return hasattr(self.hf_model, "score") and hasattr(self.hf_model, "model")

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) head output at every position (decoder backbones only)."""
        if not self.per_token:
            raise TypeError(
                f"{type(self.hf_model).__name__} has no per-token head; a critic needs a decoder backbone"
            )
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.hf_model.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.hf_model.score(hidden).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) score of each sequence, read at its last non-padding token."""
        if self.per_token:
            values = self.values(input_ids, attention_mask)
            return values.gather(-1, last_token_index(attention_mask)[:, None]).squeeze(-1)
        return self.hf_model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)

    def save_pretrained(self, out_dir: str | Path, **kwargs) -> None:
        self.hf_model.save_pretrained(str(out_dir), **kwargs)
