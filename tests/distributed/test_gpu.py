"""CUDA checks, run with ``pytest -m gpu`` on a machine with a CUDA device and a CUDA build of torch.

Without a CUDA device every test here is skipped with the reason (the ``nox`` sessions install the CPU
build of torch, so there they always skip, listed in the summary). They build tiny models from configs
(no downloads):

- SFT, DPO and PPO train a few steps under ``ModelParallelStrategy`` with ``bf16-mixed`` through
  tests/distributed/multiproc_fit.py (strategy ``cuda``): FSDP2 over 2 data-parallel ranks with 2 or more GPUs; with
  one GPU the same strategy on a 1 x 1 mesh, which shards nothing;
- the fused-head and packed log-probs equal the full logits' log-probs of a bfloat16 model on CUDA.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignlit.models import load_policy, make_tiny_llama
from alignlit.models.forward import response_token_logprobs, token_logprobs
from tests.conftest import TINY
from tests.distributed import multiproc_fit
from tests.models.test_forward import pair_batch, rollout_batch

NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

ROOT = Path(__file__).resolve().parents[2]
MULTIPROC_TINY = {**TINY, "num_heads": 2, "head_dim": 32}


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory, tokenizer):
    """SFT, DPO and PPO trained by one launch of tests/distributed/multiproc_fit.py with the ``cuda`` strategy."""
    root = tmp_path_factory.mktemp("gpu")
    multiproc_fit.write_inputs(
        root / "work", tokenizer, lambda seed: make_tiny_llama(tokenizer, seed=seed, **MULTIPROC_TINY)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, multiproc_fit.__file__, str(root / "work"), "cuda", str(root / "out"), "sft", "dpo", "ppo"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-6000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("stage, model", [("sft", "model"), ("dpo", "model"), ("ppo", "actor")])
def test_stage_trains_under_fsdp2_bf16_mixed_on_cuda(cuda_runs, stage, model):
    """A few AdamW steps at lr 1e-2 (SFT and DPO: 3 steps; PPO: 2 rollouts of 2 epochs) under bf16 autocast
    with float32 weights: every loss is finite (PPO's too: a non-finite loss stops the run), the SFT loss
    falls, every trained weight is finite and the policy moved by more than 5e-3 (an AdamW step moves a
    weight by about the learning rate); the exported directory loads and holds the trained weights."""
    out = cuda_runs / "out" / stage
    ranks = sorted(out.glob("rank-*.json"))
    assert ranks, f"{stage}: no rank wrote its state"
    weights = torch.load(out / "weights.pt", weights_only=True)
    assert all(bool(torch.isfinite(v).all()) for v in weights.values() if v.is_floating_point()), stage
    start = load_policy(cuda_runs / "work" / "policy")[0].state_dict()
    trained = {k.removeprefix(f"{model}."): v for k, v in weights.items() if k.startswith(f"{model}.")}
    common = sorted(set(trained) & set(start))
    assert common, f"{stage}: no weight of the starting policy among {sorted(trained)[:5]}"
    moved = max((trained[k].float() - start[k].float()).abs().max().item() for k in common)
    assert moved > 5e-3, f"{stage}: the policy moved by {moved:.2e} only"
    for path in ranks:
        state = json.loads(path.read_text())
        losses = state.get("losses", [])
        assert all(math.isfinite(x) for x in losses), f"{stage} {path.name}: losses {losses}"
        if stage == "sft":
            assert len(losses) == multiproc_fit.STEPS and losses[-1] < losses[0], losses
        if stage == "ppo":
            assert (
                math.isfinite(state["kl_coef"])
                and state["moments"]["count"] == 2 * multiproc_fit.GLOBAL_BATCH
            )
    exported, _ = load_policy(out / "export")
    for name, value in exported.state_dict().items():
        if name in trained:
            torch.testing.assert_close(value.float(), trained[name].float(), rtol=0, atol=0, msg=name)


# the tiny model's final norm is scaled by 4 so that its next-token distributions are peaked: log-probs
# spread over several nats (a misaligned token or row would be off by about one), logits up to about 3
NORM_SCALE = 4.0
BF16_ATOL = 0.05
"""Tolerance on log-probs: rounding a logit of magnitude <= 3 to bfloat16 (8 significant bits, relative
error <= 2^-8) moves it by <= 0.012 and ``log p = z_y - logsumexp(z)`` by <= 0.024; doubled for the
decoder's bfloat16 hidden states, which the packed path computes with other attention kernels."""


def _bf16_cuda_model(tokenizer) -> torch.nn.Module:
    model = make_tiny_llama(tokenizer, seed=0, **TINY)
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_SCALE)
    return model.to("cuda", torch.bfloat16).eval()


@torch.no_grad()
def test_fused_and_packed_logprobs_match_full_logits_in_bf16_on_cuda(tokenizer):
    """Preference rows (token_logprobs) and rollout rows sharing prompts (response_token_logprobs) of a
    bfloat16 model on CUDA: the fused-head and packed paths give the log-probs of the model's own full
    logits within ``BF16_ATOL`` (mean difference < 0.01), and all of them the float32 model's within it."""
    model = _bf16_cuda_model(tokenizer)
    reference = make_tiny_llama(tokenizer, seed=0, **TINY)
    reference.model.norm.weight.mul_(NORM_SCALE)
    reference = reference.to("cuda").eval()
    pairs = [t.cuda() for t in pair_batch()]
    rollouts = [t.cuda() for t in rollout_batch()]
    for name, fn, batch in (("token_logprobs", token_logprobs, pairs), ("response_token_logprobs", response_token_logprobs, rollouts)):  # fmt: skip
        full = fn(model, *batch, fused_head=False)
        exact = fn(reference, *batch, fused_head=False)
        mask = full.mask
        spread = (exact.logprobs[mask].max() - exact.logprobs[mask].min()).item()
        assert spread > 1.0, f"{name}: log-probs spread over {spread:.2f} nats only"
        for path in ({"fused_head": True, "packing": False}, {"fused_head": True, "packing": True}):
            fast = fn(model, *batch, **path)
            assert torch.equal(fast.mask, mask) and fast.logprobs.dtype == torch.float32
            diff = (fast.logprobs - full.logprobs)[mask].abs()
            assert diff.max().item() <= BF16_ATOL and diff.mean().item() < 0.01, (
                name,
                path,
                diff.max().item(),
            )
            worst = (fast.logprobs - exact.logprobs)[mask].abs().max().item()
            assert worst <= BF16_ATOL, (name, path, worst)
        assert (full.logprobs - exact.logprobs)[mask].abs().max().item() <= BF16_ATOL, name
