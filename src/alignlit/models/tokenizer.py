"""Byte-level BPE tokenizers trained locally (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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
