"""Teacher-forced forward passes every stage shares.

- :func:`token_logprobs`: log-probs (and entropies) of the loss-masked tokens of right-padded
  ``prompt + response`` rows (SFT/DPO/RRHF batches, DPO's reference cache), and :func:`token_nll`,
  their token-mean NLL (SFT, ptx);
- :func:`response_logprobs` / :func:`response_token_logprobs`: log-probs (and entropies) of sampled
  responses given left-padded prompts (rollouts: old/reference log-probs, PPO and policy-gradient
  losses, the engine parity check);
- :func:`response_values`: per-token critic values ``V(s_t)`` of sampled responses;
- :func:`sequence_scores`: a reward model's score of each sequence.

How they run a model (:class:`~alignlit.models.forward_settings.ForwardSettings`,
:func:`~alignlit.models.forward_settings.use_forward_settings`; the values are the same either
way): a standard Hugging Face causal LM is called as its decoder, and only the scored positions
go through the LM head, fused with the log-softmax in chunks (:mod:`alignlit.models.scoring`), so
no ``(N, T, V)`` logits exist; and the batch is packed padding-free, rows that share a prompt
holding it once (:mod:`alignlit.models.packing`). Models that cannot take these paths
(:func:`~alignlit.models.support.forward_support` says why) get the full logits of their own
forward. Each function takes that choice from :func:`~alignlit.models.dispatch.plan_forward`.
Dropout and eval mode for RL stages are in :mod:`alignlit.models.modes`.

Every function here is public: research code computes the same quantities the stages do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from alignlit.models.batch_layout import (
    concat_response,
    response_predictor,
    response_reason,
    right_padding_reason,
    scores_reason,
)
from alignlit.models.dispatch import plan_forward
from alignlit.models.packing import HiddenStates, decoder_hidden, packing_saving, prompt_lengths
from alignlit.models.scoring import check_temperature, fused_scored, logits_scored
from alignlit.ops.stats import masked_mean


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


def _result(scored: tuple[torch.Tensor, torch.Tensor | None], mask: torch.Tensor) -> TokenLogprobs:
    logprobs, entropy = scored
    return TokenLogprobs(logprobs, mask, entropy)


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
    packing: bool | Literal["auto"] | None = None,
) -> TokenLogprobs:
    """Teacher-forced log-probs of the loss-masked tokens of right-padded sequences.

    Position ``t`` of the result scores token ``t + 1`` of the input: the result has ``T - 1``
    columns, and its mask is ``loss_mask[:, 1:]``. Rows that share their prompt (the tokens
    before the first loss-masked one), such as the chosen and rejected rows of a preference pair,
    share its computation when packed (see :class:`~alignlit.models.forward_settings.ForwardSettings`);
    the values are the same.

    Args:
        model: causal LM returning ``.logits`` (N, T, V).
        input_ids: (N, T) right-padded prompt + response ids.
        attention_mask: (N, T) True on real tokens.
        loss_mask: (N, T) True on the tokens to score (response tokens).
        temperature: divide the logits by it (0 and 1: unchanged).
        with_entropy: also return per-position entropies.
        entropy_grad: let gradients flow through the entropies.
        fused_head: override :attr:`~alignlit.models.forward_settings.ForwardSettings.fused_head` (None: the settings in effect).
        packing: override :attr:`~alignlit.models.forward_settings.ForwardSettings.packing` (True, False or
            ``"auto"``; None: the settings in effect).

    Returns:
        :class:`TokenLogprobs` of shape (N, T - 1).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (N, T), got {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("loss_mask", loss_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != input_ids shape {tuple(input_ids.shape)}")
    temperature = check_temperature(temperature)
    options = {"temperature": temperature, "with_entropy": with_entropy, "entropy_grad": entropy_grad}
    labels, mask = input_ids[:, 1:], loss_mask[:, 1:].bool()  # (N, T-1)
    attention = attention_mask.bool()
    prompts = prompt_lengths(attention, loss_mask.bool())  # (N,)
    plan = plan_forward(
        model, fused_head=fused_head, packing=packing, layout=lambda: right_padding_reason(attention),
        saving=lambda: packing_saving(input_ids, attention, prompts),
    )  # fmt: skip
    if not plan.direct:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (N, T-1, V)
        return _result(logits_scored(logits, labels, mask, **options), mask)
    states = decoder_hidden(
        plan.backbone, plan.config, input_ids, attention_mask, position_ids=None,
        prompt_lengths=prompts if plan.packed else None,
    )  # fmt: skip
    predictor = torch.arange(labels.shape[1], device=input_ids.device).expand_as(
        labels
    )  # column t scores t + 1
    return _result(fused_scored(plan, states, predictor, labels, mask, **options), mask)


def token_nll(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    fused_head: bool | None = None,
    packing: bool | Literal["auto"] | None = None,
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


def _response_states(plan, input_ids, attention_mask, prompt_mask) -> HiddenStates:
    """The decoder's hidden states of ``[prompt ; response]`` (positions over real tokens), packed per plan."""
    return decoder_hidden(
        plan.backbone, plan.config, input_ids, attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        prompt_lengths=prompt_mask.long().sum(-1) if plan.packed else None,
    )  # fmt: skip


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
    packing: bool | Literal["auto"] | None = None,
) -> TokenLogprobs:
    """``log_softmax(logits / temperature)`` of each response token given the prompt and earlier tokens.

    One forward pass over ``[prompt ; response]`` (left-padded prompt, right-padded response): the
    logits at position ``P - 1 + t`` score response token ``t``. Positions are counted over real
    tokens (:func:`position_ids_from_mask`), so left padding does not shift them. Gradients flow
    when called outside ``torch.no_grad``. Temperature 0 (greedy) is scored as 1, the convention
    of :class:`~alignlit.rollout.base.Rollout`. The ``n`` samples of a prompt share its
    computation when packed (see :class:`~alignlit.models.forward_settings.ForwardSettings`); the
    values are the same.

    Args:
        model: causal LM returning ``.logits`` of shape (B, L, V).
        prompt_ids: (B, P) long, left-padded.
        prompt_mask: (B, P) 1/True on real prompt tokens.
        response_ids: (B, T) long, right-padded.
        response_mask: (B, T) 1/True on real response tokens.
        temperature: sampling temperature the response was drawn with (>= 0).
        with_entropy: also return per-token entropies.
        entropy_grad: let gradients flow through the entropies.
        fused_head: override :attr:`~alignlit.models.forward_settings.ForwardSettings.fused_head` (None: the settings in effect).
        packing: override :attr:`~alignlit.models.forward_settings.ForwardSettings.packing` (None: the settings in effect).

    Returns:
        :class:`TokenLogprobs` of shape (B, T), in float32 (float64 for a float64 model).
    """
    temperature = check_temperature(temperature)
    options = {"temperature": temperature, "with_entropy": with_entropy, "entropy_grad": entropy_grad}
    input_ids, attention_mask = concat_response(prompt_ids, prompt_mask, response_ids, response_mask)
    num_prompt, mask = prompt_ids.shape[1], response_mask.bool()
    predictor = response_predictor(num_prompt, response_ids)
    plan = plan_forward(
        model, fused_head=fused_head, packing=packing,
        layout=lambda: response_reason(attention_mask, predictor, mask),
        saving=lambda: packing_saving(input_ids, attention_mask, prompt_mask.long().sum(-1)),
    )  # fmt: skip
    if not plan.direct:
        logits = _response_position_logits(model, input_ids, attention_mask, num_prompt)  # (B, T, V)
        return _result(logits_scored(logits, response_ids, mask, **options), mask)
    states = _response_states(plan, input_ids, attention_mask, prompt_mask)
    return _result(fused_scored(plan, states, predictor, response_ids, mask, **options), mask)


def response_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """(B, T, V) the model's logits at the positions that predict each response token (column ``P - 1 + t``).

    The full-vocabulary scores that a divergence between two models needs (GKD's generalised JSD,
    :func:`~alignlit.losses.generalized_jsd_loss`), from the model's own forward: neither the fused head nor
    packing applies, and ``B·T·V`` floats are held, so keep the rows per call small at a large vocabulary.
    Gradients flow when called outside ``torch.no_grad``.
    """
    input_ids, attention_mask = concat_response(prompt_ids, prompt_mask, response_ids, response_mask)
    return _response_position_logits(model, input_ids, attention_mask, prompt_ids.shape[1])


def _response_position_logits(model, input_ids, attention_mask, num_prompt: int) -> torch.Tensor:
    """(B, T, V) logits of the model's own forward over ``[prompt ; response]`` at the columns ``P - 1 + t``
    that predict response token ``t``."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).logits[:, num_prompt - 1 : -1]


def scored_from_logits(
    logits: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> TokenLogprobs:
    """:class:`TokenLogprobs` of ``response_ids`` from :func:`response_logits`' (B, T, V) logits: the same
    values :func:`response_token_logprobs` gives, without a second forward."""
    mask = response_mask.bool()
    scored = logits_scored(
        logits, response_ids, mask, temperature=check_temperature(temperature),
        with_entropy=with_entropy, entropy_grad=entropy_grad,
    )  # fmt: skip
    return _result(scored, mask)


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


def response_values(
    critic: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    packing: bool | Literal["auto"] | None = None,
) -> torch.Tensor:
    """(B, T) critic values ``V(s_t)``: the head at the position that predicts response token ``t``.

    ``critic`` has ``values(input_ids, attention_mask) -> (B, L)`` (a decoder
    :class:`~alignlit.models.ScalarHeadModel`). 0 on padding. Packed like
    :func:`response_token_logprobs` when the backbone allows it (``packing``: override
    :attr:`~alignlit.models.forward_settings.ForwardSettings.packing`).
    """
    input_ids, attention_mask = concat_response(prompt_ids, prompt_mask, response_ids, response_mask)
    num_prompt, mask = prompt_ids.shape[1], response_mask.bool()
    predictor = response_predictor(num_prompt, response_ids)
    plan = plan_forward(
        critic, scalar=True, packing=packing, layout=lambda: response_reason(attention_mask, predictor, mask),
        saving=lambda: packing_saving(input_ids, attention_mask, prompt_mask.long().sum(-1)),
    )  # fmt: skip
    if not plan.direct:
        values = critic.values(input_ids, attention_mask)[:, num_prompt - 1 : -1]  # (B, T)
        return values * response_mask.to(values.dtype)
    states = _response_states(plan, input_ids, attention_mask, prompt_mask)
    rows, cols = mask.nonzero(as_tuple=True)  # (M,)
    values = plan.head(states.hidden[states.columns[rows, predictor[rows, cols]]]).squeeze(-1)  # (M,)
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def sequence_scores(
    scalar_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    packing: bool | Literal["auto"] | None = None,
) -> torch.Tensor:
    """(N,) score of each right-padded sequence: a scalar-head model read at its last real token.

    The same numbers as ``scalar_model(input_ids, attention_mask)``
    (:class:`~alignlit.models.ScalarHeadModel`), from a packed forward when the backbone allows it:
    with ``loss_mask`` (N, T) (True on response tokens), rows with the same prompt, such as the two
    rows of a preference pair, hold it once. ``packing`` overrides :attr:`~alignlit.models.forward_settings.ForwardSettings.packing`.
    """
    if loss_mask is not None and loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    attention = attention_mask.bool()
    scored = loss_mask.bool() if loss_mask is not None else torch.zeros_like(attention)
    prompts = prompt_lengths(attention, scored)  # (N,)
    plan = plan_forward(
        scalar_model, scalar=True, packing=packing, layout=lambda: scores_reason(attention),
        saving=lambda: packing_saving(input_ids, attention, prompts),
    )  # fmt: skip
    if not plan.packed:
        return scalar_model(input_ids, attention_mask)
    states = decoder_hidden(
        plan.backbone, plan.config, input_ids, attention, position_ids=None, prompt_lengths=prompts
    )
    last = attention.long().sum(-1) - 1  # (N,) right padding: the last real token's column
    flat = states.columns.gather(1, last[:, None]).squeeze(1)  # (N,)
    return plan.head(states.hidden[flat]).squeeze(-1)
