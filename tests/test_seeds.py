"""``seed_everything`` reaches every seeded choice of a run: the rollout loop's, the DataModule's and the
prompt filter's seeds default to it (``alignlit.data.args.resolve_seed``), so two runs that differ only in
``seed_everything`` differ, and two with the same one are equal."""

from __future__ import annotations

import json

import lightning as L
import torch

from alignlit.data import PreferenceDataModule, PromptDataModule
from alignlit.data.args import resolve_seed
from alignlit.modules import PolicyGradientModule
from alignlit.modules.trajectory import Minibatches
from alignlit.rollout import RolloutLoop, SamplingParams
from alignlit.rollout.prompt_filter import PromptFilter

PROMPTS = [f"\n\nHuman: sort {'abcdefgh'[i % 8]} {'abcdefgh'[(i + 3) % 8]}\n\nAssistant:" for i in range(8)]


def test_resolve_seed():
    assert resolve_seed(5) == 5 and resolve_seed(None) == 0
    L.seed_everything(7, verbose=False)
    assert resolve_seed(None) == 7 and resolve_seed(0) == 0


def test_defaults_follow_seed_everything(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert RolloutLoop().seed == 0 and PromptFilter().seed == 0
    L.seed_everything(11, verbose=False)
    assert RolloutLoop().seed == 11 and PromptFilter().seed == 11
    assert PromptDataModule(train_file=str(tmp_path / "p.jsonl")).hparams.seed == 11
    assert PreferenceDataModule(train_file=str(tmp_path / "p.jsonl")).hparams.seed == 11  # a subclass's frame
    assert RolloutLoop(seed=3).seed == 3 and PromptFilter(seed=3).seed == 3


def char_reward(prompts, responses):
    return [r.count("a") - 0.1 * len(r) for r in responses]


def fit_once(tiny_policy_dir, tmp_path, seed: int) -> dict[str, torch.Tensor]:
    """One GRPO rollout (2 prompts × 4 samples) after ``seed_everything(seed)``; the trained weights."""
    L.seed_everything(seed, verbose=False)
    module = PolicyGradientModule(
        policy=str(tiny_policy_dir),
        reward=char_reward,
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=6), samples_per_prompt=4),
        minibatches=Minibatches(size=8),
    )
    tmp_path.mkdir()
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(
        module, PromptDataModule(train_file=str(tmp_path / "p.jsonl"), val_fraction=0.25, batch_size=2)
    )
    return {k: v.clone() for k, v in module.policy.state_dict().items()}


def test_runs_differ_only_by_seed_everything(tiny_policy_dir, tmp_path):
    a = fit_once(tiny_policy_dir, tmp_path / "a", 1)
    b = fit_once(tiny_policy_dir, tmp_path / "b", 1)
    c = fit_once(tiny_policy_dir, tmp_path / "c", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-6
