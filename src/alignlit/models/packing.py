"""Padding-free forwards: the real tokens of a batch through the decoder as one sequence.

:func:`pack` lays the rows of a batch out as one sequence without padding, positions restarting
for every row, rows that share a prompt (a preference pair, the ``n`` samples of a prompt)
holding it once; :func:`packed_hidden` runs a decoder on it with :func:`grouped_attention`,
attention per group of rows sharing a prompt, so its cost is that of the padded batch.
:func:`decoder_hidden` runs a decoder packed or padded and says where each input column went.
The transformers internals this needs are in :mod:`alignlit.models.hf_internals`.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from alignlit.models import hf_internals

GROUPED_ATTENTION = "alignlit_grouped"
"""Name under which :func:`grouped_attention` is registered with Hugging Face's ``AttentionInterface``."""


@dataclass
class Packed:
    """The real tokens of ``N`` right- or left-padded rows as one sequence of ``S`` tokens, in
    ``G`` groups of rows that share a prompt (the prompt first, then each row's own tokens).

    Attributes:
        input_ids: (1, S) long.
        position_ids: (1, S) long: each row's positions counted from 0 (a shared prompt once).
        index: (N, T) long, where each real token of the input batch went in the sequence (-1 on padding).
        group_index: (G, W) long, the tokens of each group (``W``: the longest group); past a group's
            end, its last token again (a padding slot, which nothing attends to).
        group_mask: (G, 1, W, W) bool, True where a query token of a group may attend to a key token:
            causal, a row's own tokens and its prompt; a padding slot sees only itself.
        positions: (S,) long, where each token of the sequence is in the flattened (G * W) groups.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    group_index: torch.Tensor
    group_mask: torch.Tensor
    positions: torch.Tensor


def prompt_lengths(attention_mask: torch.Tensor, scored_tokens: torch.Tensor) -> torch.Tensor:
    """(N,) real tokens before the first scored token of each row (all of them when none is scored)."""
    real = attention_mask.long().cumsum(-1)  # (N, T) real tokens up to and including each column
    first = torch.where(scored_tokens & attention_mask, real - 1, real[:, -1:]).min(-1).values  # (N,)
    return first


@dataclass
class _Grouping:
    """The rows of a right-padded batch on the CPU, grouped by shared prompt (what :func:`pack` lays out
    and :func:`packing_saving` counts)."""

    mask: torch.Tensor  # (N, T) bool
    lengths: list[int]  # real tokens per row
    prompts: list[int]  # prompt tokens per row
    sequences: list[torch.Tensor]  # each row's real tokens
    members: list[
        list[int]
    ]  # rows whose first ``prompts[i]`` real tokens are equal, in order of first appearance
    sizes: list[int]  # packed tokens per group: the shared prompt once, then each row's own tokens


def _grouping(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor
) -> _Grouping:
    mask = attention_mask.cpu().bool()
    lengths, prompts = mask.sum(-1).tolist(), prompt_lengths.cpu().tolist()
    sequences = [row[m] for row, m in zip(input_ids.cpu(), mask)]
    groups: dict[bytes, list[int]] = {}
    for i, (seq, p) in enumerate(zip(sequences, prompts)):
        key = seq[:p].numpy().tobytes() + b"|" + str(p).encode() if p else f"row{i}".encode()
        groups.setdefault(key, []).append(i)
    members = list(groups.values())
    sizes = [prompts[g[0]] + sum(lengths[i] - prompts[i] for i in g) for g in members]
    return _Grouping(mask, lengths, prompts, sequences, members, sizes)


def packing_saving(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor
) -> float:
    """The share of the padded batch's ``N * T`` token positions that a packed forward does not run:
    ``1 - packed / (N * T)``, ``packed`` the real tokens with each shared prompt counted once
    (:func:`pack`'s sequence length). 0 for a batch without padding or shared prompts."""
    padded = input_ids.numel()
    return 1.0 - sum(_grouping(input_ids, attention_mask, prompt_lengths).sizes) / padded if padded else 0.0


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor) -> Packed:
    """Pack the real tokens of ``input_ids`` (N, T) into one sequence; rows whose first
    ``prompt_lengths`` real tokens are equal form a group that holds them once."""
    device = input_ids.device
    grouping = _grouping(input_ids, attention_mask, prompt_lengths)
    mask_cpu, lengths, prompts = grouping.mask, grouping.lengths, grouping.prompts
    sequences, members = grouping.sequences, grouping.members
    width = max(grouping.sizes, default=1)
    tokens: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    index = torch.full(mask_cpu.shape, -1, dtype=torch.long)  # (N, T)
    group_index = torch.empty(len(members), width, dtype=torch.long)  # (G, W)
    in_groups = []
    group_mask = torch.eye(width, dtype=torch.bool).repeat(len(members), 1, 1)  # (G, W, W)
    columns = [m.nonzero().flatten() for m in mask_cpu]
    offset = 0
    for g, group in enumerate(members):
        p = prompts[group[0]]
        tokens.append(sequences[group[0]][:p])
        positions.append(torch.arange(p))
        segments = [torch.zeros(p, dtype=torch.long)]
        cursor = offset + p
        for k, i in enumerate(group, start=1):
            rest = lengths[i] - p
            tokens.append(sequences[i][p:])
            positions.append(torch.arange(p, lengths[i]))
            segments.append(torch.full((rest,), k, dtype=torch.long))
            index[i, columns[i]] = torch.cat(
                [torch.arange(offset, offset + p), torch.arange(cursor, cursor + rest)]
            )
            cursor += rest
        size = cursor - offset
        segment = torch.cat(segments)  # (size,) 0 on the prompt, k on the k-th row's own tokens
        causal = torch.ones(size, size, dtype=torch.bool).tril()
        group_mask[g, :size, :size] = causal & (
            (segment[None, :] == 0) | (segment[None, :] == segment[:, None])
        )
        group_index[g, :size] = torch.arange(offset, cursor)
        group_index[g, size:] = cursor - 1
        in_groups.append(torch.arange(g * width, g * width + size))
        offset = cursor
    return Packed(
        torch.cat(tokens)[None].to(device),
        torch.cat(positions)[None].to(device),
        index.to(device),
        group_index.to(device),
        group_mask[:, None].to(device),
        torch.cat(in_groups).to(device),
    )


_LAYOUT: ContextVar[Packed | None] = ContextVar("alignlit_packed_layout", default=None)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of a packed sequence, one padded block per group of rows sharing a prompt.

    ``query`` (1, H, S, D), ``key``/``value`` (1, H_kv, S, D) of the packed sequence; the layout is the
    :class:`Packed` being run (a context variable). Returns ``(output (1, S, H, D), None)``, what
    Hugging Face attention functions return.
    """
    layout = _LAYOUT.get()
    if layout is None:
        raise RuntimeError(f"{GROUPED_ATTENTION} attention runs only inside alignlit's packed forwards")
    heads = query.shape[1]

    def grouped(x: torch.Tensor) -> torch.Tensor:  # (1, h, S, D) -> (G, heads, W, D)
        out = x[0][:, layout.group_index].transpose(0, 1)  # (G, h, W, D)
        if out.shape[1] != heads:  # grouped-query attention: repeat the key/value heads
            out = out.repeat_interleave(heads // out.shape[1], dim=1)
        return out

    out = torch.nn.functional.scaled_dot_product_attention(
        grouped(query),
        grouped(key),
        grouped(value),
        attn_mask=layout.group_mask,
        dropout_p=dropout,
        scale=scaling,
    )  # (G, H, W, D)
    out = out.transpose(1, 2).flatten(0, 1).index_select(0, layout.positions)  # (S, H, D), sequence order
    return out[None], None


def packed_hidden(backbone: nn.Module, packed: Packed, config) -> torch.Tensor:
    """(S, H) final hidden states of a packed sequence (attention per group, :func:`grouped_attention`)."""
    token = _LAYOUT.set(packed)
    try:
        with hf_internals.use_attention(config, GROUPED_ATTENTION, grouped_attention):
            hidden = backbone(
                input_ids=packed.input_ids,
                attention_mask=hf_internals.mask_placeholder(packed.input_ids.device),
                position_ids=packed.position_ids,
                use_cache=False,
            ).last_hidden_state  # (1, S, H)
    finally:
        _LAYOUT.reset(token)
    return hidden[0]


@dataclass
class HiddenStates:
    """The final hidden states of one decoder forward, and where each input column's state is.

    Attributes:
        hidden: (X, H) flat final hidden states.
        columns: (N, T) flat row of each input column in ``hidden`` (-1: none, a padding column of a
            packed forward).
    """

    hidden: torch.Tensor
    columns: torch.Tensor


def decoder_hidden(
    backbone: nn.Module,
    config,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None,
    prompt_lengths: torch.Tensor | None,
) -> HiddenStates:
    """Run the decoder packed (``prompt_lengths`` given) or padded, and say where each column went."""
    if prompt_lengths is not None:
        packed = pack(input_ids, attention_mask, prompt_lengths)
        return HiddenStates(packed_hidden(backbone, packed, config), packed.index)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state  # (N, T, H)
    n, t = input_ids.shape
    columns = torch.arange(n * t, device=input_ids.device).view(n, t)
    return HiddenStates(hidden.reshape(n * t, -1), columns)
