"""Tiny Llama models built from a config, for tests and the quickstart (no download)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from alignlit.models.loading import load_tokenizer


def tiny_llama_config(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 384,
    max_position_embeddings: int = 256,
    attention_dropout: float = 0.0,
) -> LlamaConfig:
    """A Llama config sized for CPU; head_dim 64 so the same model also runs in vLLM on CPU."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=attention_dropout,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )


def make_tiny_llama(
    tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, **config_kwargs
) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama (see :func:`tiny_llama_config` for the sizes)."""
    config = tiny_llama_config(tokenizer, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@dataclass
class TinyLlama:
    """A policy trained from scratch: a tiny Llama over a local tokenizer directory.

    Use it where a stage takes ``policy``, instead of the path of a pretrained model.

    Args:
        tokenizer: path of a tokenizer directory (e.g. the one ``alignlit sim make-data`` writes).
        hidden_size: model width.
        num_layers: transformer blocks.
        num_heads: attention heads (head_dim is fixed by ``head_dim``).
        head_dim: per-head width; 64 keeps the model runnable in vLLM on CPU.
        intermediate_size: MLP width.
        max_position_embeddings: longest sequence the model accepts.
        attention_dropout: dropout on the attention weights (stages that compare log-prob ratios turn it off).
        seed: initialisation seed.
    """

    tokenizer: str
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    attention_dropout: float = 0.0
    seed: int = 0

    def build(self):
        tok = load_tokenizer(self.tokenizer)
        model = make_tiny_llama(
            tok,
            seed=self.seed,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            attention_dropout=self.attention_dropout,
        )
        return model, tok


# Stages keep their __init__ arguments (a TinyLlama among them) in checkpoints; let torch.load's
# weights-only unpickler rebuild it on resume.
torch.serialization.add_safe_globals([TinyLlama])
