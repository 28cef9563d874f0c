"""Asynchronous rollouts (``rollout.max_staleness``): staleness 0 through the pipeline equals the
synchronous loop bit for bit, the bound holds on every batch with pinned versions, the prompts of later
steps are the loader's, and a run resumed from any checkpoint equals the uninterrupted one bit for bit
(GRPO with dynamic sampling, PPO, online DPO; with partial rollouts also online RRHF and distillation)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import lightning as L
import pytest
import torch

from alignlit.data import PromptDataModule
from alignlit.modules import (
    KLPenalty,
    Minibatches,
    OnlineDPOModule,
    OnlineRRHFModule,
    Optim,
    PolicyGradientModule,
    PPOModule,
)
from alignlit.ops import DynamicSampling
from alignlit.rollout import RolloutLoop, SamplingParams
from tests.helpers import char_reward, op_prompts

PROMPTS = op_prompts(12)
VARYING = (
    "time/",
    "rollout/sync_s",
    "rollout/generate_s",
    "rollout/tokens_per_s",
    "rollout/score_s",
    "async/wait_s",
)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("async") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def grpo(policy_dir, k, partial=None, **kwargs):
    return PolicyGradientModule(
        policy=str(policy_dir), reward=char_reward, optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=2, max_staleness=k,
                            partial=partial),
        minibatches=Minibatches(size=4), **kwargs,
    )  # fmt: skip


def fit(module, prompts_file, root, *, steps_per_epoch=3, epochs=2, ckpt_path=None, checkpoint=False):
    callbacks = []
    if checkpoint:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1, save_last=False
            )
        )
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=epochs, limit_train_batches=steps_per_epoch, limit_val_batches=0,
        logger=False, enable_checkpointing=checkpoint, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(train_file=str(prompts_file), batch_size=2), ckpt_path=ckpt_path)
    return trainer


def stable(history):
    return [{k: v for k, v in h.items() if not k.startswith(VARYING)} for h in history]


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_staleness_zero_through_the_pipeline_equals_the_synchronous_loop(
    tiny_policy_dir, prompts_file, tmp_path
):
    """The same run twice: the synchronous loop, and every rollout taken from the pipeline (its worker
    process, snapshots, queue) with a lookahead of 0. Same samples, so the same weights and history (the
    trainer on one thread, as the worker: the engine's log-probs then agree to the last bit too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        staleness_zero_equals_sync(tiny_policy_dir, prompts_file, tmp_path)
    finally:
        torch.set_num_threads(threads)


def staleness_zero_equals_sync(tiny_policy_dir, prompts_file, tmp_path):
    sync = grpo(tiny_policy_dir, 0)
    fit(sync, prompts_file, tmp_path / "sync")
    piped = grpo(tiny_policy_dir, 0)
    piped.collect = piped.collect_ahead  # force the asynchronous machinery at staleness 0
    fit(piped, prompts_file, tmp_path / "piped")
    assert same_weights(sync.policy, piped.policy)
    assert [
        {k: v for k, v in h.items() if not k.startswith("async/")} for h in stable(piped.progress.history)
    ] == stable(sync.progress.history)
    assert all(h["async/staleness_max"] == 0 for h in piped.progress.history if "async/staleness_max" in h)


def test_the_bound_holds_with_pinned_versions(tiny_policy_dir, prompts_file, tmp_path):
    """k = 2 over 6 steps: step j trains on samples from the weights at the start of step j - 2 (step 0's
    for the first two), so the staleness is 0, 1, 2, 2, 2, 2, never more; the policy changed meanwhile."""
    module = grpo(tiny_policy_dir, 2)
    fit(module, prompts_file, tmp_path)
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert [h["async/staleness_max"] for h in train] == [0, 1, 2, 2, 2, 2]
    assert [h["async/staleness_mean"] for h in train] == [0, 1, 2, 2, 2, 2]
    assert [h["policy/version"] for h in train] == [1, 2, 3, 4, 5, 6]
    assert any("async/mismatch_kl_s2" in h for h in train)  # the stale samples' mismatch, by staleness
    assert not any("async/token_staleness_max" in h for h in train)  # rollout.partial unset: whole rollouts
    assert module.rollout.pipeline is None and module.rollout.async_engine is None  # stopped at the end


def test_the_producer_thread_never_calls_into_the_modules(tiny_policy_dir, prompts_file, tmp_path):
    """k = 1: the reward, called in the producer thread for the batches generated ahead, sees a call stack of
    the rollout side only (alignlit.rollout: the ahead-collector, the collector, the loop), never a frame of
    alignlit.modules (the LightningModule)."""
    import threading

    stacks = []

    def reward(prompts, responses):
        if threading.current_thread() is not threading.main_thread():
            frame, names = sys._getframe(), []
            while frame is not None:
                names.append(frame.f_globals.get("__name__", ""))
                frame = frame.f_back
            stacks.append(names)
        return char_reward(prompts, responses)

    module = grpo(tiny_policy_dir, 1)
    module.collector.reward = reward  # what scores the training rollouts, in either thread
    fit(module, prompts_file, tmp_path, steps_per_epoch=3, epochs=1)
    assert stacks, "no batch was scored in the producer thread"
    assert all("alignlit.rollout.ahead" in names for names in stacks)
    assert not [n for names in stacks for n in names if n.startswith("alignlit.modules")]


def test_the_loader_must_agree_with_the_schedule(tiny_policy_dir, prompts_file, tmp_path):
    """The pipeline generates later steps' prompts from the loader's sampler; a step whose prompts differ
    (here a loader that is not alignlit's resumable one) is refused, not trained on other samples."""
    module = grpo(tiny_policy_dir, 1)
    loader = torch.utils.data.DataLoader(PROMPTS, batch_size=2, collate_fn=list)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match="needs alignlit's resumable prompt loader"):
        trainer.fit(module, train_dataloaders=loader)
    module.rollout.stop_pipeline()


def test_a_lora_policy_trained_asynchronously_samples_from_its_updated_adapter(
    tiny_policy_dir, prompts_file, tmp_path
):
    """GRPO with a LoRA policy at k = 1, 3 steps (verl #7495: under async the adapter never reached the
    engine). The worker loads each version's merged weights; version 1 (after one real optimiser step of the
    adapter) differs from version 0, and step 2's rollout, generated ahead from version 1, carries the
    log-probs of version 1's merged weights (a teacher-forced forward of the snapshot), far from version 0's."""
    from transformers import AutoModelForCausalLM

    from alignlit.models.lora import LoRA
    from alignlit.rollout import logprob_parity

    module = PolicyGradientModule(
        policy=str(tiny_policy_dir), reward=char_reward, optim=Optim(lr=1e-2, min_lr_ratio=1.0),
        lora=LoRA(rank=4), minibatches=Minibatches(size=4),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=2, max_staleness=1),
    )  # fmt: skip
    snapshots, rollouts = {}, {}
    snapshot, produce = module.rollout.snapshot, module.ahead.produce

    def record_snapshot(version):
        snapshots[version] = snapshot(version)
        return snapshots[version]

    def record_rollout(index, prompts, version):
        result = produce(index, prompts, version)
        rollouts[index] = (version, result[0].rollout)
        return result

    module.rollout.snapshot, module.ahead.produce = record_snapshot, record_rollout
    fit(module, prompts_file, tmp_path, epochs=1)
    assert sorted(snapshots) == [0, 1] and rollouts[2][0] == 1
    assert not any("lora_" in name for name in snapshots[1].state)  # merged, under the base model's names
    assert not all(torch.equal(snapshots[0].state[k], snapshots[1].state[k]) for k in snapshots[0].state)
    diffs = {}
    for version in (0, 1):
        model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).eval()
        model.load_state_dict(snapshots[version].state, strict=True)
        diffs[version] = logprob_parity(model, rollouts[2][1], temperature=1.0, max_samples=4)["max_abs_diff"]
    assert diffs[1] < 1e-4 and diffs[0] > 1e-2, diffs


def test_the_parity_model_of_loaded_snapshots_has_a_config_of_its_own(tokenizer):
    """vLLM at k >= 1 checks each loaded snapshot with a teacher-forced forward in the producer thread while
    the trainer trains; a packed trainer forward sets the policy config's attention function while it runs,
    so a parity model sharing that config ran the packed attention outside a packed forward and failed
    ("alignlit_grouped attention runs only inside alignlit's packed forwards", seen in bench_async)."""
    from alignlit.models import make_tiny_llama
    from alignlit.models.hf_internals import attention_implementation, use_attention
    from tests.conftest import TINY

    class LoadsState:  # the part of the vLLM engine the pipeline uses
        def load_state(self, state):
            pass

    policy = make_tiny_llama(tokenizer, seed=0, **TINY)
    loop = RolloutLoop(engine="vllm", max_staleness=1, parity_every=1)
    loop.engine, loop.policy, loop.tokenizer = LoadsState(), policy, tokenizer
    loop.start_pipeline(lambda index, prompts, version: None)
    try:
        parity = loop._parity_model
        before = attention_implementation(parity.config)
        with use_attention(policy.config, "alignlit_test_packed", lambda *a, **k: None):  # a packed forward
            assert attention_implementation(policy.config) == "alignlit_test_packed"
            assert attention_implementation(parity.config) == before != "alignlit_test_packed"
    finally:
        loop.stop_pipeline()


def ppo(policy_dir, k, partial=None):
    return PPOModule(
        policy=str(policy_dir), reward=char_reward, critic=str(policy_dir), kl=KLPenalty(target=1.0, horizon=20),
        optim=Optim(lr=1e-3, min_lr_ratio=1.0), critic_optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=5), max_staleness=k, partial=partial),
        minibatches=Minibatches(size=2, epochs=2),
    )  # fmt: skip


def online_pairs(cls, policy_dir, k, partial=None):
    """Online DPO or online RRHF (``cls``): 3 samples per prompt, the same settings for both."""
    return cls(
        policy=str(policy_dir), reward=char_reward, optim=Optim(lr=1e-3, min_lr_ratio=1.0), train_max_length=40,
        train_max_prompt_length=24,
        rollout=RolloutLoop(
            sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=3, max_staleness=k, partial=partial
        ),
        minibatches=Minibatches(size=2, epochs=2),
    )  # fmt: skip


def distill(policy_dir, k, partial=None):
    """On-policy distillation (GRPO with a teacher): the teacher is the starting policy, frozen and reloaded
    from disk, so its signal is zero only at the first step."""
    return grpo(policy_dir, k, partial=partial, teacher=str(policy_dir), teacher_coef=0.5, task_coef=1.0)


STAGES = {
    "grpo-dynamic-sampling": lambda d: grpo(d, 1, dynamic_sampling=DynamicSampling(max_tries=2)),
    "grpo-partial": lambda d: grpo(
        d, 1, partial=2
    ),  # batch 4 in progress at the checkpoint (rollout.partial)
    "ppo": lambda d: ppo(d, 1),
    "ppo-partial": lambda d: ppo(d, 1, partial=2),
    "online-dpo": lambda d: online_pairs(OnlineDPOModule, d, 1),
    "online-dpo-partial": lambda d: online_pairs(OnlineDPOModule, d, 1, partial=2),
    "online-rrhf-partial": lambda d: online_pairs(OnlineRRHFModule, d, 1, partial=2),
    "distill-partial": lambda d: distill(d, 1, partial=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_resume_is_exact(stage, tiny_policy_dir, prompts_file, tmp_path):
    """k = 1, 6 steps over 2 epochs, a checkpoint after every step: resumed from the one after step 4 (mid
    second epoch: batches 5 and 6 generated ahead or in flight at that moment; with partial rollouts the next
    batch half generated, its first segment from the weights before the checkpoint), the run ends with the
    uninterrupted run's weights and history, bit for bit."""
    straight = STAGES[stage](tiny_policy_dir)
    fit(straight, prompts_file, tmp_path / "a", checkpoint=True)
    by_step = {}
    for path in (tmp_path / "a" / "ckpt").iterdir():
        saved = torch.load(path, weights_only=True)
        state = saved[f"{straight.stage}_state"]
        by_step[state["rollout"]["rollouts"]] = path
        if state["rollout"]["rollouts"] == 4:
            assert sorted(state["ahead"]) == [4]  # the batch generated ahead, saved with the checkpoint
            if stage.endswith(
                "-partial"
            ):  # in progress: segment 0 sampled, the rest waits for step 4's weights
                assert state["ahead"][4]["partial"]["segment"] == 1
    resumed = STAGES[stage](tiny_policy_dir)
    fit(resumed, prompts_file, tmp_path / "b", ckpt_path=str(by_step[4]))
    assert same_weights(straight.policy, resumed.policy)
    assert stable(resumed.progress.history) == stable(straight.progress.history)
    assert resumed.progress.policy_version == straight.progress.policy_version


def alignlit_fit(tmp_path, policy_dir, prompts_file, *extra) -> list[str]:
    """The shipped asynchronous GRPO config on the tiny model: 6 rollouts of 2 prompts, a checkpoint after
    each (the config's own callback), the reward by dotted path, no ptx, no validation."""
    root = pathlib.Path(__file__).resolve().parents[2]
    return [
        sys.executable, "-m", "alignlit.cli", "fit", "--config", str(root / "configs/quickstart/grpo.yaml"), "--config", str(root / "configs/async/grpo.yaml"),
        f"--model.init_args.policy={policy_dir}", "--model.init_args.reward=tests.modules.test_async.char_reward",
        "--model.init_args.gold=null", "--model.init_args.ptx=null", "--model.init_args.export_dir=export",
        "--model.init_args.rollout.sampling.max_new_tokens=5", "--model.init_args.rollout.samples_per_prompt=2",
        "--model.init_args.minibatches.size=4", "--model.init_args.optim.lr=1e-3",
        f"--data.init_args.train_file={prompts_file}", "--data.init_args.val_file=null",
        "--data.init_args.batch_size=2", "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0", *extra,
    ]  # fmt: skip


class KillAt(L.Callback):
    """Test-only: SIGKILL the run's process group (the trainer and its rollout worker) at a chosen point of
    rollout ``step`` (counted from 0): ``generating`` (the step starts: its batch may still be generated,
    the next one is generated ahead), ``updating`` (the step's first optimiser step) or ``checkpointing``
    (a timer of ``delay_ms`` started when the checkpoint after the step is being built: the kill lands in the
    state gathering, the atomic write or just after it)."""

    def __init__(self, step: int, phase: str, delay_ms: float = 0.0) -> None:
        self.step, self.phase, self.delay_ms = step, phase, delay_ms

    def _kill(self) -> None:
        import signal

        os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.phase == "generating" and batch_idx == self.step:
            self._kill()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if (
            self.phase == "updating"
            and trainer.fit_loop.epoch_loop.batch_progress.current.ready == self.step + 1
        ):
            self._kill()  # the step's first minibatch: its gradient is computed, the weights not yet changed

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        import threading

        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if self.phase == "checkpointing" and ready == self.step + 1 and not getattr(self, "armed", False):
            self.armed = True
            threading.Timer(self.delay_ms / 1000, self._kill).start()


def kill_points(seed: int) -> list[tuple[int, str, float]]:
    """One kill point per phase, the steps and the timer drawn from ``seed`` (printed on failure)."""
    import random

    rng = random.Random(seed)
    return [
        (rng.randint(2, 4), phase, rng.uniform(0.0, 50.0))
        for phase in ("generating", "updating", "checkpointing")
    ]


@pytest.mark.slow
def test_kill_9_at_a_random_point_and_resume_is_exact(tiny_policy_dir, prompts_file, tmp_path):
    """An uninterrupted run against runs SIGKILLed (with the worker) at a point drawn at random in each
    phase (generating ahead, updating, writing a checkpoint), each resumed from its last.ckpt with the same
    command: every export is identical to the uninterrupted run's, bit for bit. The kill points are drawn
    from a seed that the failure message names, so a failure can be replayed."""
    import subprocess

    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    straight = tmp_path / "straight"
    straight.mkdir()
    subprocess.run(alignlit_fit(straight, tiny_policy_dir, prompts_file), cwd=straight, env=env, check=True,
                   capture_output=True, timeout=900)  # fmt: skip
    a = load_file(straight / "export" / "model.safetensors")

    seed = int(os.environ.get("ALIGNLIT_KILL_SEED", time.time()))
    for step, phase, delay_ms in kill_points(seed):
        where = f"seed {seed}: killed at step {step}, {phase} (+{delay_ms:.0f} ms)"
        killed = tmp_path / f"killed-{phase}"
        killed.mkdir()
        last = killed / "out/quickstart/checkpoints/grpo-async/last.ckpt"
        callback = json.dumps({"class_path": "tests.modules.test_async.KillAt",
                               "init_args": {"step": step, "phase": phase, "delay_ms": delay_ms}})  # fmt: skip
        process = subprocess.run(alignlit_fit(killed, tiny_policy_dir, prompts_file, f"--trainer.callbacks+={callback}"),
                                 cwd=killed, env=env, capture_output=True, timeout=900, start_new_session=True)  # fmt: skip
        assert process.returncode == -9, f"{where}: the run was not killed ({process.returncode})"
        assert last.exists(), f"{where}: no checkpoint before the kill"
        done = torch.load(last, weights_only=True)["policy_gradient_state"]["rollout"]["rollouts"]
        assert 1 <= done < 6, f"{where}: killed after {done} of 6 rollouts"
        subprocess.run(alignlit_fit(killed, tiny_policy_dir, prompts_file, f"--ckpt_path={last}"), cwd=killed,
                       env=env, check=True, capture_output=True, timeout=900)  # fmt: skip
        b = load_file(killed / "export" / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), where
