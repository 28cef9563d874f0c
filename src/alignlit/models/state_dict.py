"""The one gatherer of a model's full state dict: DTensor shards (FSDP2, tensor parallel) made whole, and a
LoRA adapter merged into its weights on request. Exports, weight syncs to rollout engines and the weight
snapshots of asynchronous rollouts all read a policy's weights through :func:`full_state_dict`."""

from __future__ import annotations

import torch
from torch import nn


def full_state_dict(
    model: nn.Module, device: torch.device | str | None = "cpu", *, merge_lora: bool = False
) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a possibly DTensor-sharded ``model``, detached, on ``device`` (None: where
    each tensor is). A collective when the model is sharded: every rank must call it. Plain tensors pass
    through.

    With ``merge_lora``, a model with a LoRA adapter gives its merged weights under the base model's (the
    checkpoint's) names (:func:`alignlit.models.lora.merged_state_dict`); a model without one its plain
    state dict.
    """
    from alignlit.models.lora import has_lora, merged_state_dict

    if merge_lora and has_lora(model):
        state = merged_state_dict(model)
    else:
        state = {k: v.full_tensor() if _is_dtensor(v) else v for k, v in model.state_dict().items()}
    return {k: v.detach() if device is None else v.detach().to(device) for k, v in state.items()}


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
