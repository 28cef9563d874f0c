"""Multi-turn episodes through the online base and the stages: the trajectory's loss mask is the engine's
tokens only, PPO's token rewards carry the turn rewards at turn ends (hand-computed), GRPO and PPO train
with an environment from the rollout loop, and kill-and-resume of a multi-turn GRPO run is exact."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from alignlit.data import PromptDataModule
from alignlit.modules import Minibatches, Optim, PolicyGradientModule, PPOModule
from alignlit.rollout import EpisodeReturn, RolloutLoop, SamplingParams
from alignlit.sim import SimEpisodeGold, SimHintEnvironment, make_data
from tests.helpers import OP_PROMPTS as PROMPTS
from tests.helpers import TIMING


def loop(n=2, seed=0):
    return RolloutLoop(
        sampling=SamplingParams(max_new_tokens=5),
        samples_per_prompt=n,
        seed=seed,
        environment=SimHintEnvironment(attempts=3, turn_cost=0.25),
        max_turns=3,
        max_episode_tokens=40,
    )


def grpo(policy_dir, **kwargs):
    kwargs.setdefault("rollout", loop())
    module = PolicyGradientModule(
        policy=str(policy_dir),
        reward=EpisodeReturn(),
        minibatches=Minibatches(size=4, epochs=1),
        optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        gold=SimEpisodeGold(turn_cost=0.25),
        **kwargs,
    )
    return module


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mt_data")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return d


def test_trajectory_trains_on_the_models_tokens_only(tiny_policy_dir):
    module = grpo(tiny_policy_dir)
    module.rollout.setup(module.policy, module.tokenizer)
    experience = module.rollout.collect(PROMPTS[:3], module.reward)
    rollout = experience.rollout
    assert (rollout.response_mask & ~rollout.action_mask).any()  # some episode got a hint
    trajectory, metrics = module.make_trajectory(experience)
    assert torch.equal(trajectory.action_mask, rollout.action_mask)
    assert torch.equal(trajectory.loss_mask, rollout.action_mask)
    assert torch.equal(trajectory.attention_mask, rollout.response_mask)
    environment = rollout.response_mask & ~rollout.action_mask
    assert trajectory.kl is None or (trajectory.kl[environment] == 0).all()
    torch.testing.assert_close(trajectory.scores, rollout.turn_rewards.sum(-1))
    assert torch.equal(trajectory.turn_rewards, rollout.turn_rewards)
    # the mismatch statistics are over the model's tokens: the engine sampled them from the same weights
    assert metrics["mismatch/abs_max"] < 1e-4
    assert {"episode/turns", "episode/truncated", "episode/tool_calls"} <= set(experience.metrics)
    with pytest.raises(ValueError, match="EpisodeReturn"):
        module.rollout.collect(PROMPTS[:1], lambda p, r: [0.0] * len(r))


def test_ppo_token_rewards_put_turn_rewards_at_turn_ends(tiny_policy_dir):
    """reward_norm none, β = 0.1: token rewards = -β·kl_t on model tokens, each hint's -0.25 on its turn's
    last token, the final gold on the last token; 0 on environment tokens; GAE's advantages 0 there."""
    module = PPOModule(
        policy=str(tiny_policy_dir),
        reward=EpisodeReturn(),
        critic=str(tiny_policy_dir),
        rollout=loop(n=1),
        reward_norm="none",
        reward_clip=None,
        minibatches=Minibatches(size=4),
        advantage_norm="none",
    )
    module.rollout.setup(module.policy, module.tokenizer)
    trajectory, _ = module.make_trajectory(module.rollout.collect(PROMPTS[:4], module.reward))
    module.advantages(trajectory)
    actions, turns = trajectory.action_mask, trajectory.turn_rewards
    expected = -module.kl_ctl.value * trajectory.kl + turns  # the gold is itself the last turn's reward
    torch.testing.assert_close(trajectory.token_rewards, expected * actions)
    assert (turns[actions & (turns != 0)] != 0).all() and ((turns != 0) & ~actions).sum() == 0
    hinted = (trajectory.attention_mask & ~actions).any(-1)
    assert hinted.any()
    for row in hinted.nonzero().flatten().tolist():
        assert (turns[row] == -0.25).sum() >= 1  # a hint's cost on the turn before it
    assert (trajectory.advantages[~actions] == 0).all() and (trajectory.returns[~actions] == 0).all()


def fit(module, data_dir, tmp_path, *, rollouts, ckpt_path=None, checkpoint=False):
    callbacks = [
        L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=rollouts,
        limit_val_batches=1,
        val_check_interval=1.0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks if checkpoint else [],
        default_root_dir=tmp_path,
    )
    dm = PromptDataModule(train_file=str(data_dir / "prompts.jsonl"), val_fraction=0.25, batch_size=2)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def test_ppo_trains_with_an_environment(tiny_policy_dir, data_dir, tmp_path):
    module = PPOModule(
        policy=str(tiny_policy_dir),
        reward=EpisodeReturn(),
        critic=str(tiny_policy_dir),
        rollout=loop(n=1),
        minibatches=Minibatches(size=4),
        optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        gold=SimEpisodeGold(turn_cost=0.25),
    )
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    fit(module, data_dir, tmp_path, rollouts=2)
    assert not all(torch.equal(v, before[k]) for k, v in module.policy.state_dict().items())
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert len(train) == 2 and all("episode/turns" in h and "value/loss" in h for h in train)
    assert any("val/gold" in h for h in module.progress.history)


@pytest.mark.slow
def test_multiturn_grpo_exact_resume(tiny_policy_dir, data_dir, tmp_path):
    """3 multi-turn GRPO rollouts straight vs. resumed from the checkpoint written after rollout 2: the same
    weights and the same history (timings aside), episodes included."""
    straight = grpo(tiny_policy_dir)
    fit(straight, data_dir, tmp_path / "a", rollouts=3, checkpoint=True)
    train = [h for h in straight.progress.history if "time/train_s" in h]
    assert len(train) == 3 and any(h["episode/turns"] > 1 for h in train)
    by_rollout = {}
    for path in (tmp_path / "a" / "ckpt").iterdir():
        saved = torch.load(path, weights_only=True)
        by_rollout[saved["policy_gradient_state"]["rollout"]["rollouts"]] = path
    resumed = grpo(tiny_policy_dir)
    fit(resumed, data_dir, tmp_path / "b", rollouts=3, ckpt_path=str(by_rollout[2]))
    for (key, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), f"policy.{key} differs after resume"
    strip = lambda history: [{k: v for k, v in h.items() if not k.startswith(TIMING)} for h in history]  # noqa: E731
    assert strip(resumed.progress.history) == strip(straight.progress.history)


def test_multiturn_grpo_with_asynchronous_rollouts(tiny_policy_dir, data_dir, tmp_path):
    """Episodes generated ahead by the HF worker (max_staleness 1, token in / token out through the worker's
    generate_from_ids): the second step trains on episodes one version old, the environment's tokens stay
    out of the loss."""
    rollout = loop()
    rollout.max_staleness = 1
    module = grpo(tiny_policy_dir, rollout=rollout)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, PromptDataModule(train_file=str(data_dir / "prompts.jsonl"), batch_size=2))
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert [h["async/staleness_max"] for h in train] == [0, 1]
    assert all("episode/turns" in h for h in train) and trainer.global_step >= 1


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["grpo-multiturn", "ppo-multiturn"])
def test_multiturn_config_tiny_fit(name, tiny_policy_dir, tmp_path, monkeypatch):
    """The shipped quickstart config runs two rollouts through the CLI as written (its data/sim paths
    answered by a small make-data directory), only the policy (and critic) swapped for the tiny one: the
    episodes, their gold and the checkpoint are there."""
    from alignlit.cli import main

    monkeypatch.chdir(tmp_path)
    make_data("data/sim", n_sft=4, n_pairs=2, n_prompts=8, n_val=4, n_test=2)
    critic = [f"--model.init_args.critic={tiny_policy_dir}", "--model.init_args.critic_pretrain_rollouts=1"]
    main(
        [
            "fit",
            "--config",
            str(ROOT / f"configs/quickstart/{name}.yaml"),
            f"--model.init_args.policy={tiny_policy_dir}",
            *(critic if name.startswith("ppo") else []),
            "--model.init_args.export_dir=export",
            "--data.init_args.batch_size=2",
            "--data.init_args.eval_batch_size=4",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.val_check_interval=2",
        ]
    )
    assert (tmp_path / "export" / "config.json").exists()
    curves = next((tmp_path / "out" / "quickstart" / "logs").rglob("*_curves.json"))
    history = json.loads(curves.read_text())
    train = [h for h in history if "episode/turns" in h and "time/train_s" in h]
    assert len(train) == 2 and all(1 <= h["episode/turns"] <= 2 for h in train)
    assert len([h for h in history if "val/gold" in h]) == 2  # before training and after 2 rollouts
    assert (tmp_path / f"out/quickstart/checkpoints/{name}/last.ckpt").exists()
