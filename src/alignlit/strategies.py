"""Data and tensor parallelism for alignlit stages.

Pick a strategy per stage in its YAML (or stack a preset: ``alignlit fit --config stage.yaml --config
configs/strategies/tp2.yaml``):

- ``strategy: ddp`` — data parallel, CPU (gloo) or GPU (NCCL); alignlit's DataModules shard their own
  data per rank (``use_distributed_sampler`` is off by default in ``alignlit``).
- ``strategy: fsdp`` — Lightning's FSDP (GPU only: Lightning refuses it on CPU).
- ``lightning.pytorch.strategies.ModelParallelStrategy`` — FSDP2 over the ``data_parallel`` mesh
  dimension and torch-native DTensor tensor parallel over ``tensor_parallel``; runs on CPU with gloo
  too. Each stage's ``configure_model`` calls :func:`parallelize_causal_lm` on the models it trains.

Tensor parallel is torch-native (``torch.distributed.tensor.parallel``), not fairscale: fairscale has
had no release since 2022, its FSDP crashes on CPU, and Lightning dropped it in 2.0.
"""

from __future__ import annotations

import torch
from torch import nn

from alignlit.models.hf_internals import mark_fsdp_managed


def _decoder_layers(model: nn.Module):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(model).__name__}: tensor/FSDP2 parallelism supports Llama-family decoders "
            "(model.model.layers with self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj)"
        )
    return layers


def _tensor_parallel_plan(layer: nn.Module, styles: dict[str, str]) -> dict:
    """The DTensor plan of one decoder layer: ``styles`` maps each projection to ``colwise`` or
    ``rowwise``; a projection with a LoRA adapter gets its base layer and one adapter factor sharded."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for path, style in styles.items():
        module = layer.get_submodule(path)
        base = getattr(module, "base_layer", None)
        if base is None:
            plan[path] = make[style]()
            continue
        adapters = module.lora_A if style == "rowwise" else module.lora_B
        plan[f"{path}.base_layer"] = make[style]()
        for name in adapters:
            plan[f"{path}.{'lora_A' if style == 'rowwise' else 'lora_B'}.{name}"] = make[style]()
    return plan


def parallelize_causal_lm(
    model: nn.Module, device_mesh, *, reshard_after_forward: bool | None = None
) -> nn.Module:
    """Shard a Llama-family model in place over a 2-D mesh (``data_parallel``, ``tensor_parallel``).

    Tensor parallel (Megatron layout): q/k/v and gate/up projections column-wise, o and down
    projections row-wise, so each block needs one all-reduce after attention and one after the MLP;
    embeddings, norms and the output head stay replicated. A projection with a LoRA adapter
    (:mod:`alignlit.models.lora`) is split the same way: a column-wise one shards its base weight and
    ``B`` by output rows (``A`` replicated), a row-wise one its base weight and ``A`` by input columns
    (``B`` replicated, after the all-reduce of ``A x``). Then FSDP2 ``fully_shard`` on every decoder
    layer and the root over the data-parallel dimension (frozen base and trainable adapter weights
    share the units; the decoder and the heads are units of their own, since they are also called
    apart from the model). Works for ``…ForCausalLM`` and ``…ForSequenceClassification`` (reward model,
    critic). ``reshard_after_forward`` is FSDP2's (None: its default, the root keeps its weights
    gathered until the backward pass); frozen models, which have no backward pass, take True.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    layers = _decoder_layers(model)
    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    tp = tp_mesh.size()
    if tp > 1:
        cfg = model.config
        for name, value in (
            ("num_attention_heads", cfg.num_attention_heads),
            ("num_key_value_heads", cfg.num_key_value_heads),
            ("intermediate_size", cfg.intermediate_size),
        ):
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide the model's {name}={value}")
        styles = {
            "self_attn.q_proj": "colwise",
            "self_attn.k_proj": "colwise",
            "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_proj": "colwise",
            "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        }
        for layer in layers:
            parallelize_module(layer, tp_mesh, _tensor_parallel_plan(layer, styles))
    if dp_mesh.size() > 1:
        shard = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
        for layer in layers:
            fully_shard(layer, **shard)
        # the decoder and the heads are called on their own (ScalarHeadModel.values, the fused LM head),
        # so each is a unit of its own: its parameters are gathered whenever it runs
        tied = getattr(model.config, "tie_word_embeddings", False)
        heads = [
            getattr(model, name, None)
            for name in (("score", "classifier") if tied else ("score", "classifier", "lm_head"))
        ]
        for part in (model.model, *heads):
            if isinstance(part, nn.Module) and any(True for _ in part.parameters()):
                fully_shard(part, **shard)
        fully_shard(model, **shard)
        mark_fsdp_managed(model)  # `generate` keeps every rank stepping (synced_gpus)
    return model


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Global gradient-norm clipping that works when some gradients are DTensors (tensor parallel /
    FSDP2) and others plain tensors, which ``torch.nn.utils.clip_grad_norm_`` refuses to mix.

    Each gradient's norm is taken over its full (unsharded) value, so the result equals the norm of
    the unsharded model's gradients. Returns the total norm before clipping.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    squares = []
    for g in grads:
        norm = g.norm(2)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype) if not isinstance(g, DTensor) else coef.item())
    return total
