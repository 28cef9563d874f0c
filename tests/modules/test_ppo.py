"""PPOModule: experience numerics against naive references, losses against alignlit.losses, KL
placement, reward normalisation, critic pre-training, reference baseline, exact resume, configs."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from alignlit.data import PromptDataModule
from alignlit.losses import entropy_bonus, masked_nll, ppo_policy_loss, ppo_value_loss, shift_for_next_token
from alignlit.models import export_pretrained, load_reward_model, load_scalar_model, make_tiny_llama
from alignlit.models.forward import response_logprobs
from alignlit.modules import KLPenalty, Minibatches, Optim, PPOModule, PtxMix
from alignlit.ops import (
    entropy_from_logits,
)
from alignlit.rollout import HFEngine, PromptFilter, RolloutLoop, SamplingParams
from alignlit.rollout.collector import sample_metrics
from tests.conftest import TINY
from tests.helpers import OP_PROMPTS as PROMPTS
from tests.helpers import TIMING, char_reward, fit_on_prompts

ROOT = Path(__file__).resolve().parents[2]


def make_module(tiny_policy_dir, **kwargs):
    kwargs.setdefault("reward", char_reward)
    kwargs.setdefault("rollout", RolloutLoop(sampling=SamplingParams(max_new_tokens=5)))
    kwargs.setdefault("minibatches", Minibatches(size=4))
    module = PPOModule(policy=str(tiny_policy_dir), critic=str(tiny_policy_dir), **kwargs)
    module.rollout.setup(module.policy, module.tokenizer)
    return module


def make_experience(module, exp):
    """The PPO batch of a scored rollout as a training step builds it: the trajectory (old/ref
    log-probs, KL) by the base, then PPO's values, rewards and GAE; samples without a token dropped."""
    trajectory, metrics = module.make_trajectory(exp)
    metrics.update(sample_metrics(exp.rollout, exp.rewards), **module.advantages(trajectory))
    return module.trainable(trajectory), metrics


# ---------------------------------------------------------------------- pure functions
# ---------------------------------------------------------------------- experience and losses
def naive_values(critic, rollout):
    """V(s_t) per sample from an unpadded forward: the head at the position before response token t."""
    out = []
    for j in range(len(rollout)):
        prompt = rollout.prompt_ids[j][rollout.prompt_mask[j]]
        response = rollout.response_ids[j][rollout.response_mask[j]]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            v = critic.values(ids, torch.ones_like(ids))[0]
        out.append(v[len(prompt) - 1 : len(prompt) - 1 + len(response)])
    return out


def test_experience_matches_naive_reference(tiny_policy_dir, reference_dir):
    """Old/ref log-probs, values, KL-penalised rewards and GAE against per-sample loops (γ = 0.9, λ = 0.8, β = 0.1)."""
    module = make_module(
        tiny_policy_dir,
        reference=str(reference_dir),
        reward_norm="none",
        reward_clip=None,
        kl=KLPenalty(coef=0.1),
        gamma=0.9,
        lam=0.8,
        advantage_norm="none",
    )
    exp = module.rollout.collect(PROMPTS, char_reward)
    batch, metrics = make_experience(module, exp)
    r = exp.rollout
    ids = (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    with torch.no_grad():
        old = response_logprobs(module.policy, *ids)
        ref = response_logprobs(module.reference, *ids)
    torch.testing.assert_close(batch.old_logprobs, old)
    torch.testing.assert_close(batch.ref_logprobs, ref)
    assert (batch.old_logprobs - batch.ref_logprobs).abs().max() > 0.01  # a real KL term

    values = naive_values(module.critic, r)
    scores = torch.tensor(char_reward(r.prompts, r.texts))
    for j in range(len(r)):
        n = int(r.response_mask[j].sum())
        torch.testing.assert_close(batch.values[j, :n], values[j], atol=1e-5, rtol=0)
        rewards = [-0.1 * (old[j, t] - ref[j, t]).item() for t in range(n)]
        rewards[-1] += scores[j].item()
        advantages, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_value = values[j][t + 1].item() if t + 1 < n else 0.0
            delta = rewards[t] + 0.9 * next_value - values[j][t].item()
            running = delta + 0.9 * 0.8 * running
            advantages[t] = running
        torch.testing.assert_close(batch.token_rewards[j, :n], torch.tensor(rewards), atol=1e-5, rtol=0)
        torch.testing.assert_close(batch.advantages[j, :n], torch.tensor(advantages), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            batch.returns[j, :n], torch.tensor(advantages) + values[j], atol=1e-5, rtol=0
        )
    seq_kl = ((old - ref) * r.response_mask).sum(-1).mean().item()
    assert metrics["kl/ref"] == pytest.approx(seq_kl, abs=1e-5)
    assert metrics["reward/raw"] == pytest.approx(scores.mean().item(), abs=1e-6)
    assert metrics["response/ppl"] == pytest.approx(math.exp(-old[r.response_mask].mean().item()), rel=1e-5)


def test_losses_match_alignlit_losses(tiny_policy_dir, reference_dir, data_dir):
    """After the policy and critic move, the module's losses equal alignlit.losses on independently computed tensors."""
    module = make_module(
        tiny_policy_dir,
        reference=str(reference_dir),
        entropy_coef=0.01,
        clip_eps=0.1,
        value_clip_eps=0.05,
        ptx=PtxMix(
            file=str(data_dir / "sft.jsonl"), coef=0.5, batch_size=4, max_length=32, max_prompt_length=20
        ),
    )
    module.setup_ptx()
    exp = module.rollout.collect(PROMPTS, char_reward)
    batch, _ = make_experience(module, exp)
    with torch.no_grad():  # move both models so ratios and value changes are not trivial
        for p in [*module.policy.parameters(), *module.critic.parameters()]:
            p.add_(0.02 * torch.randn_like(p))

    ptx_batch = next(iter(module.ptx_mixer.data.train_dataloader()))
    loss, metrics = module.actor_loss(batch)
    ids = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.loss_mask)
    logprobs = response_logprobs(module.policy, *ids)
    expected, expected_metrics = ppo_policy_loss(
        logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, clip_eps=0.1
    )
    logits = module.policy(
        input_ids=torch.cat([batch.prompt_ids, batch.response_ids], 1),
        attention_mask=torch.cat([batch.prompt_mask, batch.loss_mask], 1).long(),
        position_ids=(torch.cat([batch.prompt_mask, batch.loss_mask], 1).long().cumsum(-1) - 1).clamp(min=0),
    ).logits[:, batch.prompt_ids.shape[1] - 1 : -1]
    entropy_loss, _ = entropy_bonus(entropy_from_logits(logits), batch.loss_mask, coef=0.01)
    ptx_logits = module.policy(input_ids=ptx_batch.input_ids, attention_mask=ptx_batch.attention_mask).logits
    nll, _ = masked_nll(*shift_for_next_token(ptx_logits, ptx_batch.input_ids, ptx_batch.loss_mask))
    torch.testing.assert_close(loss, expected + entropy_loss + 0.5 * nll, atol=1e-5, rtol=0)
    assert 0 < expected_metrics["clip_frac"] < 1
    torch.testing.assert_close(metrics["clip_frac"], expected_metrics["clip_frac"])
    torch.testing.assert_close(metrics["approx_kl"], expected_metrics["approx_kl"], atol=1e-6, rtol=0)

    value_loss, _ = module.critic_loss(batch)
    values = module.critic.values(
        torch.cat([batch.prompt_ids, batch.response_ids], 1),
        torch.cat([batch.prompt_mask, batch.loss_mask], 1).long(),
    )[:, batch.prompt_ids.shape[1] - 1 : -1]
    expected_value, expected_value_metrics = ppo_value_loss(
        values * batch.loss_mask, batch.values, batch.returns, batch.loss_mask, clip_eps=0.05
    )
    torch.testing.assert_close(value_loss, expected_value, atol=1e-6, rtol=0)
    assert expected_value_metrics["value_clip_frac"] > 0


def test_reward_moments_and_adaptive_kl_over_rollouts(tiny_policy_dir, reference_dir):
    """Running moments after two rollouts equal torch.mean/var of all rewards; the adaptive β follows
    β·(1 + clip((KL - target)/target, ±0.2)·N/horizon)."""
    module = make_module(
        tiny_policy_dir, reference=str(reference_dir), kl=KLPenalty(coef=0.2, target=0.5, horizon=40)
    )
    seen = []
    for _ in range(2):
        exp = module.rollout.collect(PROMPTS, char_reward)
        _, metrics = make_experience(module, exp)
        seen.append(exp.rewards)
    everything = torch.cat(seen).double()
    assert module.reward_moments.count == 16
    assert module.reward_moments.mean == pytest.approx(everything.mean().item())
    assert module.reward_moments.var == pytest.approx(everything.var().item())
    expected_last = ((seen[1] - everything.mean()) / everything.std()).clamp(-5, 5).mean().item()
    assert metrics["reward/normalized"] == pytest.approx(expected_last, rel=1e-5)

    kl = metrics["kl/ref"]
    module.kl_ctl.update(kl, 8)
    error = min(max((kl - 0.5) / 0.5, -0.2), 0.2)
    assert module.kl_ctl.value == pytest.approx(0.2 * (1 + error * 8 / 40))


def test_reference_baseline_is_sampled_once_per_prompt(tiny_policy_dir):
    module = make_module(tiny_policy_dir, reference_baseline=True, reward_norm="none", reward_clip=None)
    exp = module.rollout.collect(PROMPTS[:4], char_reward)
    _, metrics = make_experience(module, exp)
    assert sorted(module.baseline_cache) == sorted(PROMPTS[:4]) and metrics["reward/baseline_new"] == 4
    baseline = torch.tensor([module.baseline_cache[p] for p in exp.rollout.prompts])
    assert metrics["reward/shaped"] == pytest.approx((exp.rewards - baseline).mean().item(), abs=1e-6)
    cached = dict(module.baseline_cache)
    exp = module.rollout.collect(PROMPTS[:4], char_reward)
    _, metrics = make_experience(module, exp)
    assert metrics["reward/baseline_new"] == 0 and module.baseline_cache == cached


# ---------------------------------------------------------------------- fit, resume
fit = functools.partial(fit_on_prompts, val_batches=1)


def resume_module(tiny_policy_dir, reference_dir, data_dir):
    return make_module(
        tiny_policy_dir,
        reference=str(reference_dir),
        reference_baseline=True,
        kl=KLPenalty(target=1.0, horizon=50),
        critic_pretrain_rollouts=1,
        ptx=PtxMix(
            file=str(data_dir / "sft.jsonl"),
            val_file=str(data_dir / "sft.jsonl"),
            coef=0.1,
            batch_size=3,
            max_length=32,
            max_prompt_length=20,
        ),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=5)),
        minibatches=Minibatches(size=3, epochs=2),
        optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        critic_optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        gold=char_reward,
    )


@pytest.mark.slow
def test_exact_resume(tmp_path, tiny_policy_dir, reference_dir, data_dir):
    """4 rollouts straight vs. resumed from the checkpoint written mid-epoch after rollout 3: same
    weights, same metrics (timings aside), same online state.

    6 training prompts in batches of 4 and 2 (2 rollouts an epoch), minibatches of 3, 2 epochs:
    rollout 1 (4 prompts, critic pre-training) makes 2 x 2 = 4 optimizer steps, rollout 2 (2 prompts)
    2 critic + 2 policy steps, rollout 3 (4 prompts) 4 + 4, so it ends at global step 16.
    """
    straight = resume_module(tiny_policy_dir, reference_dir, data_dir)
    fit(straight, data_dir, tmp_path / "a", rollouts=4, checkpoint_every=4)
    ckpt = tmp_path / "a" / "ckpt" / "epoch=1-step=16.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp_path / "a" / "ckpt").iterdir())
    saved = torch.load(ckpt, weights_only=True)
    assert not any(k.startswith(("reference.", "reward_model.")) for k in saved["state_dict"])
    assert saved["ppo_state"]["rollout"]["rollouts"] == 3

    resumed = resume_module(tiny_policy_dir, reference_dir, data_dir)
    fit(resumed, data_dir, tmp_path / "b", rollouts=4, ckpt_path=str(ckpt))
    for name in ("policy", "critic"):
        for (key, a), b in zip(
            getattr(straight, name).state_dict().items(), getattr(resumed, name).state_dict().values()
        ):
            assert torch.equal(a, b), f"{name}.{key} differs after resume"
    assert resumed.baseline_cache == straight.baseline_cache
    assert resumed.kl_ctl.value == straight.kl_ctl.value
    strip = [{k: v for k, v in h.items() if not k.startswith(TIMING)} for h in straight.progress.history]
    assert [
        {k: v for k, v in h.items() if not k.startswith(TIMING)} for h in resumed.progress.history
    ] == strip
    assert len([h for h in strip if "reward/raw" in h]) == 4
    assert any("val/gold" in h and "val/sft_nll" in h for h in strip)


def test_critic_pretraining_freezes_policy_then_both_train(tmp_path, tiny_policy_dir, data_dir):
    module = make_module(
        tiny_policy_dir,
        critic_pretrain_rollouts=2,
        optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        critic_optim=Optim(lr=1e-3, min_lr_ratio=1.0),
    )
    policy0 = {k: v.clone() for k, v in module.policy.state_dict().items()}
    critic0 = {k: v.clone() for k, v in module.critic.state_dict().items()}
    fit(module, data_dir, tmp_path, rollouts=2)
    assert all(torch.equal(v, policy0[k]) for k, v in module.policy.state_dict().items())
    assert not all(torch.equal(v, critic0[k]) for k, v in module.critic.state_dict().items())
    assert all("policy/policy_loss" not in h for h in module.progress.history if "reward/raw" in h)
    assert (tmp_path / "ppo_curves.png").stat().st_size > 0
    history = json.loads((tmp_path / "ppo_curves.json").read_text())
    assert [h["rollout"] for h in history if "reward/raw" in h] == [1.0, 2.0]

    fit(module, data_dir, tmp_path / "more", rollouts=2)
    assert not all(torch.equal(v, policy0[k]) for k, v in module.policy.state_dict().items())
    assert [h["rollout"] for h in module.progress.history if "policy/policy_loss" in h] == [3.0, 4.0]
    for h in (
        h for h in module.progress.history if "time/train_s" in h
    ):  # experience forwards, inside train time
        parts = [h["time/old_logp_s"], h["time/ref_logp_s"], h["time/values_s"]]
        assert all(t > 0 for t in parts) and sum(parts) < h["time/train_s"]


@pytest.mark.slow
def test_prompt_filter_applies_to_training_prompts(tmp_path, tiny_policy_dir, data_dir):
    """A reward constant on 'copy' prompts has zero variance there: the filter drops exactly those
    before the first rollout (ChatGLM §3.4)."""

    def reward(prompts, responses):
        return [1.0 if "copy" in p else float(len(r)) for p, r in zip(prompts, responses)]

    module = make_module(
        tiny_policy_dir,
        reward=reward,
        prompt_filter=PromptFilter(k=3, epsilon=1e-9, sampling=SamplingParams(max_new_tokens=5, seed=0)),
    )
    engine = HFEngine(module.tokenizer, module.policy, micro_batch_size=64)
    expected, _ = module.prompts.prompt_filter(
        engine.generate, reward, PROMPTS
    )  # same seeded samples as at fit start
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    dm = PromptDataModule(train_file=str(data_dir / "prompts.jsonl"), batch_size=4)
    trainer.fit(module, dm)
    assert dm.train_prompts == expected
    assert any("copy" in p for p in PROMPTS) and not any("copy" in p for p in expected)


def test_bad_arguments_name_the_field(tiny_policy_dir):
    with pytest.raises(ValueError, match="reward_norm must be"):
        PPOModule(policy=str(tiny_policy_dir), reward=char_reward, reward_norm="whiten")
    with pytest.raises(ValueError, match="advantage_norm must be"):
        PPOModule(policy=str(tiny_policy_dir), reward=char_reward, advantage_norm="rows")
    with pytest.raises(ValueError, match=r"ptx.coef must be >= 0"):
        PPOModule(policy=str(tiny_policy_dir), reward=char_reward, ptx=PtxMix(file="x.jsonl", coef=-1.0))


def test_reward_model_directory(tmp_path, tiny_policy_dir):
    """A reward-model directory is loaded frozen and scores like ``load_reward_model``; the critic starts from it."""
    rm, rm_tokenizer = load_scalar_model(tiny_policy_dir)
    export_pretrained(rm, rm_tokenizer, tmp_path / "rm", stage="reward")
    module = PPOModule(policy=str(tiny_policy_dir), reward=str(tmp_path / "rm"))
    module.rollout.setup(module.policy, module.tokenizer)
    assert not any(p.requires_grad for p in module.reward_model.parameters())
    assert all(p.requires_grad for p in module.critic.parameters())
    torch.testing.assert_close(module.critic.hf_model.score.weight, rm.hf_model.score.weight, rtol=0, atol=0)
    exp = module.rollout.collect(PROMPTS[:2], module.reward)
    expected = load_reward_model(tmp_path / "rm").score(exp.rollout.prompts, exp.rollout.texts)
    torch.testing.assert_close(exp.rewards, expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- configs
CONFIGS = [ROOT / "configs/quickstart/ppo.yaml", ROOT / "configs/quickstart/ppo-vanilla.yaml"]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_tiny_fit(config, tmp_path, monkeypatch, tiny_policy_dir, rm_dir, data_dir):
    """Each shipped PPO config runs two rollouts on the tiny model through the CLI, with its own logger
    and checkpoint callback (relative paths land in tmp_path); model and data paths overridden."""
    from alignlit.cli import main

    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            "--config",
            str(config),
            f"--model.init_args.policy={tiny_policy_dir}",
            f"--model.init_args.reward={rm_dir}",
            "--model.init_args.gold=null",
            f"--model.init_args.ptx.file={data_dir / 'sft.jsonl'}",
            f"--model.init_args.ptx.val_file={data_dir / 'sft.jsonl'}",
            "--model.init_args.export_dir=export",
            f"--data.init_args.train_file={data_dir / 'prompts.jsonl'}",
            f"--data.init_args.val_file={data_dir / 'prompts.jsonl'}",
            "--data.init_args.batch_size=4",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.val_check_interval=2",
        ]
    )
    assert (tmp_path / "export" / "config.json").exists()
    curves = next((tmp_path / "out" / "quickstart" / "logs").rglob("ppo_curves.json"))
    history = json.loads(curves.read_text())
    assert len([h for h in history if "reward/raw" in h]) == 2
    assert [h["rollout"] for h in history if "val/reward" in h] == [0.0, 2.0]  # before training, after 2
    if "vanilla" not in config.name:
        last = torch.load(tmp_path / "out/quickstart/checkpoints/ppo/last.ckpt", weights_only=True)
        assert last["ppo_state"]["rollout"]["rollouts"] == 2


# ---------------------------------------------------------------------- vLLM
@pytest.mark.vllm
def test_ppo_with_vllm_engine(tmp_path, tokenizer, data_dir):
    """Two PPO rollouts with `rollout.engine: vllm`: weights are synced after the policy update and
    the parity check (every sync) passes, so the second rollout is on-policy."""
    policy_dir = tmp_path / "policy"
    export_pretrained(make_tiny_llama(tokenizer, seed=0, **TINY), tokenizer, policy_dir, stage="init")
    module = PPOModule(
        policy=str(policy_dir),
        reward=char_reward,
        optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        rollout=RolloutLoop(
            engine="vllm",
            sampling=SamplingParams(max_new_tokens=5),
            parity_every=1,
            parity_tol=1e-3,
            vllm_args={"max_model_len": 128},
        ),
        minibatches=Minibatches(size=4),
    )
    fit(module, data_dir, tmp_path, rollouts=2, val_batches=0)
    assert module.rollout.engine.weight_pushes == 2
    parity = [
        h["rollout/parity_max_abs_diff"]
        for h in module.progress.history
        if "rollout/parity_max_abs_diff" in h
    ]
    assert len(parity) == 2 and max(parity) < 1e-3
