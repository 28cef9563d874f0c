"""OnlineModule: dropout off for log-prob ratios, degenerate rollouts skipped (not crashed), the
per-rollout schedule, the phase display, reward resolution from a dotted path."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from alignlit.data import PromptDataModule
from alignlit.models import export_pretrained, load_policy, make_tiny_llama
from alignlit.models.forward import response_logprobs
from alignlit.models.modes import disable_dropout
from alignlit.modules import Minibatches, PPOModule
from alignlit.rollout import Experience, Rollout, RolloutLoop, SamplingParams
from alignlit.rollout.reward_protocol import resolve_reward
from tests.conftest import TINY
from tests.helpers import op_prompts

PROMPTS = op_prompts(6, ops=("sort",))


def length_reward(prompts, responses):
    """A reward function given by its dotted path in some tests: the response's length in characters."""
    return [float(len(r)) for r in responses]


@pytest.fixture(scope="module")
def dropout_policy_dir(tmp_path_factory, tokenizer):
    """A tiny policy whose attention has dropout 0.5 (read by LlamaAttention, not an nn.Dropout)."""
    d = tmp_path_factory.mktemp("dropout") / "policy"
    model = make_tiny_llama(tokenizer, seed=0, attention_dropout=0.5, **TINY)
    export_pretrained(model, tokenizer, d, stage="init")
    return d


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("online_prompts")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return d / "prompts.jsonl"


def ppo(policy_dir, **kwargs):
    kwargs.setdefault("rollout", RolloutLoop(sampling=SamplingParams(max_new_tokens=4)))
    kwargs.setdefault("minibatches", Minibatches(size=3))
    module = PPOModule(policy=str(policy_dir), reward=length_reward, critic=str(policy_dir), **kwargs)
    module.rollout.setup(module.policy, module.tokenizer)
    return module


def test_dropout_model_gives_ratio_one_at_the_first_update(dropout_policy_dir):
    """With attention dropout 0.5 in train mode two forwards of the same tokens differ; the stage turns
    dropout off, so the first PPO update sees ρ = 1 on every token (approx-KL 0, clip fraction 0)."""
    raw, _ = load_policy(dropout_policy_dir)
    raw.train()
    module = ppo(dropout_policy_dir)
    exp = module.rollout.collect(PROMPTS[:3], length_reward)
    r = exp.rollout
    ids = (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    torch.manual_seed(0)
    with torch.no_grad():  # the defect the stage avoids: dropout makes two passes disagree
        assert (response_logprobs(raw, *ids) - response_logprobs(raw, *ids)).abs().max() > 1e-3
    batch, _ = module.make_trajectory(exp)
    module.advantages(batch)
    assert module.policy.training
    _, metrics = module.actor_loss(batch)
    assert metrics["ratio"].item() == 1.0
    assert metrics["approx_kl"].item() == 0.0
    assert metrics["clip_frac"].item() == 0.0


def test_disable_dropout_zeroes_every_rate(dropout_policy_dir):
    model, _ = load_policy(dropout_policy_dir)
    attention = model.model.layers[0].self_attn
    assert attention.attention_dropout == 0.5
    disable_dropout(model)
    assert attention.attention_dropout == 0.0 and model.config.attention_dropout == 0.0


def degenerate(rollout: Rollout, keep_tokens: int) -> Rollout:
    """The same rollout with only its first ``keep_tokens`` response tokens (row-major) kept."""
    mask = rollout.response_mask.clone()
    flat = mask.flatten()
    kept = flat.nonzero().flatten()[:keep_tokens]
    flat[:] = False
    flat[kept] = True
    mask = flat.view_as(mask)
    return Rollout(
        prompts=rollout.prompts,
        prompt_index=rollout.prompt_index,
        prompt_ids=rollout.prompt_ids,
        prompt_mask=rollout.prompt_mask,
        response_ids=rollout.response_ids,
        response_mask=mask,
        logprobs=rollout.logprobs * mask,
        texts=["" if not m.any() else t for m, t in zip(mask, rollout.texts)],
        finish_reasons=rollout.finish_reasons,
        n=rollout.n,
    )


@pytest.mark.parametrize("keep_tokens", [0, 1], ids=["all-empty", "one-token"])
def test_degenerate_rollout_is_skipped_and_counted(tiny_policy_dir, prompts_file, tmp_path, keep_tokens):
    """A rollout with no response token, or a single one in total, cannot be whitened (an unbiased
    variance of one value) nor cut into minibatches: PPO skips the update, counts and logs it, steps
    no optimizer and no LR schedule, and the next rollout trains normally."""
    module = ppo(tiny_policy_dir)
    collect = module.rollout.collect
    calls = []

    def first_degenerate(prompts, reward, **kwargs):
        exp = collect(prompts, reward, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            return Experience(degenerate(exp.rollout, keep_tokens), exp.rewards)
        return exp

    module.rollout.collect = first_degenerate
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, PromptDataModule(train_file=str(prompts_file), batch_size=3))
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert train[0]["rollout/skipped"] == 1.0 and "policy/policy_loss" not in train[0]
    assert "rollout/skipped" not in train[1] and "policy/policy_loss" in train[1]
    assert module.progress.skipped_rollouts == 1 and train[1]["rollout/skipped_total"] == 1.0
    # optimizer steps of the second rollout only: 3 samples in 1 minibatch, critic + actor
    assert trainer.global_step == 2
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [1, 1]


def test_reward_from_a_dotted_function_path():
    reward = resolve_reward("tests.modules.test_online.length_reward")
    assert reward is length_reward
    with pytest.raises(ValueError, match="neither a reward-model directory nor an importable function"):
        resolve_reward("tests.modules.test_online.no_such_reward")
    with pytest.raises(ValueError, match="is a class"):
        resolve_reward("alignlit.sim.SimGoldReward")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_reward("out/no/such/reward-model")


def test_mismatch_is_logged_and_tis_weights_the_policy_loss(tiny_policy_dir):
    """An engine whose log-probs are off by a known amount (an off-policy batch): the module measures
    the mismatch, and with tis_cap = 1.5 weights every token's PPO loss by min(π_old/μ, 1.5)."""
    from alignlit.losses import ppo_policy_loss
    from alignlit.ops import kl_k3

    module = ppo(tiny_policy_dir, tis_cap=1.5, advantage_norm="none")
    exp = module.rollout.collect(PROMPTS[:3], length_reward)
    mask = exp.rollout.response_mask
    shift = (
        torch.where(torch.arange(mask.shape[1]) % 2 == 0, 0.8, -0.3).expand_as(mask) * mask
    )  # log π_old - log μ
    exp.rollout.logprobs = exp.rollout.logprobs - shift  # the engine's μ
    batch, metrics = module.make_trajectory(exp)
    module.advantages(batch)
    valid = mask.bool()
    assert metrics["mismatch/abs_mean"] == pytest.approx(shift.abs()[valid].mean().item(), rel=1e-4)
    assert metrics["mismatch/abs_max"] == pytest.approx(0.8, rel=1e-4)
    expected_kl = kl_k3(-shift, torch.zeros_like(shift))[valid].mean().item()  # E_μ[w - 1 - log w]
    assert metrics["mismatch/kl"] == pytest.approx(expected_kl, rel=1e-4)
    expected_weights = torch.where(shift > 0, 1.5, torch.exp(shift)) * mask  # min(e^0.8 = 2.23, 1.5), e^-0.3
    torch.testing.assert_close(batch.is_weights, expected_weights.float(), rtol=1e-5, atol=1e-6)

    loss, _ = module.actor_loss(batch)
    logprobs = response_logprobs(module.policy, *batch.ids)
    expected, _ = ppo_policy_loss(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        batch.loss_mask,
        clip_eps=0.2,
        is_weights=expected_weights,
    )
    torch.testing.assert_close(loss, expected.float(), rtol=1e-5, atol=1e-6)


def test_prompt_filter_samples_like_the_rollout_unless_configured(tiny_policy_dir, prompts_file, tmp_path):
    """Without its own sampling, the prompt filter samples with the rollout's temperature, length limit and
    stop strings (seeded with its own seed); with one, it uses that."""
    from alignlit.rollout import PromptFilter

    seen = []

    class Recording:
        def generate(self, prompts, n, sampling):
            seen.append(sampling)
            return module.rollout.engine.generate(prompts, n, sampling)

        def sync(self, policy):
            pass

    rollout = RolloutLoop(sampling=SamplingParams(temperature=0.7, max_new_tokens=3, stop=["\n\nHuman:"]))
    module = ppo(tiny_policy_dir, rollout=rollout, prompt_filter=PromptFilter(k=2, epsilon=0.0, seed=7))
    module.prompts.prompt_filter(
        Recording().generate, length_reward, PROMPTS[:2], default_sampling=module.rollout.sampling
    )
    assert seen[-1] == SamplingParams(temperature=0.7, max_new_tokens=3, stop=["\n\nHuman:"], seed=7)

    own = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    PromptFilter(k=2, epsilon=0.0, sampling=own)(
        Recording().generate, length_reward, PROMPTS[:2], default_sampling=module.rollout.sampling
    )
    assert seen[-1] == own

    # and through fit: the engine the filter gets samples with the rollout's settings
    module = ppo(tiny_policy_dir, rollout=rollout, prompt_filter=PromptFilter(k=2, epsilon=0.0, seed=7))
    engine = module.rollout.engine
    calls = []
    original = engine.generate
    engine.generate = lambda prompts, n, sampling: calls.append(sampling) or original(prompts, n, sampling)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=0, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(train_file=str(prompts_file), batch_size=3))
    assert calls and all(c.max_new_tokens == 3 and c.temperature == 0.7 and c.seed == 7 for c in calls)
