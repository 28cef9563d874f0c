"""Teacher-forced log-probabilities of sampled responses under a causal LM.

This is the trainer's side of every rollout: the same numbers an engine reports for the tokens it
sampled, recomputed by one forward pass over ``prompt + response``. PPO's old/reference log-probs,
DPO/RRHF sequence log-probs and the engine parity check all go through :func:`response_logprobs`.
"""

from __future__ import annotations

import torch

from alignlit.ops.logprobs import gather_logprobs


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


def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` of each response token given the prompt and earlier tokens.

    One forward pass over ``[prompt ; response]`` (left-padded prompt, right-padded response): the
    logits at position ``P - 1 + t`` score response token ``t``. Positions are counted over real
    tokens (:func:`position_ids_from_mask`), so left padding does not shift them. Gradients flow
    when called outside ``torch.no_grad``. Temperature 0 (greedy) is treated as 1, the convention
    of :class:`~alignlit.rollout.base.Rollout`.

    Args:
        model: causal LM returning ``.logits`` of shape (B, L, V).
        prompt_ids: (B, P) long, left-padded.
        prompt_mask: (B, P) 1/True on real prompt tokens.
        response_ids: (B, T) long, right-padded.
        response_mask: (B, T) 1/True on real response tokens.
        temperature: sampling temperature the response was drawn with (>= 0).

    Returns:
        (B, T) log-probs in float32 (float64 for a float64 model), 0 where ``response_mask`` is 0.
    """
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
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scale = 1.0 if temperature == 0 else float(temperature)

    num_prompt = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P + T)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)  # (B, P + T)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).logits  # (B, P + T, V)
    scored = logits[:, num_prompt - 1 : -1]  # (B, T, V): position P-1+t predicts response token t
    if scale != 1.0:
        scored = scored / scale
    logps = gather_logprobs(scored, response_ids)  # (B, T)
    return logps * response_mask.to(logps.dtype)
