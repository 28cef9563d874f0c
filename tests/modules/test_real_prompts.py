"""GSM8K prompts through an online stage: chat-rendered Prompts carry their answers through the rollout
loop, the asynchronous pipeline (a worker process, prompts generated ahead and saved in checkpoints) and a
resume, which is exact."""

from __future__ import annotations

import gzip
import json

import lightning as L
import torch

from alignlit.data import Prompt, PromptDataModule
from alignlit.modules import Minibatches, Optim, PolicyGradientModule
from alignlit.rollout import RolloutLoop, SamplingParams
from tests.hubcache import GSM8K_TRAIN, snapshot_dir

GOLD = {}
CALLS: list[tuple[list[str], list[str]]] = []


def answer_reward(prompts, responses, answer):
    """Records what reached it; 1.0 when the response holds the answer's last digit (cheap, varies)."""
    CALLS.append(([p.fields["answer"] for p in prompts], list(answer)))
    return [float(a.strip()[-1] in r) for a, r in zip(answer, responses)]


def grpo(policy):
    return PolicyGradientModule(
        policy=policy, reward=answer_reward, optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=4), samples_per_prompt=2, max_staleness=1),
        minibatches=Minibatches(size=4),
    )  # fmt: skip


def data():
    return PromptDataModule(
        dataset={"path": "json", "data_files": str(GSM8K_TRAIN), "split": "train[:8]"},
        columns={"question": "prompt"}, chat=True, system_prompt="Answer after ####.", batch_size=2,
    )  # fmt: skip


def fit(module, root, *, ckpt_path=None):
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)],
    )  # fmt: skip
    trainer.fit(module, data(), ckpt_path=ckpt_path)


def test_gsm8k_prompts_async_carry_answers_and_resume_exactly(hub_cache, tmp_path):
    with gzip.open(GSM8K_TRAIN, "rt") as f:
        rows = [json.loads(next(f)) for _ in range(8)]
    answers = {r["question"]: r["answer"] for r in rows}
    policy = str(snapshot_dir(hub_cache))
    CALLS.clear()
    straight = grpo(policy)
    fit(straight, tmp_path / "a")
    assert len(CALLS) == 4
    for carried, given in CALLS:  # the answer column reached the reward row for row, from the worker too
        assert carried == given and all(a in answers.values() for a in given)
    saved = {}
    for path in (tmp_path / "a" / "ckpt").iterdir():
        state = torch.load(path, weights_only=True)[f"{straight.stage}_state"]
        saved[state["rollout"]["rollouts"]] = (path, state)
    path, state = saved[2]
    ahead = [e for e in state["ahead"].values()]
    prompts = ahead[0]["result"]["experience"]["rollout"]["prompts"]
    assert isinstance(prompts[0], Prompt) and prompts[0].fields["answer"] in answers.values()
    assert prompts[0].startswith("<|im_start|>system\nAnswer after ####.")
    resumed = grpo(policy)
    fit(resumed, tmp_path / "b", ckpt_path=str(path))
    assert all(
        torch.equal(x, y)
        for x, y in zip(straight.policy.state_dict().values(), resumed.policy.state_dict().values())
    )
