"""Optim: torch's fused AdamW by default where it applies, the same updates as the per-parameter loop."""

from __future__ import annotations

import torch

from alignlit.modules.base import Optim, fusable


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(optim: Optim, steps: int = 5) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(0)
    built = optim.build(model.parameters(), total_steps=steps)
    optimizer, scheduler = built["optimizer"], built["lr_scheduler"]["scheduler"]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer


def test_fused_adamw_is_the_default_on_plain_cpu_parameters_and_can_be_turned_off():
    assert _train(Optim())[1].defaults["fused"] is True
    assert _train(Optim(fused=False))[1].defaults["fused"] is None  # torch's own choice
    assert _train(Optim(fused=True))[1].defaults["fused"] is True


def test_fused_and_loop_adamw_give_the_same_weights():
    """5 AdamW steps with weight decay and a warmup/cosine schedule: the fused kernel and torch's
    per-parameter loop (the independent reference) agree to float32 rounding."""
    optim = dict(lr=1e-2, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.1)
    fused, _ = _train(Optim(**optim, fused=True))
    loop, _ = _train(Optim(**optim, fused=False))
    start = _model(0)
    for a, b, s in zip(fused.parameters(), loop.parameters(), start.parameters()):
        assert (a - s).abs().max() > 1e-3  # the weights moved
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fusable_needs_plain_floating_tensors():
    w = torch.nn.Parameter(torch.ones(2))
    assert fusable([w]) and fusable([{"params": [w]}])
    assert not fusable([])
    assert not fusable([torch.ones(2, dtype=torch.long)])
    assert not fusable([w, torch.ones(2, device="meta")])
