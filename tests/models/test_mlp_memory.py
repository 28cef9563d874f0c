"""Gated MLPs recompute ``act_fn(gate)`` and the product instead of keeping them (models/mlp_memory.py): the
gradients are the same bits as the stock model's, the forward keeps exactly two (tokens × intermediate)
float32 tensors per layer less (hand-computed, measured by the profiler's allocations), and nothing changes
when it is off, without gradients, under gradient checkpointing, or on an MLP computing something else."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from alignlit.models import load_policy
from alignlit.models.forward import response_logprobs
from alignlit.models.forward_settings import use_forward_settings
from alignlit.models.lora import LoRA, apply_lora
from alignlit.models.mlp_memory import recompute_mlp_activations

LAYERS, HIDDEN, INTERMEDIATE, ROWS, LENGTH = 2, 32, 96, 3, 50
CONFIG = dict(
    vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def pair(cls, config):
    torch.manual_seed(0)
    stock = cls(config)
    hooked = copy.deepcopy(stock)
    assert recompute_mlp_activations(hooked) == LAYERS
    return stock, hooked


def loss_of(model, ids):
    return model(input_ids=ids).logits.logsumexp(-1).sum()


def grads(model):
    return [p.grad for p in model.parameters()]


def kept_bytes(model, ids) -> int:
    """Bytes the forward allocated and did not free: what it keeps for the backward pass (and the loss)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = loss_of(model, ids)
    del loss
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize(
    "cls, config", [(Qwen2ForCausalLM, Qwen2Config(**CONFIG)), (LlamaForCausalLM, LlamaConfig(**CONFIG))]
)
def test_same_gradients_two_tensors_per_layer_less(cls, config):
    stock, hooked = pair(cls, config)
    ids = torch.randint(0, 64, (ROWS, LENGTH))
    loss_of(stock, ids).backward()
    loss_of(hooked, ids).backward()
    for a, b in zip(grads(stock), grads(hooked), strict=True):
        assert torch.equal(a, b)
    saved = kept_bytes(stock, ids) - kept_bytes(hooked, ids)
    assert saved == LAYERS * 2 * ROWS * LENGTH * INTERMEDIATE * 4  # act_fn(g) and act_fn(g) * u, float32
    with use_forward_settings(recompute_mlp=False):
        assert kept_bytes(hooked, ids) == kept_bytes(stock, ids)


def test_nothing_without_gradients_or_under_checkpointing():
    stock, hooked = pair(Qwen2ForCausalLM, Qwen2Config(**CONFIG))
    ids = torch.randint(0, 64, (ROWS, LENGTH))
    with torch.no_grad():
        assert torch.equal(loss_of(stock, ids), loss_of(hooked, ids))
    for model in (stock, hooked):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    assert kept_bytes(hooked, ids) == kept_bytes(stock, ids)  # checkpointing keeps layer inputs only
    loss_of(stock, ids).backward()
    loss_of(hooked, ids).backward()
    for a, b in zip(grads(stock), grads(hooked), strict=True):
        assert torch.equal(a, b)


def test_the_forward_functions_packed_and_with_lora(tiny_policy_dir):
    """alignlit's packed forward (a view of the product reaches down_proj's matmul) and a LoRA adapter on
    every projection: the same gradients as the stock model."""
    stock, tokenizer = load_policy(tiny_policy_dir)
    lora = LoRA(rank=4, alpha=8)  # every projection
    hooked = copy.deepcopy(stock)
    recompute_mlp_activations(hooked)
    apply_lora(stock, lora)
    apply_lora(hooked, lora)
    for name, p in hooked.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # nonzero adapters (B starts at 0)
    stock.load_state_dict(hooked.state_dict())
    prompt = tokenizer(["a b c d", "a b c d"], return_tensors="pt")  # one prompt, two responses
    response = torch.randint(5, 300, (2, 7))
    args = (prompt.input_ids, prompt.attention_mask.bool(), response, torch.ones_like(response).bool())
    kept = []
    for model in (stock, hooked):
        with use_forward_settings(packing=True):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                logprobs = response_logprobs(model, *args)
            kept.append(sum(e.self_cpu_memory_usage for e in prof.events()))
            logprobs.sum().backward()
    tokens = prompt.input_ids.shape[1] + 2 * 7  # packed: the shared prompt once, then both responses
    # two layers, intermediate 128 (conftest.TINY); the first forward of a model allocates a few bytes more
    assert kept[0] - kept[1] == pytest.approx(2 * 2 * tokens * 128 * 4, abs=64)
    hooks = [m._alignlit_mlp_hooks for m in hooked.modules() if hasattr(m, "_alignlit_mlp_hooks")]
    assert len(hooks) == 2 and not any(h.disabled for h in hooks)
    named = dict(stock.named_parameters())
    trained = [(n, p) for n, p in hooked.named_parameters() if p.requires_grad]
    assert trained
    for n, p in trained:
        assert torch.equal(p.grad, named[n].grad), n


class ScaledMLP(nn.Module):
    """A gated MLP with the Llama names that computes something else: 2 · act(gate) · up."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(2 * self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_an_mlp_computing_something_else_keeps_its_tensors():
    torch.manual_seed(0)
    stock = ScaledMLP()
    hooked = copy.deepcopy(stock)
    recompute_mlp_activations(hooked)
    x = torch.randn(5, 4)
    stock(x).square().sum().backward()
    with pytest.warns(UserWarning, match="ScaledMLP does not compute"):
        hooked(x).square().sum().backward()
    for a, b in zip(stock.parameters(), hooked.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert hooked._alignlit_mlp_hooks.disabled


def test_only_the_product_is_marked_when_down_proj_runs():
    """The first forward's check calls ``act_fn`` again (without gradients): that call's output must not be
    marked. It is freed at once, and a tensor ``down_proj`` saves next (its autocast weight copy) could
    take its memory and be swapped for the wrong recipe, which corrupted the first step's gradients under
    bf16 autocast on CPUs where the allocator reused that block."""
    _, hooked = pair(LlamaForCausalLM, LlamaConfig(**CONFIG))
    seen = []

    def after_ours(module, args):  # registered after the hooks' own down_proj pre-hook
        hooks = mlp._alignlit_mlp_hooks
        seen.append((set(hooks.marks), args[0].untyped_storage().data_ptr()))

    mlp = hooked.model.layers[0].mlp
    mlp.down_proj.register_forward_pre_hook(after_ours)
    ids = torch.randint(0, 64, (ROWS, LENGTH))
    for _ in range(2):  # the first forward checks the formula, the second does not
        loss_of(hooked, ids).backward()
    assert [marks for marks, _ in seen] == [{h} for _, h in seen]


def test_same_gradients_under_bf16_autocast():
    stock, hooked = pair(LlamaForCausalLM, LlamaConfig(**CONFIG))
    ids = torch.randint(0, 64, (ROWS, LENGTH))
    for model in (stock, hooked):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(model, ids)
            loss.backward()
    for a, b in zip(grads(stock), grads(hooked), strict=True):
        assert torch.equal(a, b)
