"""How a model runs, outside the forward functions: dropout off, eval mode for a block, a compiled decoder.

- :func:`disable_dropout` and :func:`eval_mode`: the log-prob ratios of RL stages need the same
  function at sampling and training time, so dropout is off for them.
- :func:`compile_decoder`: ``torch.compile`` the decoder the forward functions of
  :mod:`alignlit.models.forward` call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from alignlit.lightning_internals import is_dropout


def compile_decoder(model: nn.Module, **options) -> nn.Module:
    """``torch.compile`` the decoder of a causal LM or scalar-head model in place; returns ``model``.

    Compiles the module the functions of :mod:`alignlit.models.forward` call (``get_decoder()``, or a
    scalar-head model's ``hf_model.model``) with ``dynamic=True`` by default (packed batches change
    shape every step); parameter names and checkpoints are unchanged (``nn.Module.compile``).
    Measured on CPU with the 3.2M-parameter benchmark Llama (``benchmarks/bench_vs_trl.py
    --workloads sft --compile --warmup 8``): SFT 204 vs 160 examples/s uncompiled (the first steps
    pay the compilation).
    """
    hf = getattr(model, "hf_model", model)
    decoder = hf.get_decoder() if callable(getattr(hf, "get_decoder", None)) else getattr(hf, "model", None)
    if not isinstance(decoder, nn.Module):
        raise TypeError(f"{type(model).__name__} has no decoder to compile (get_decoder() or .model)")
    decoder.compile(**{"dynamic": True, **options})
    return model


DROPOUT_ATTRIBUTES = ("attention_dropout", "hidden_dropout", "dropout_p", "attn_pdrop", "resid_pdrop")
"""Float attributes some Hugging Face modules read their dropout rate from (besides ``nn.Dropout``)."""


def disable_dropout(model: nn.Module) -> nn.Module:
    """Turn every dropout of ``model`` off, in train mode too; returns ``model``.

    RL stages compare log-probs of the same tokens under the same weights at different times
    (sampling, old/reference log-probs, the loss): with dropout on, the PPO ratio is not 1 at the
    first update and the DPO loss is not ``log 2`` at initialisation. Sets ``p = 0`` on every
    ``nn.Dropout`` and zeroes the float dropout rates attention modules read directly (e.g.
    ``LlamaAttention.attention_dropout``) and the model config's.
    """
    config = getattr(model, "config", None)
    for module in model.modules():
        if is_dropout(module):
            module.p = 0.0
        for name in DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    if config is not None:
        for name in (*DROPOUT_ATTRIBUTES, "embd_pdrop", "classifier_dropout", "hidden_dropout_prob"):
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, 0.0)
    return model


@contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """Put ``models`` in eval mode for the block and restore each one's train/eval mode afterwards."""
    modes = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        yield
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)
