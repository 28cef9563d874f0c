"""On-policy distillation (issue 34 item 1): the teacher's per-token signal log π_T - log π_old against an
independent forward, mixed with the task advantage by the coefficients; pure distillation at n = 1; the
teacher left out of checkpoints; a teacher with another tokenizer refused."""

from __future__ import annotations

import pytest
import torch

from alignlit.models import export_pretrained, load_policy, make_tiny_llama
from alignlit.models.forward import response_logprobs
from alignlit.modules import Minibatches, PolicyGradientModule
from alignlit.ops import group_advantages, masked_mean
from alignlit.rollout import Experience, RolloutLoop, SamplingParams
from tests.conftest import TINY
from tests.hubcache import snapshot_dir

PROMPTS = [f"\n\nHuman: sort {c} b a\n\nAssistant:" for c in "abcd"]


def reward(prompts, responses):
    return [float(len(r) % 3) for r in responses]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("teacher") / "teacher"
    export_pretrained(make_tiny_llama(tokenizer, seed=7, **TINY), tokenizer, d, stage="init")
    return d


def module(policy, n=4, **kwargs):
    m = PolicyGradientModule(
        policy=str(policy), reward=reward, minibatches=Minibatches(size=8),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=n), **kwargs,
    )  # fmt: skip
    m.rollout.setup(m.policy, m.tokenizer)
    return m


def trajectory(m):
    exp = m.rollout.collect(PROMPTS, m.reward)
    traj, _ = m.make_trajectory(Experience(exp.rollout, exp.rewards))
    return traj


def test_signal_mixed_with_the_task_advantage(tiny_policy_dir, teacher_dir):
    m = module(tiny_policy_dir, teacher=str(teacher_dir), teacher_coef=0.5, task_coef=2.0)
    traj = trajectory(m)
    metrics = m.advantages(traj)
    teacher, _ = load_policy(str(teacher_dir))
    with torch.no_grad():
        t = response_logprobs(teacher.eval(), *traj.ids, temperature=1.0)
    mask = traj.loss_mask
    task = group_advantages(traj.rewards.view(-1, 4), estimator="grpo", eps=1e-6).flatten()
    want = (2.0 * task[:, None] + 0.5 * (t - traj.old_logprobs)) * mask
    torch.testing.assert_close(traj.advantages, want, atol=1e-5, rtol=1e-5)
    assert metrics["distill/reverse_kl"] == pytest.approx(
        float(masked_mean(traj.old_logprobs - t, mask)), abs=1e-5
    )
    assert metrics["distill/reverse_kl"] > 0  # two different random models
    assert "teacher." in m.frozen_prefixes()
    checkpoint = {"state_dict": m.state_dict()}
    assert any(k.startswith("teacher.") for k in checkpoint["state_dict"])
    m.on_save_checkpoint(checkpoint)  # the frozen teacher reloads from disk: not in checkpoints
    assert not any(k.startswith("teacher.") for k in checkpoint["state_dict"])
    assert any(k.startswith("policy.") for k in checkpoint["state_dict"])


def test_pure_distillation_with_one_sample_trains(tiny_policy_dir, teacher_dir):
    m = module(tiny_policy_dir, n=1, teacher=str(teacher_dir), task_coef=0.0)
    traj = trajectory(m)
    m.advantages(traj)
    torch.testing.assert_close(traj.advantages, (traj.teacher_logprobs - traj.old_logprobs) * traj.loss_mask)
    batch = m.trainable(traj)
    loss, _ = m.policy_loss(batch)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.policy.parameters())


def test_gkd_jsd_term_added_to_the_policy_loss(tiny_policy_dir, teacher_dir):
    """jsd_coef: the minibatch loss is the policy-gradient loss plus jsd_coef times GKD's JSD between the
    teacher's and the student's full distributions, both recomputed here by independent forwards."""
    from alignlit.losses import generalized_jsd_loss, policy_gradient_loss
    from alignlit.models.forward import response_token_logprobs

    m = module(tiny_policy_dir, teacher=str(teacher_dir), task_coef=0.0, jsd_coef=0.7, jsd_beta=0.3)
    traj = trajectory(m)
    m.advantages(traj)
    batch = m.trainable(traj)
    loss, metrics = m.policy_loss(batch)
    teacher, _ = load_policy(str(teacher_dir))
    ids, mask = batch.ids, batch.loss_mask
    with torch.no_grad():
        cat = torch.cat([ids[0], ids[2]], 1)
        attn = torch.cat([ids[1], ids[3]], 1).long()
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        P = ids[0].shape[1]
        t_logits = teacher.eval()(input_ids=cat, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1]
        s_logits = m.policy(input_ids=cat, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1]
        jsd, _ = generalized_jsd_loss(s_logits, t_logits, mask, beta=0.3)  # token_mean, the module's default
        logprobs = response_token_logprobs(m.policy, *ids, fused_head=False, packing=False).logprobs
        pg, _ = policy_gradient_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            mask,
            clip_low=0.2,
            clip_high=0.2,
            aggregation="token_mean",
        )
    assert float(metrics["jsd"]) == pytest.approx(float(jsd), rel=1e-4, abs=1e-6)
    assert float(metrics["jsd"]) > 0  # two different random models
    assert float(loss.detach()) == pytest.approx(float(pg + 0.7 * jsd), rel=1e-4, abs=1e-6)
    loss.backward()
    assert all(p.grad is None for p in m.teacher.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.policy.parameters())
    with pytest.raises(ValueError, match="jsd_beta in"):
        module(tiny_policy_dir, teacher=str(teacher_dir), jsd_coef=1.0, jsd_beta=2.0)
    with pytest.raises(ValueError, match="set a teacher"):
        module(tiny_policy_dir, jsd_coef=1.0)


def test_bad_teachers_refused(tiny_policy_dir, hub_cache):
    with pytest.raises(ValueError, match="another tokenizer than the policy"):
        module(tiny_policy_dir, teacher=str(snapshot_dir(hub_cache)))
    with pytest.raises(ValueError, match="set a teacher"):
        module(tiny_policy_dir, task_coef=0.0)
    with pytest.raises(ValueError, match="compares the n >= 2 responses"):
        module(tiny_policy_dir, n=1, teacher=str(tiny_policy_dir))  # the task advantage still needs groups


@pytest.mark.slow
def test_quickstart_distill_config_runs(tiny_policy_dir, teacher_dir, tmp_path, monkeypatch):
    """configs/quickstart/distill.yaml through the command line for 2 rollouts on tiny models (the teacher a
    second tiny policy, the verifier replaced by a plain reward): the reverse KL is logged every rollout."""
    import json
    from pathlib import Path

    from alignlit.cli import main

    root = Path(__file__).resolve().parents[2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(root / "configs/quickstart/distill.yaml"), f"--model.init_args.policy={tiny_policy_dir}",
          f"--model.init_args.teacher={teacher_dir}", "--model.init_args.reward=tests.modules.test_distill.reward",
          "--model.init_args.gold=null", "--model.init_args.export_dir=export", f"--data.init_args.train_file={prompts}",
          f"--data.init_args.val_file={prompts}", "--data.init_args.batch_size=2", "--trainer.limit_train_batches=2",
          "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2"])  # fmt: skip
    assert (tmp_path / "export" / "config.json").exists()
    history = json.loads(
        next((tmp_path / "out" / "quickstart" / "logs").rglob("policy_gradient_curves.json")).read_text()
    )
    kls = [h["distill/reverse_kl"] for h in history if "reward/raw" in h]
    assert len(kls) == 2 and all(k > 0 for k in kls)
