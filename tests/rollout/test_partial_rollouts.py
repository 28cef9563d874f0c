"""Partial rollouts (``rollout.partial``): every token's version is exactly the segment schedule (hand-computed),
its behaviour log-prob is that version's, a row that ends in segment 0 keeps the oldest version only, the
staleness bound holds per token, a pipeline resumed from its drained state equals the uninterrupted one, and
the settings it cannot serve are refused naming the key."""

from __future__ import annotations

import json
import random
import time
from typing import ClassVar

import pytest
import torch

from alignlit.modules import Minibatches, Optim, PolicyGradientModule
from alignlit.ops import DynamicSampling
from alignlit.rollout import RolloutLoop, SamplingParams
from alignlit.rollout.partial import PartialBatch, SegmentedPipeline, segment_step
from alignlit.rollout.pipeline import WeightSnapshot
from alignlit.rollout.postprocess import RawSample, assemble_rollout, encode_prompts, pad_prompt_ids

K, L, MAX_NEW = 2, 2, 5
TARGETS = {"end": 1, "mid": 4, "long": 99}
"""Each prompt's response length in the fake engine: EOS as token 1 (segment 0), EOS as token 4 (segment 1),
never (cut at ``MAX_NEW`` = 5 tokens in segment 2)."""


def version_of(step: int) -> int:
    return 10 + step  # versions distinct from steps: a mix-up of the two fails


class FakeEngine:
    """Token ``p`` of a response is ``100 + p`` (EOS at the prompt's target length), with log-prob
    ``-version / 100`` of the weights it holds: what a segment was sampled with is read off its tokens."""

    def __init__(self, tokenizer, delay: float = 0.0):
        self.tokenizer, self.version, self.delay = tokenizer, None, delay

    prompts: ClassVar[dict[tuple[int, ...], int]] = {}
    """Prompt ids -> target length, of every engine (a resumed one continues prompts it never saw)."""

    def load(self, snapshot: WeightSnapshot) -> None:
        self.version = snapshot.version

    def _sample(self, prompt: tuple[int, ...], done: int, budget: int) -> RawSample:
        target = self.prompts[prompt]
        ids = [100 + p for p in range(done, min(done + budget, target))]
        if done + len(ids) == target:
            ids[-1] = self.tokenizer.eos_token_id
        return RawSample(ids, [-self.version / 100] * len(ids), ended_early=done + len(ids) == target)

    def generate(self, prompts, n, sampling):
        ids, mask = encode_prompts(self.tokenizer, prompts)
        rows = [tuple(ids[i][mask[i]].tolist()) for i in range(len(prompts))]
        self.prompts.update({r: TARGETS[p.split()[-1]] for r, p in zip(rows, prompts)})
        samples = [self._sample(r, 0, sampling.max_new_tokens) for r in rows for _ in range(n)]
        return assemble_rollout(self.tokenizer, prompts, n, ids, mask, samples, stop=[], eos_ids=set())

    def generate_from_ids(self, history, n, sampling):
        time.sleep(self.delay * random.random())
        samples = []
        for h in history:
            prompt = next(p for p in self.prompts if tuple(h[: len(p)]) == p)
            samples.append(self._sample(prompt, len(h) - len(prompt), sampling.max_new_tokens))
        texts, ids, mask = pad_prompt_ids(self.tokenizer, history)
        return assemble_rollout(self.tokenizer, texts, n, ids, mask, samples, stop=[], eos_ids=set())


def start(tokenizer, delay=0.0, state=None):
    engine = FakeEngine(tokenizer, delay)
    sampling = SamplingParams(max_new_tokens=MAX_NEW)

    def segment(batch, version):
        batch.run_segment(
            engine, tokenizer, n=1, sampling=sampling, length=L, version=version, seed=batch.index
        )

    def finish(batch):
        return batch.rollout(tokenizer, n=1, sampling=sampling)[0]

    pipeline = SegmentedPipeline(engine.load, segment, finish)
    if state is not None:
        pipeline.restore({}, *state)
    return pipeline


def run_steps(pipeline, steps, last, taken):
    """What the ahead-collector does at each step: publish the step's weights, admit the batches up to k
    ahead, take the step's batch."""
    for index in steps:
        pipeline.publish(WeightSnapshot(version_of(index), {}), step=index)
        for j in range(index, min(index + K, last) + 1):
            if j not in pipeline.submitted:
                pipeline.submit(j, [f"p{j} end", f"p{j} mid", f"p{j} long"], version_of(index), step=index)
        taken[index] = pipeline.take(index)


def test_every_token_carries_its_segments_version_and_log_prob(tokenizer):
    """k = 2, segments of 2 tokens, 5 new tokens at most. Batch j is admitted at step a_j = max(0, j - 2);
    its segment s uses the weights of step min(j, a_j + s). Hand-computed (versions 10 + step):
    batch 1: [10], [10 10 11 11], [10 10 11 11 11]; batch 3: [11], [11 11 12 12], [11 11 12 12 13]."""
    pipeline, taken = start(tokenizer, delay=0.01), {}
    try:
        run_steps(pipeline, range(6), 5, taken)
    finally:
        pipeline.close()
    expected = {
        0: [[10], [10] * 4, [10] * 5],
        1: [[10], [10, 10, 11, 11], [10, 10, 11, 11, 11]],
        2: [[10], [10, 10, 11, 11], [10, 10, 11, 11, 12]],
        3: [[11], [11, 11, 12, 12], [11, 11, 12, 12, 13]],
        4: [[12], [12, 12, 13, 13], [12, 12, 13, 13, 14]],
        5: [[13], [13, 13, 14, 14], [13, 13, 14, 14, 15]],
    }
    for j, rows in expected.items():
        rollout = taken[j]
        assert rollout.response_lengths.tolist() == [1, 4, 5]
        assert rollout.finish_reasons == ["stop", "stop", "length"]
        for i, versions in enumerate(rows):
            assert rollout.token_versions[i, : len(versions)].tolist() == versions, (j, i)
            assert (rollout.token_versions[i, len(versions) :] == 0).all()  # padded like the log-probs
            assert rollout.logprobs[i, : len(versions)].tolist() == pytest.approx(
                [-v / 100 for v in versions]
            )
            assert rollout.response_ids[i, : len(versions) - 1].tolist() == list(
                range(100, 99 + len(versions))
            )
        staleness = version_of(j) - rollout.token_versions[rollout.response_mask]
        assert int(staleness.min()) >= 0 and int(staleness.max()) == min(j, K)  # the bound, reached


def test_the_schedule():
    assert [segment_step(0, 0, s) for s in range(3)] == [0, 0, 0]
    assert [segment_step(1, 0, s) for s in range(3)] == [0, 1, 1]
    assert [segment_step(5, 3, s) for s in range(4)] == [3, 4, 5, 5]


def test_a_drained_pipeline_resumes_where_it_stopped(tokenizer):
    """Steps 0-2, drain (batches 3 and 4 in progress, their segments of steps <= 2 sampled), a new pipeline
    from that state runs steps 3-5: the same rollouts as the uninterrupted pipeline. The state goes through
    PartialBatch.state_dict and back, as in a checkpoint."""
    straight, a = start(tokenizer), {}
    try:
        run_steps(straight, range(6), 5, a)
    finally:
        straight.close()
    first, b = start(tokenizer, delay=0.01), {}
    try:
        run_steps(first, range(3), 5, b)
        assert first.drain() == {}
        batches = {j: PartialBatch.from_state(x.state_dict()) for j, x in first.batches.items()}
        versions = dict(first.submitted)
    finally:
        first.close()
    assert sorted(batches) == [3, 4] and [batches[j].segment for j in (3, 4)] == [2, 1]
    resumed = start(tokenizer, state=(versions, batches))
    try:
        run_steps(resumed, range(3, 6), 5, b)
    finally:
        resumed.close()
    for j in range(6):
        assert torch.equal(a[j].response_ids, b[j].response_ids) and torch.equal(a[j].logprobs, b[j].logprobs)
        assert torch.equal(a[j].token_versions, b[j].token_versions)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"partial": 0, "max_staleness": 1}, r"rollout.partial .* must be an integer >= 1"),
        ({"partial": 2}, r"rollout.partial \(2\) .* rollout.max_staleness 0"),
        (
            {"partial": 2, "max_staleness": 1, "engine": "vllm"},
            r"rollout.partial \(2\) generates in segments with the HF engine only",
        ),
    ],
)
def test_settings_it_cannot_serve_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutLoop(**kwargs)


def test_dynamic_sampling_is_refused(tiny_policy_dir):
    with pytest.raises(ValueError, match=r"unset rollout.partial \(2\) or dynamic_sampling"):
        PolicyGradientModule(
            policy=str(tiny_policy_dir), reward=lambda p, r: [0.0] * len(r), dynamic_sampling=DynamicSampling(),
            rollout=RolloutLoop(samples_per_prompt=2, max_staleness=1, partial=2),
        )  # fmt: skip


# ---------------------------------------------------------------------- a training run
def char_reward(prompts, responses):
    return [r.count("a") - 0.1 * len(r) for r in responses]


def test_a_grpo_run_trains_on_tokens_of_the_scheduled_versions(tiny_policy_dir, tmp_path):
    """GRPO at k = 2, segments of 2 of 5 tokens, 5 steps: each batch's tokens carry exactly the versions of
    the schedule (version = step here), their behaviour log-probs are those of that version's weights (a
    teacher-forced forward of the snapshot), and the per-token staleness is logged and within the bound."""
    import lightning as L_

    from alignlit.data import PromptDataModule
    from alignlit.models.forward import response_logprobs
    from tests.modules.test_async import PROMPTS

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    module = PolicyGradientModule(
        policy=str(tiny_policy_dir), reward=char_reward, optim=Optim(lr=1e-2, min_lr_ratio=1.0),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=MAX_NEW), samples_per_prompt=2,
                            max_staleness=K, partial=L),
        minibatches=Minibatches(size=4),
    )  # fmt: skip
    snapshots, rollouts = {}, {}
    snapshot, finish = module.rollout.snapshot, module.ahead.finish

    def record_snapshot(version):
        snapshots[version] = snapshot(version)
        return snapshots[version]

    def record_finish(batch):
        result = finish(batch)
        rollouts[batch.index] = result[0].rollout
        return result

    module.rollout.snapshot, module.ahead.finish = record_snapshot, record_finish
    trainer = L_.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=5, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(train_file=str(prompts_file), batch_size=2))
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert [h["async/token_staleness_max"] for h in train] == [0, 1, 2, 2, 2]
    assert all(0 <= h["async/token_staleness_mean"] <= h["async/token_staleness_max"] for h in train)
    assert sorted(rollouts) == list(range(5))
    model = snapshot_model(tiny_policy_dir)
    for j, rollout in rollouts.items():
        admitted = max(0, j - K)
        for i, length in enumerate(rollout.response_lengths.tolist()):
            expected = [segment_step(j, admitted, p // L) for p in range(length)]
            assert rollout.token_versions[i, :length].tolist() == expected, (j, i)
        for version in set(rollout.token_versions[rollout.response_mask].tolist()):
            model.load_state_dict(snapshots[version].state, strict=True)
            with torch.no_grad():
                teacher = response_logprobs(
                    model,
                    rollout.prompt_ids,
                    rollout.prompt_mask,
                    rollout.response_ids,
                    rollout.response_mask,
                )
            mine = rollout.response_mask & (rollout.token_versions == version)
            assert (teacher[mine] - rollout.logprobs[mine]).abs().max() < 1e-4, (j, version)
    assert not all(torch.equal(snapshots[0].state[k], snapshots[2].state[k]) for k in snapshots[0].state)


def snapshot_model(policy_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir).eval()


def test_the_rollout_correction_weighs_each_token_against_its_own_behaviour_log_prob(tokenizer):
    """A partial rollout's tokens carry the log-probs of different versions: TIS's weight of every token is
    min(exp(π_old - μ_t), cap) with that token's μ_t (computed here from a separate forward), not one
    sample-level μ."""
    from alignlit.models import make_tiny_llama
    from alignlit.models.forward import response_logprobs
    from alignlit.modules.trajectory_maker import TrajectoryMaker, resolve_correction
    from alignlit.rollout import HFEngine
    from alignlit.rollout.base import Experience
    from tests.conftest import TINY

    policy = make_tiny_llama(tokenizer, seed=0, **TINY)
    rollout = HFEngine(tokenizer, policy).generate(
        ["a b", "c d e"], 2, SamplingParams(max_new_tokens=6, seed=1)
    )
    mask = rollout.response_mask
    rollout.token_versions = (torch.arange(mask.shape[1]) // 2).expand_as(mask) * mask  # segments of 2
    rollout.logprobs = (rollout.logprobs - 0.3 * rollout.token_versions) * mask  # μ_t of older weights
    maker = TrajectoryMaker(
        policy,
        policy,
        temperature=1.0,
        task_rewards=lambda r, s: s,
        correction=resolve_correction(2.0, None, None, "recompute"),
    )
    experience = Experience(rollout, torch.zeros(len(rollout)), torch.zeros(len(rollout), dtype=torch.long))
    traj, _ = maker.make(experience, version=3, device=torch.device("cpu"))
    with torch.no_grad():
        old = response_logprobs(policy, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, mask)
    expected = torch.exp(old - rollout.logprobs).clamp(max=2.0)
    assert torch.allclose(traj.is_weights[mask], expected[mask], atol=1e-5)
    assert len(set(traj.is_weights[0][mask[0]].tolist())) > 1  # the weights differ within one sample
