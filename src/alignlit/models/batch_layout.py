"""The column layouts of the batches the forward functions of :mod:`alignlit.models.forward` take.

Two layouts: right-padded ``prompt + response`` rows (SFT, preference and reward batches), and a
left-padded prompt next to a right-padded response (rollouts), joined by :func:`concat_response`.
Here too: which input column predicts each response token (:func:`response_predictor`), and the
reasons a batch cannot be packed, which :func:`~alignlit.models.dispatch.plan_forward` is given.
"""

from __future__ import annotations

import torch


def concat_response(
    prompt_ids, prompt_mask, response_ids, response_mask
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` (B, P + T) of ``[prompt ; response]``, after checking the shapes."""
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


def response_predictor(num_prompt: int, response_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) the input column of ``[prompt ; response]`` that predicts each response token: ``P - 1 + t``."""
    steps = response_ids.shape[1]
    return (num_prompt - 1 + torch.arange(steps, device=response_ids.device)).expand(
        response_ids.shape[0], steps
    )


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def right_padding_reason(attention_mask: torch.Tensor) -> str | None:
    """Why rows cannot be packed as right-padded rows (None: they can)."""
    return None if is_right_padded(attention_mask) else "the rows are not right-padded"


def scores_reason(attention_mask: torch.Tensor) -> str | None:
    """Why rows cannot be packed to read each one's last real token (None: they can)."""
    if not bool(attention_mask.bool().any(-1).all()):
        return "a row has no real token"
    return right_padding_reason(attention_mask)


def response_reason(attention_mask: torch.Tensor, predictor: torch.Tensor, mask: torch.Tensor) -> str | None:
    """Why ``[prompt ; response]`` rows cannot be packed (None: they can).

    The last prompt column predicts response token 0; a response token after a padded one would
    be scored from a padding column, which a packed forward does not hold: keep padded rows then.
    """
    if bool((attention_mask.bool().gather(1, predictor) | ~mask).all()):
        return None
    return "a response token follows a padding token"
