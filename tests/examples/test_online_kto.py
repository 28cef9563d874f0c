"""examples/online_kto.py, a stage written outside the package on the public online base: its loss against
an independent per-sample computation, and a fit on the simulated task with only public methods used."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from alignlit.data import PromptDataModule, SFTDataModule
from alignlit.models import TinyLlama
from alignlit.modules import Minibatches, Optim, SFTModule
from alignlit.rollout import Experience, RolloutLoop, SamplingParams
from alignlit.sim import SimGoldReward
from alignlit.sim.data import make_data, write_tokenizer
from tests.conftest import TINY

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "online_kto.py"


def load_example():
    spec = importlib.util.spec_from_file_location("online_kto", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """A small simulated task with its tokenizer and a tiny policy fine-tuned for 60 steps on its
    demonstrations (a random policy's answers all have the same gold reward: nothing to label)."""
    d = tmp_path_factory.mktemp("kto_sim")
    make_data(d, seed=0, n_sft=300, n_pairs=10, n_prompts=24, n_val=8, n_test=8)
    write_tokenizer(str(d), vocab_size=300)
    sft = SFTModule(policy=TinyLlama(tokenizer=str(d / "tokenizer"), **TINY), optim=Optim(lr=3e-3, warmup_steps=5),
                    export_dir=str(d / "policy"))  # fmt: skip
    trainer = L.Trainer(
        max_steps=60, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=d,
    )  # fmt: skip
    trainer.fit(sft, SFTDataModule(str(d / "sft_train.jsonl"), batch_size=16, val_fraction=0.0, seed=0))
    return d


def make_module(sim, **kwargs):
    kto = load_example()
    return kto.OnlineKTOModule(
        policy=str(sim / "policy"), reward=SimGoldReward(str(sim)), beta=0.5, desirable_weight=1.0,
        undesirable_weight=2.0, rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=6), samples_per_prompt=4),
        minibatches=Minibatches(size=8), **kwargs,
    )  # fmt: skip


def test_example_uses_no_private_name():
    """The extension story: nothing of alignlit's that starts with an underscore, and under ~60 lines."""
    tree = ast.parse(EXAMPLE.read_text())
    private = [
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.endswith("__")
    ]
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert private == [] and not any(name.startswith("_") for name in imported)
    assert len(EXAMPLE.read_text().splitlines()) <= 65


def test_kto_loss_against_a_per_sample_computation(sim):
    """Rewards [1, 0, 0.5, 0.5] in one group (mean 0.5): sample 0 desirable, 1 undesirable, 2 and 3 tied
    and left out. With r_j = Σ_t (log π_θ - log π_ref) from an unpadded forward of each sample and z the
    rollout's KL: L = mean(1·(1 - σ(0.5(r_0 - z))), 2·(1 - σ(0.5(z - r_1))))."""
    module = make_module(sim)
    module.rollout.setup(module.policy, module.tokenizer)
    prompts = [json.loads(line)["prompt"] for line in (sim / "prompts_train.jsonl").read_text().splitlines()]
    exp = module.rollout.collect(prompts[:1], module.reward)
    exp = Experience(exp.rollout, torch.tensor([1.0, 0.0, 0.5, 0.5]))
    trajectory, _ = module.make_trajectory(exp)
    with torch.no_grad():  # the policy moves away from the reference, so r is not 0
        for p in module.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))

    captured = {}
    kto_loss = module.kto_loss

    def capture(mb, z):
        loss, metrics = kto_loss(mb, z)
        captured.update(loss=loss.detach(), z=float(z), rows=mb.texts)
        return loss, metrics

    module.kto_loss = capture
    module.update = lambda name, loss: torch.tensor(0.0)  # no optimiser outside a trainer
    metrics = module.train_on(trajectory)
    r = exp.rollout

    def implied(j: int) -> float:
        prompt, response = r.prompt_ids[j][r.prompt_mask[j]], r.response_ids[j][r.response_mask[j]]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            lp = module.policy(input_ids=ids).logits[0].log_softmax(-1)
            lr = module.reference(input_ids=ids).logits[0].log_softmax(-1)
        start, tokens = len(prompt), ids[0, len(prompt) :, None]
        return (lp[start - 1 : -1].gather(-1, tokens) - lr[start - 1 : -1].gather(-1, tokens)).sum().item()

    z = captured["z"]
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = (1 - sig(0.5 * (implied(0) - z)) + 2 * (1 - sig(0.5 * (z - implied(1))))) / 2
    assert sorted(captured["rows"]) == sorted([r.texts[0], r.texts[1]])
    assert captured["loss"].item() == pytest.approx(expected, abs=1e-5)
    assert abs(implied(0)) > 1e-3 and metrics["kto/desirable"] == 0.5


def test_fit_on_the_simulated_task(sim, tmp_path):
    """Two rollouts of 4 prompts x 4 samples through a plain Trainer: the stage trains (optimiser steps,
    its metrics logged), the base's trajectory gave it reference log-probs, and the policy moved."""
    module = make_module(sim, gold=SimGoldReward(str(sim)))
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    data = PromptDataModule(
        train_file=str(sim / "prompts_train.jsonl"), val_file=str(sim / "prompts_val.jsonl"), batch_size=4
    )
    trainer.fit(module, data)
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert len(train) == 2 and trainer.global_step >= 1
    assert all("kto/loss" in h or h.get("rollout/skipped") == 1.0 for h in train)
    assert any("kto/loss" in h for h in train) and any("val/gold" in h for h in module.progress.history)
    assert not all(torch.equal(v, before[k]) for k, v in module.policy.state_dict().items())
