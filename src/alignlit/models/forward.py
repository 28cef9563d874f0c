"""Teacher-forced forward passes every stage shares.

- :func:`token_logprobs`: log-probs (and entropies) of the loss-masked tokens of right-padded
  ``prompt + response`` rows (SFT/DPO/RRHF batches, DPO's reference cache);
- :func:`response_logprobs` / :func:`response_token_logprobs`: log-probs (and entropies) of sampled
  responses given left-padded prompts (rollouts: old/reference log-probs, PPO and policy-gradient
  losses, the engine parity check);
- :func:`response_values`: per-token critic values ``V(s_t)`` of sampled responses;
- :func:`disable_dropout` and :func:`eval_mode`: the log-prob ratios of RL stages need the same
  function at sampling and training time, so dropout is off for them.

Every function here is public: research code computes the same quantities the stages do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from alignlit.ops.logprobs import entropy_from_logits, gather_logprobs


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
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature not in (0.0, 1.0):  # 0 (greedy) scores as T = 1, the Rollout convention
        logits = logits / float(temperature)
    weights = mask.to(torch.promote_types(logits.dtype, torch.float32))
    logprobs = gather_logprobs(logits, labels.masked_fill(~mask, 0)) * weights  # (N, L)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach()) * weights  # (N, L)
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
) -> TokenLogprobs:
    """Teacher-forced log-probs of the loss-masked tokens of right-padded sequences.

    Position ``t`` of the result scores token ``t + 1`` of the input: the result has ``T - 1``
    columns, and its mask is ``loss_mask[:, 1:]``.

    Args:
        model: causal LM returning ``.logits`` (N, T, V).
        input_ids: (N, T) right-padded prompt + response ids.
        attention_mask: (N, T) True on real tokens.
        loss_mask: (N, T) True on the tokens to score (response tokens).
        temperature: divide the logits by it (0 and 1: unchanged).
        with_entropy: also return per-position entropies.
        entropy_grad: let gradients flow through the entropies.

    Returns:
        :class:`TokenLogprobs` of shape (N, T - 1).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (N, T), got {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("loss_mask", loss_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != input_ids shape {tuple(input_ids.shape)}")
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (N, T-1, V)
    return _scored(
        logits,
        input_ids[:, 1:],
        loss_mask[:, 1:].bool(),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )


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
) -> TokenLogprobs:
    """``log_softmax(logits / temperature)`` of each response token given the prompt and earlier tokens.

    One forward pass over ``[prompt ; response]`` (left-padded prompt, right-padded response): the
    logits at position ``P - 1 + t`` score response token ``t``. Positions are counted over real
    tokens (:func:`position_ids_from_mask`), so left padding does not shift them. Gradients flow
    when called outside ``torch.no_grad``. Temperature 0 (greedy) is scored as 1, the convention
    of :class:`~alignlit.rollout.base.Rollout`.

    Args:
        model: causal LM returning ``.logits`` of shape (B, L, V).
        prompt_ids: (B, P) long, left-padded.
        prompt_mask: (B, P) 1/True on real prompt tokens.
        response_ids: (B, T) long, right-padded.
        response_mask: (B, T) 1/True on real response tokens.
        temperature: sampling temperature the response was drawn with (>= 0).
        with_entropy: also return per-token entropies.
        entropy_grad: let gradients flow through the entropies.

    Returns:
        :class:`TokenLogprobs` of shape (B, T), in float32 (float64 for a float64 model).
    """
    input_ids, attention_mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    num_prompt = prompt_ids.shape[1]
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).logits[:, num_prompt - 1 : -1]  # (B, T, V): position P-1+t predicts response token t
    return _scored(
        logits,
        response_ids,
        response_mask.bool(),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )


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
) -> torch.Tensor:
    """(B, T) critic values ``V(s_t)``: the head at the position that predicts response token ``t``.

    ``critic`` has ``values(input_ids, attention_mask) -> (B, L)`` (a decoder
    :class:`~alignlit.models.ScalarHeadModel`). 0 on padding.
    """
    input_ids, attention_mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    num_prompt = prompt_ids.shape[1]
    values = critic.values(input_ids, attention_mask)[:, num_prompt - 1 : -1]  # (B, T)
    return values * response_mask.to(values.dtype)


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
