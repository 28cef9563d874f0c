"""Teacher-forced forward passes every stage shares.

- :func:`token_logprobs`: log-probs (and entropies) of the loss-masked tokens of right-padded
  ``prompt + response`` rows (SFT/DPO/RRHF batches, DPO's reference cache), and :func:`token_nll`,
  their token-mean NLL (SFT, ptx);
- :func:`response_logprobs` / :func:`response_token_logprobs`: log-probs (and entropies) of sampled
  responses given left-padded prompts (rollouts: old/reference log-probs, PPO and policy-gradient
  losses, the engine parity check);
- :func:`response_values`: per-token critic values ``V(s_t)`` of sampled responses;
- :func:`sequence_scores`: a reward model's score of each sequence;
- :func:`disable_dropout` and :func:`eval_mode`: the log-prob ratios of RL stages need the same
  function at sampling and training time, so dropout is off for them.

How they run a model (:class:`ForwardSettings`, :func:`use_forward_settings`; the values are the
same either way): a standard Hugging Face causal LM is called as its decoder, and only the scored
positions go through the LM head, fused with the log-softmax in chunks
(:func:`~alignlit.ops.logprobs.linear_logprobs`), so no ``(N, T, V)`` logits exist; and the batch
is packed padding-free, rows that share a prompt holding it once. Models that cannot take these
paths (:func:`forward_support` says why) get the full logits of their own forward.

Every function here is public: research code computes the same quantities the stages do.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from alignlit.ops.logprobs import entropy_from_logits, gather_logprobs, linear_logprobs
from alignlit.ops.stats import masked_mean

log = logging.getLogger(__name__)


@dataclass
class TokenLogprobs:
    """Per-token log-probs of scored tokens.

    Attributes:
        logprobs: (N, L) ``log π(y_t | ...)``, 0 where ``mask`` is False.
        mask: (N, L) bool, True on scored tokens.
        entropy: (N, L) entropy of ``π(· | ...)`` at each scored position (0 elsewhere), or None.
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None

    def sum(self) -> torch.Tensor:
        """(N,) sequence log-probs ``Σ_t log π(y_t | ...)`` over scored tokens."""
        return self.logprobs.sum(-1)

    def lengths(self) -> torch.Tensor:
        """(N,) number of scored tokens of each row."""
        return self.mask.sum(-1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token counted over real tokens only: ``cumsum(mask) - 1``, 0 on left padding.

    A left-padded prompt then gets the same positions it would have unpadded, which is what
    Hugging Face ``generate`` uses, so teacher-forced log-probs match the sampler's.

    Args:
        attention_mask: (B, L) 1/True on real tokens.

    Returns:
        (B, L) long.
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).clamp(min=0)


# ---------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ForwardSettings:
    """How the functions of this module run a model (the results are the same either way).

    Attributes:
        fused_head: compute log-probs (and entropies) from the final hidden states with the LM head
            fused in, chunk by chunk (:func:`~alignlit.ops.logprobs.linear_logprobs`), for the scored
            positions only: no ``(N, T, V)`` logits. Off: the model's full logits, then log-probs.
        packing: padding-free forwards: the real tokens of the batch go through the decoder as one
            sequence without padding (positions restart for every row), and rows that share a
            prompt (a preference pair, the ``n`` samples of a prompt) hold it once, which each of
            their responses attends to. Attention runs per group of rows sharing a prompt
            (:func:`_grouped_attention`), so its cost is that of the padded batch. Needs
            ``fused_head`` (the decoder is called directly).
    """

    fused_head: bool = True
    packing: bool = True


_DEFAULT_SETTINGS = ForwardSettings()
_SETTINGS: ContextVar[ForwardSettings | None] = ContextVar("alignlit_forward_settings", default=None)


def forward_settings() -> ForwardSettings:
    """The :class:`ForwardSettings` in effect."""
    return _SETTINGS.get() or _DEFAULT_SETTINGS


@contextmanager
def use_forward_settings(**changes) -> Iterator[ForwardSettings]:
    """Run the block with some :class:`ForwardSettings` fields changed, e.g.
    ``with use_forward_settings(packing=False): ...``; restores the previous settings afterwards."""
    settings = dataclasses.replace(forward_settings(), **changes)
    token = _SETTINGS.set(settings)
    try:
        yield settings
    finally:
        _SETTINGS.reset(token)


def _resolve(fused_head: bool | None, packing: bool | None) -> tuple[bool, bool]:
    settings = forward_settings()
    fused = settings.fused_head if fused_head is None else fused_head
    pack = (settings.packing if packing is None else packing) and fused
    return fused, pack


def _resolve_packing(packing: bool | None) -> bool:
    settings = forward_settings()
    return settings.packing if packing is None else packing


# ------------------------------------------------------------------------ what a model supports

_UNHANDLED_HEAD_SCALES = ("logits_scaling", "lm_head_multiplier", "output_multiplier", "mup_width_multiplier")
"""Config attributes of models whose LM head output is rescaled in ways the fused head does not reproduce."""


@dataclass(frozen=True)
class ForwardSupport:
    """Which fast paths a model can take, with the reason when it cannot (see :func:`forward_support`).

    Attributes:
        fused_head: None when the fused head applies, else why the full logits are used.
        packing: None when padding-free packing applies, else why padded rows are used.
    """

    fused_head: str | None
    packing: str | None


_SUPPORT: weakref.WeakKeyDictionary[nn.Module, ForwardSupport] = weakref.WeakKeyDictionary()


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, dict] | str:
    """``(backbone, head, head options)`` of a standard Hugging Face causal LM, or why it is not one."""
    get_head = getattr(model, "get_output_embeddings", None)
    get_backbone = getattr(model, "get_decoder", None)
    if not callable(get_head) or not callable(get_backbone):
        return (
            f"{type(model).__name__} is not a Hugging Face causal LM (no get_output_embeddings/get_decoder)"
        )
    head, backbone = get_head(), get_backbone()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or backbone is None or backbone is model:
        return f"{type(model).__name__} has no linear LM head on a separate decoder"
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        # e.g. a LoRA-wrapped head: its weight attribute is not what its forward applies
        return f"the LM head is a {type(head).__name__}, not a plain nn.Linear"
    if any(_is_dtensor(p) for p in (weight, *backbone.parameters())):
        return "the weights are DTensors (tensor parallel / FSDP2): the model's own forward runs the sharded head"
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _UNHANDLED_HEAD_SCALES:
        if getattr(text_config, name, None) not in (None, 1, 1.0):
            return f"{type(model).__name__} rescales its logits ({name}), which the fused head does not reproduce"
    scale = getattr(text_config, "logit_scale", None)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return backbone, head, {"logit_scale": 1.0 if scale is None else float(scale), "softcap": softcap}


def _probe_ids(model: nn.Module, length: int) -> torch.Tensor:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    device = next(model.parameters()).device
    return (torch.arange(3, 3 + length, device=device) * 7919 % vocab)[None]  # (1, length)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, float(b.abs().max()))
    return a.shape == b.shape and bool(((a.float() - b.float()).abs() <= _tolerance(b.dtype) * scale).all())


@torch.no_grad()
def _probe_packing(model: nn.Module, backbone: nn.Module) -> str | None:
    """Check on a tiny batch that packing two rows which share a prompt gives the padded forward's
    hidden states (None), or say why packing does not apply."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (packing replaces 'sdpa' or 'eager' attention only)"
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return f"layers with attention other than full causal ({sorted(set(layer_types))})"
    if layer_types is None and getattr(text_config, "sliding_window", None) is not None:
        return f"sliding-window attention (window {text_config.sliding_window})"
    ids = _probe_ids(model, 5)[0]
    rows = torch.stack([ids, torch.cat([ids[:3], ids[1:3]]), ids.flip(0)])  # (3, 5): rows 0, 1 share 3 tokens
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], device=ids.device)
    rows = rows.masked_fill(attention_mask == 0, 0)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 1, 1, 0, 0]], device=ids.device).bool()
    try:
        padded = backbone(input_ids=rows, attention_mask=attention_mask, use_cache=False).last_hidden_state
        packed = _pack(rows, attention_mask.bool(), _prompt_lengths(attention_mask.bool(), loss_mask))
        hidden = _packed_hidden(backbone, packed, config)
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        return f"the decoder refused a packed batch ({type(e).__name__}: {e})"
    real = attention_mask.bool()
    if not _close(hidden[packed.index[real]], padded[real]):
        return "packed rows gave other hidden states than padded ones (the model mixes positions otherwise)"
    return None


@torch.no_grad()
def _probe(model: nn.Module) -> ForwardSupport:
    parts = _causal_lm_parts(model)
    if isinstance(parts, str):
        return ForwardSupport(parts, parts)
    backbone, head, options = parts
    with eval_mode(model):
        ids = _probe_ids(model, 4)
        try:
            hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state  # (1, 4, H)
        except (TypeError, ValueError, RuntimeError) as e:
            reason = f"calling the decoder alone failed ({type(e).__name__}: {e})"
            return ForwardSupport(reason, reason)
        logits = model(input_ids=ids, use_cache=False).logits  # (1, 4, V)
        ours = head(hidden).float() * options["logit_scale"]
        if options["softcap"] is not None:
            ours = options["softcap"] * torch.tanh(ours / options["softcap"])
        if not _close(ours, logits.float()):
            reason = f"{type(model).__name__}'s logits are not its LM head applied to its decoder's output"
            return ForwardSupport(reason, reason)
        return ForwardSupport(None, _probe_packing(model, backbone))


def forward_support(model: nn.Module) -> ForwardSupport:
    """Whether ``model`` can take the fused-head and packed paths, and why not.

    A standard Hugging Face causal LM (a decoder from ``get_decoder()``, a linear head from
    ``get_output_embeddings()``, optional ``logit_scale`` and ``final_logit_softcapping``) takes the
    fused head when, on a probe input, the head applied to the decoder's output gives the model's
    logits; it also packs when its attention is "sdpa" or "eager" (packed forwards run attention
    per group through SDPA instead), full causal (no sliding window), and a packed probe batch
    gives the padded batch's hidden states. Sharded weights (DTensor) and wrapped heads (LoRA on
    the head) keep the model's own forward. Probed once per model (a few tiny forwards); gradient
    checkpointing turns packing off at call time.
    """
    support = _SUPPORT.get(model)
    if support is None:
        support = _probe(model)
        _SUPPORT[model] = support
        for path, reason in (("fused head", support.fused_head), ("packing", support.packing)):
            if reason is not None:
                log.info("%s: no %s: %s", type(model).__name__, path, reason)
    return support


# -------------------------------------------------------------------------------------- packing

GROUPED_ATTENTION = "alignlit_grouped"
"""Name under which :func:`_grouped_attention` is registered with Hugging Face's ``AttentionInterface``."""


@dataclass
class _Packed:
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


def _prompt_lengths(attention_mask: torch.Tensor, scored_tokens: torch.Tensor) -> torch.Tensor:
    """(N,) real tokens before the first scored token of each row (all of them when none is scored)."""
    real = attention_mask.long().cumsum(-1)  # (N, T) real tokens up to and including each column
    first = torch.where(scored_tokens & attention_mask, real - 1, real[:, -1:]).min(-1).values  # (N,)
    return first


def _pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor) -> _Packed:
    """Pack the real tokens of ``input_ids`` (N, T) into one sequence; rows whose first
    ``prompt_lengths`` real tokens are equal form a group that holds them once."""
    device = input_ids.device
    ids_cpu, mask_cpu = input_ids.cpu(), attention_mask.cpu().bool()
    lengths, prompts = mask_cpu.sum(-1).tolist(), prompt_lengths.cpu().tolist()
    sequences = [row[m] for row, m in zip(ids_cpu, mask_cpu)]
    groups: dict[bytes, list[int]] = {}
    for i, (seq, p) in enumerate(zip(sequences, prompts)):
        key = seq[:p].numpy().tobytes() + b"|" + str(p).encode() if p else f"row{i}".encode()
        groups.setdefault(key, []).append(i)
    members = list(groups.values())
    sizes = [prompts[g[0]] + sum(lengths[i] - prompts[i] for i in g) for g in members]
    width = max(sizes, default=1)
    tokens: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    index = torch.full(ids_cpu.shape, -1, dtype=torch.long)  # (N, T)
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
    return _Packed(
        torch.cat(tokens)[None].to(device),
        torch.cat(positions)[None].to(device),
        index.to(device),
        group_index.to(device),
        group_mask[:, None].to(device),
        torch.cat(in_groups).to(device),
    )


_LAYOUT: ContextVar[_Packed | None] = ContextVar("alignlit_packed_layout", default=None)


def _grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of a packed sequence, one padded block per group of rows sharing a prompt.

    ``query`` (1, H, S, D), ``key``/``value`` (1, H_kv, S, D) of the packed sequence; the layout is the
    :class:`_Packed` being run (a context variable). Returns ``(output (1, S, H, D), None)``, what
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


def _register_grouped_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED_ATTENTION, _grouped_attention)


_register_grouped_attention()


def _configs(config) -> list:
    out = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return out if text is config else [*out, text]


def _packed_hidden(backbone: nn.Module, packed: _Packed, config) -> torch.Tensor:
    """(S, H) final hidden states of a packed sequence (attention per group, :func:`_grouped_attention`)."""
    configs = _configs(config)
    previous = [c._attn_implementation_internal for c in configs]
    token = _LAYOUT.set(packed)
    try:
        for c in configs:
            c._attn_implementation_internal = GROUPED_ATTENTION
        # a 4D mask is used as given: this one-element placeholder skips mask construction (the
        # groups' masks are in the layout)
        placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=packed.input_ids.device)
        hidden = backbone(
            input_ids=packed.input_ids,
            attention_mask=placeholder,
            position_ids=packed.position_ids,
            use_cache=False,
        ).last_hidden_state  # (1, S, H)
    finally:
        for c, impl in zip(configs, previous):
            c._attn_implementation_internal = impl
        _LAYOUT.reset(token)
    return hidden[0]


# ----------------------------------------------------------------------------- scoring positions


def _scored(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> TokenLogprobs:
    """Log-probs of ``labels`` under ``log_softmax(logits / temperature)`` (and entropies), masked.

    ``logits`` (N, L, V) are already aligned with ``labels`` (N, L); ``mask`` (N, L) bool.
    """
    if temperature not in (0.0, 1.0):  # 0 (greedy) scores as T = 1, the Rollout convention
        logits = logits / float(temperature)
    weights = mask.to(torch.promote_types(logits.dtype, torch.float32))
    logprobs = gather_logprobs(logits, labels.masked_fill(~mask, 0)) * weights  # (N, L)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach()) * weights  # (N, L)
    return TokenLogprobs(logprobs, mask, entropy)


def _check_temperature(temperature: float) -> float:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


@dataclass
class _Plan:
    """Where the hidden state that predicts each scored token lives, for one forward."""

    hidden: torch.Tensor  # (X, H) flat final hidden states
    columns: torch.Tensor  # (N, T) flat row of each input column in ``hidden`` (-1: none)


def _hidden_plan(
    backbone: nn.Module,
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None,
    prompt_lengths: torch.Tensor | None,
) -> _Plan:
    """Run the backbone packed (``prompt_lengths`` given) or padded, and say where each column went."""
    if prompt_lengths is not None:
        packed = _pack(input_ids, attention_mask, prompt_lengths)
        return _Plan(_packed_hidden(backbone, packed, model.config), packed.index)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state  # (N, T, H)
    n, t = input_ids.shape
    columns = torch.arange(n * t, device=input_ids.device).view(n, t)
    return _Plan(hidden.reshape(n * t, -1), columns)


def _fused_scored(
    model: nn.Module,
    plan: _Plan,
    predictor: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> TokenLogprobs:
    """Log-probs of ``labels`` (N, S) at the ``mask``-ed positions (N, S), read from the hidden state
    at input column ``predictor`` (N, S) through the fused head."""
    _, head, options = _causal_lm_parts(model)
    rows, cols = mask.nonzero(as_tuple=True)  # (M,) each, row-major like masked_scatter
    flat = plan.columns[rows, predictor[rows, cols]]  # (M,)
    logprobs, entropy = linear_logprobs(
        plan.hidden[flat],
        head.weight,
        labels[rows, cols],
        bias=getattr(head, "bias", None),
        temperature=temperature,
        logit_scale=options["logit_scale"],
        softcap=options["softcap"],
        with_entropy=with_entropy,
        check_labels=False,  # input token ids: the embedding lookup has checked them
    )  # (M,)
    out = torch.zeros(mask.shape, dtype=logprobs.dtype, device=logprobs.device).masked_scatter(mask, logprobs)
    if entropy is not None:
        entropy = entropy if entropy_grad else entropy.detach()
        entropy = torch.zeros_like(out).masked_scatter(mask, entropy)
    return TokenLogprobs(out, mask, entropy)


def _is_right_padded(attention_mask: torch.Tensor) -> bool:
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


_CHECKPOINTING = "gradient checkpointing recomputes the attention outside the packed forward"


def _packing_reason(model: nn.Module, pack: bool) -> str | None:
    if not pack:
        return "off"
    if getattr(model, "is_gradient_checkpointing", False):
        return _CHECKPOINTING
    return forward_support(model).packing


# ---------------------------------------------------------------------------------- public API


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    fused_head: bool | None = None,
    packing: bool | None = None,
) -> TokenLogprobs:
    """Teacher-forced log-probs of the loss-masked tokens of right-padded sequences.

    Position ``t`` of the result scores token ``t + 1`` of the input: the result has ``T - 1``
    columns, and its mask is ``loss_mask[:, 1:]``. Rows that share their prompt (the tokens
    before the first loss-masked one), such as the chosen and rejected rows of a preference pair,
    share its computation when packed (see :class:`ForwardSettings`); the values are the same.

    Args:
        model: causal LM returning ``.logits`` (N, T, V).
        input_ids: (N, T) right-padded prompt + response ids.
        attention_mask: (N, T) True on real tokens.
        loss_mask: (N, T) True on the tokens to score (response tokens).
        temperature: divide the logits by it (0 and 1: unchanged).
        with_entropy: also return per-position entropies.
        entropy_grad: let gradients flow through the entropies.
        fused_head: override :attr:`ForwardSettings.fused_head` (None: the settings in effect).
        packing: override :attr:`ForwardSettings.packing` (None: the settings in effect).

    Returns:
        :class:`TokenLogprobs` of shape (N, T - 1).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (N, T), got {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("loss_mask", loss_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != input_ids shape {tuple(input_ids.shape)}")
    temperature = _check_temperature(temperature)
    options = {"temperature": temperature, "with_entropy": with_entropy, "entropy_grad": entropy_grad}
    labels, mask = input_ids[:, 1:], loss_mask[:, 1:].bool()  # (N, T-1)
    fused, pack = _resolve(fused_head, packing)
    if not fused or forward_support(model).fused_head is not None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (N, T-1, V)
        return _scored(logits, labels, mask, **options)
    backbone = _causal_lm_parts(model)[0]
    attention = attention_mask.bool()
    prompts = None
    if _packing_reason(model, pack) is None and _is_right_padded(attention):
        prompts = _prompt_lengths(attention, loss_mask.bool())
    plan = _hidden_plan(backbone, model, input_ids, attention_mask, position_ids=None, prompt_lengths=prompts)
    predictor = torch.arange(labels.shape[1], device=input_ids.device).expand_as(
        labels
    )  # column t scores t + 1
    return _fused_scored(model, plan, predictor, labels, mask, **options)


def token_nll(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    fused_head: bool | None = None,
    packing: bool | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean next-token NLL over the loss-masked tokens of right-padded sequences (SFT, ptx).

    The loss of :func:`alignlit.losses.lm.masked_nll` with ``reduction="token_mean"`` on the model's
    shifted logits, computed by :func:`token_logprobs` (fused head, packed).

    Returns:
        ``(loss, metrics)``: metrics ``nll`` (detached loss), ``ppl`` (``exp(nll)``) and ``tokens``
        (number of scored tokens).
    """
    scored = token_logprobs(
        model, input_ids, attention_mask, loss_mask, fused_head=fused_head, packing=packing
    )  # (N, T-1)
    loss = -masked_mean(scored.logprobs, scored.mask)
    nll = loss.detach()
    return loss, {"nll": nll, "ppl": torch.exp(nll), "tokens": scored.mask.sum()}


def _concat(prompt_ids, prompt_mask, response_ids, response_mask) -> tuple[torch.Tensor, torch.Tensor]:
    if prompt_ids.dim() != 2 or response_ids.dim() != 2:
        raise ValueError(
            f"prompt_ids and response_ids must be (B, P) and (B, T), got {tuple(prompt_ids.shape)} "
            f"and {tuple(response_ids.shape)}"
        )
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_mask shape {tuple(prompt_mask.shape)} != prompt_ids shape {tuple(prompt_ids.shape)}"
        )
    if response_mask.shape != response_ids.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != response_ids shape "
            f"{tuple(response_ids.shape)}"
        )
    if prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(f"prompt batch {prompt_ids.shape[0]} != response batch {response_ids.shape[0]}")
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompt_ids has no columns: every response needs at least one prompt token")
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P + T)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)  # (B, P + T)
    return input_ids, attention_mask


def _response_plan(
    model_or_backbone: tuple[nn.Module, nn.Module],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    pack: bool,
) -> tuple[_Plan, torch.Tensor]:
    """The hidden states of ``[prompt ; response]`` and, per response token, the input column that
    predicts it: ``P - 1 + t``. Packed when ``pack`` and every such column is a real token."""
    model, backbone = model_or_backbone
    input_ids, attention_mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    num_prompt = prompt_ids.shape[1]
    steps = response_ids.shape[1]
    predictor = (num_prompt - 1 + torch.arange(steps, device=input_ids.device)).expand(
        input_ids.shape[0], steps
    )
    mask = response_mask.bool()
    attention = attention_mask.bool()
    prompts = None
    # the last prompt column predicts token 0; a response token after a padded one would be scored
    # from a padding column: keep padded rows then
    if pack and bool((attention.gather(1, predictor) | ~mask).all()):
        prompts = prompt_mask.long().sum(-1)
    plan = _hidden_plan(
        backbone,
        model,
        input_ids,
        attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        prompt_lengths=prompts,
    )
    return plan, predictor


def response_token_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    fused_head: bool | None = None,
    packing: bool | None = None,
) -> TokenLogprobs:
    """``log_softmax(logits / temperature)`` of each response token given the prompt and earlier tokens.

    One forward pass over ``[prompt ; response]`` (left-padded prompt, right-padded response): the
    logits at position ``P - 1 + t`` score response token ``t``. Positions are counted over real
    tokens (:func:`position_ids_from_mask`), so left padding does not shift them. Gradients flow
    when called outside ``torch.no_grad``. Temperature 0 (greedy) is scored as 1, the convention
    of :class:`~alignlit.rollout.base.Rollout`. The ``n`` samples of a prompt share its
    computation when packed (see :class:`ForwardSettings`); the values are the same.

    Args:
        model: causal LM returning ``.logits`` of shape (B, L, V).
        prompt_ids: (B, P) long, left-padded.
        prompt_mask: (B, P) 1/True on real prompt tokens.
        response_ids: (B, T) long, right-padded.
        response_mask: (B, T) 1/True on real response tokens.
        temperature: sampling temperature the response was drawn with (>= 0).
        with_entropy: also return per-token entropies.
        entropy_grad: let gradients flow through the entropies.
        fused_head: override :attr:`ForwardSettings.fused_head` (None: the settings in effect).
        packing: override :attr:`ForwardSettings.packing` (None: the settings in effect).

    Returns:
        :class:`TokenLogprobs` of shape (B, T), in float32 (float64 for a float64 model).
    """
    temperature = _check_temperature(temperature)
    options = {"temperature": temperature, "with_entropy": with_entropy, "entropy_grad": entropy_grad}
    fused, pack = _resolve(fused_head, packing)
    if not fused or forward_support(model).fused_head is not None:
        input_ids, attention_mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
        num_prompt = prompt_ids.shape[1]
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).logits[:, num_prompt - 1 : -1]  # (B, T, V): position P-1+t predicts response token t
        return _scored(logits, response_ids, response_mask.bool(), **options)
    backbone = _causal_lm_parts(model)[0]
    plan, predictor = _response_plan(
        (model, backbone), prompt_ids, prompt_mask, response_ids, response_mask,
        pack=_packing_reason(model, pack) is None,
    )  # fmt: skip
    return _fused_scored(model, plan, predictor, response_ids, response_mask.bool(), **options)


def response_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(B, T) log-probs of sampled response tokens, 0 on padding (:func:`response_token_logprobs`)."""
    return response_token_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=temperature
    ).logprobs


def _scalar_parts(scalar_model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """``(hf model, backbone, score head)`` of a decoder :class:`~alignlit.models.ScalarHeadModel`
    that packs (None: use its own methods)."""
    hf = getattr(scalar_model, "hf_model", None)
    backbone, score = getattr(hf, "model", None), getattr(hf, "score", None)
    if not isinstance(backbone, nn.Module) or not isinstance(score, nn.Module):
        return None
    support = _SUPPORT.get(hf)
    if support is None:
        support = ForwardSupport(None, _probe_scalar(hf, backbone))
        _SUPPORT[hf] = support
        if support.packing is not None:
            log.info("%s: no packing: %s", type(hf).__name__, support.packing)
    if support.packing is not None or getattr(hf, "is_gradient_checkpointing", False):
        return None
    return hf, backbone, score


def _probe_scalar(hf: nn.Module, backbone: nn.Module) -> str | None:
    if any(_is_dtensor(p) for p in backbone.parameters()):
        return "the weights are DTensors (tensor parallel / FSDP2)"
    with eval_mode(hf):
        return _probe_packing(hf, backbone)


def response_values(
    critic: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    packing: bool | None = None,
) -> torch.Tensor:
    """(B, T) critic values ``V(s_t)``: the head at the position that predicts response token ``t``.

    ``critic`` has ``values(input_ids, attention_mask) -> (B, L)`` (a decoder
    :class:`~alignlit.models.ScalarHeadModel`). 0 on padding. Packed like
    :func:`response_token_logprobs` when the backbone allows it (``packing``: override
    :attr:`ForwardSettings.packing`).
    """
    pack = _resolve_packing(packing)
    parts = _scalar_parts(critic) if pack else None
    if parts is None:
        input_ids, attention_mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
        num_prompt = prompt_ids.shape[1]
        values = critic.values(input_ids, attention_mask)[:, num_prompt - 1 : -1]  # (B, T)
        return values * response_mask.to(values.dtype)
    hf, backbone, score = parts
    plan, predictor = _response_plan(
        (hf, backbone), prompt_ids, prompt_mask, response_ids, response_mask, pack=True
    )
    mask = response_mask.bool()
    rows, cols = mask.nonzero(as_tuple=True)  # (M,)
    values = score(plan.hidden[plan.columns[rows, predictor[rows, cols]]]).squeeze(-1)  # (M,)
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def sequence_scores(
    scalar_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    packing: bool | None = None,
) -> torch.Tensor:
    """(N,) score of each right-padded sequence: a scalar-head model read at its last real token.

    The same numbers as ``scalar_model(input_ids, attention_mask)``
    (:class:`~alignlit.models.ScalarHeadModel`), from a packed forward when the backbone allows it:
    with ``loss_mask`` (N, T) (True on response tokens), rows with the same prompt, such as the two
    rows of a preference pair, hold it once. ``packing`` overrides :attr:`ForwardSettings.packing`.
    """
    if loss_mask is not None and loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    pack = _resolve_packing(packing)
    attention = attention_mask.bool()
    parts = _scalar_parts(scalar_model) if pack and _is_right_padded(attention) else None
    if parts is None or not bool(attention.any(-1).all()):
        return scalar_model(input_ids, attention_mask)
    hf, backbone, score = parts
    scored = loss_mask.bool() if loss_mask is not None else torch.zeros_like(attention)
    packed = _pack(input_ids, attention, _prompt_lengths(attention, scored))
    hidden = _packed_hidden(backbone, packed, hf.config)  # (S, H)
    last = attention.long().sum(-1) - 1  # (N,) right padding: the last real token's column
    flat = packed.index.gather(1, last[:, None]).squeeze(1)  # (N,)
    return score(hidden[flat]).squeeze(-1)


def compile_decoder(model: nn.Module, **options) -> nn.Module:
    """``torch.compile`` the decoder of a causal LM or scalar-head model in place; returns ``model``.

    Compiles the module the functions of this module call (``get_decoder()``, or a scalar-head
    model's ``hf_model.model``) with ``dynamic=True`` by default (packed batches change shape every
    step); parameter names and checkpoints are unchanged (``nn.Module.compile``). Measured on CPU
    with the 3.2M-parameter benchmark Llama (``benchmarks/bench_vs_trl.py --workloads sft --compile
    --warmup 8``): SFT 204 vs 160 examples/s uncompiled (the first steps pay the compilation).
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
        if isinstance(module, nn.modules.dropout._DropoutNd):
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
