"""Guards of the online stages: each case failed (silently) on main before the fix it names, and passes
after.

- the prompt filter's kept prompts are saved in the checkpoint: a resume trains on them, it does not run
  the filter again with the trained weights (which kept other prompts);
- prompts that leave too few of the policy's positions for ``max_new_tokens`` are refused at the start of
  fit, naming the prompt and the fix (transformers only warned, then indexed past its position table);
- online RRHF with one sample per prompt and nothing else to rank is refused (its ranking loss was 0);
- a run that trained nothing (every rollout skipped) ends with a summary line and a warning, not a silent
  exit 0 with the starting policy exported.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from alignlit.data import PromptDataModule
from alignlit.models import export_pretrained, make_tiny_llama
from alignlit.modules import Minibatches, OnlineRRHFModule, Optim, PolicyGradientModule
from alignlit.ops import DynamicSampling
from alignlit.rollout import PromptFilter, RolloutLoop, SamplingParams
from tests.conftest import TINY

PROMPTS = [f"\n\nHuman: {op} a b c\n\nAssistant:" for op in ("sort", "reverse", "copy", "dedupe")] * 2


def copy_constant(prompts, responses):
    """Constant on 'copy' prompts (zero variance: the filter drops them), the length elsewhere."""
    return [1.0 if "copy" in p else float(len(r)) for p, r in zip(prompts, responses)]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("online_guards") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def trainer(root, **kwargs):
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, default_root_dir=root, **kwargs)  # fmt: skip


def grpo(policy_dir, **kwargs):
    return PolicyGradientModule(
        policy=str(policy_dir), reward=copy_constant, optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=4), samples_per_prompt=2),
        minibatches=Minibatches(size=4), **kwargs,
    )  # fmt: skip


def test_a_resume_trains_on_the_prompts_the_filter_kept(tiny_policy_dir, prompts_file, tmp_path, monkeypatch):
    """Two rollouts, a checkpoint after the first; the resume must not run the filter again (here it would
    fail), and the loader's prompts are the ones kept at the start."""
    module = grpo(tiny_policy_dir, prompt_filter=PromptFilter(k=2, epsilon=1e-9, seed=0))
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1,
                                                     save_top_k=-1, save_last=False)  # fmt: skip
    dm = PromptDataModule(train_file=str(prompts_file), batch_size=2)
    trainer(tmp_path / "a", max_epochs=1, limit_train_batches=2, callbacks=[checkpoint]).fit(module, dm)
    kept = list(module.prompts.kept)
    assert kept and not any("copy" in p for p in kept)
    first = min((tmp_path / "ckpt").iterdir())
    assert torch.load(first, weights_only=True)["policy_gradient_state"]["prompts"]["kept"] == kept

    resumed = grpo(tiny_policy_dir, prompt_filter=PromptFilter(k=2, epsilon=1e-9, seed=0))

    def refiltered(*args, **kwargs):
        raise AssertionError("the prompt filter ran again on resume")

    monkeypatch.setattr(PromptFilter, "__call__", refiltered)
    dm = PromptDataModule(train_file=str(prompts_file), batch_size=2)
    trainer(tmp_path / "b", max_epochs=1, limit_train_batches=2).fit(resumed, dm, ckpt_path=str(first))
    assert dm.train_prompts == kept == resumed.prompts.kept


def test_prompts_longer_than_the_positions_allow_are_refused(tokenizer, prompts_file, tmp_path):
    """A 64-position policy, 40 new tokens: a 30-token prompt needs 70 positions; refused before sampling."""
    policy_dir = tmp_path / "short"
    model = make_tiny_llama(tokenizer, seed=0, max_position_embeddings=64, **TINY)
    export_pretrained(model, tokenizer, policy_dir, stage="init")
    long = tmp_path / "long.jsonl"
    prompt = "\n\nHuman: sort " + " ".join("abcdefgh" * 3) + "\n\nAssistant:"
    long.write_text(json.dumps({"prompt": prompt}) + "\n" + json.dumps({"prompt": PROMPTS[0]}) + "\n")
    module = PolicyGradientModule(
        policy=str(policy_dir), reward=copy_constant, minibatches=Minibatches(size=4),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=40), samples_per_prompt=2),
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"training prompt 0 .* tokens: with max_new_tokens 40 .* max_prompt_length"
    ):
        trainer(tmp_path, max_epochs=1, limit_train_batches=1).fit(
            module, PromptDataModule(train_file=str(long), batch_size=2)
        )
    with pytest.raises(ValueError, match=r"max_new_tokens \(64\) leaves no room for a prompt"):
        PolicyGradientModule(policy=str(policy_dir), reward=copy_constant,
                             rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=64), samples_per_prompt=2))  # fmt: skip


def test_online_rrhf_with_one_sample_and_nothing_else_is_refused(tiny_policy_dir):
    with pytest.raises(ValueError, match="samples_per_prompt 1 and no extra_responses"):
        OnlineRRHFModule(
            policy=str(tiny_policy_dir), reward=copy_constant, rollout=RolloutLoop(samples_per_prompt=1)
        )


def test_a_run_that_trained_nothing_says_so(tiny_policy_dir, prompts_file, tmp_path, capsys):
    """A constant reward with dynamic sampling: every rollout is skipped; the run prints its summary and warns
    that the export is the starting policy."""
    module = grpo(tiny_policy_dir, dynamic_sampling=DynamicSampling())
    module.collector.reward = lambda prompts, responses: [0.5] * len(responses)  # what scores the rollouts
    with pytest.warns(UserWarning, match="no rollout was trained .* the export is the starting policy"):
        trainer(tmp_path, max_epochs=1, limit_train_batches=2).fit(
            module, PromptDataModule(train_file=str(prompts_file), batch_size=2)
        )
    assert "0 rollout(s) trained, 2 skipped, policy version 0" in capsys.readouterr().out
