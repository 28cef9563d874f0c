"""The rollout pipeline of asynchronous RL: pinned versions, nothing dropped, errors surfaced, drain and
restore; the HF worker engine: the samples of an in-process engine on the same weights, weight syncs
verified by checksum (a sync that does nothing is an error), LoRA merged."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from alignlit.models import make_tiny_llama
from alignlit.rollout import HFEngine, SamplingParams
from alignlit.rollout.hf_worker import HFWorkerEngine, WeightSyncError, state_checksum
from alignlit.rollout.pipeline import RolloutPipeline, WeightSnapshot
from tests.conftest import TINY
from tests.helpers import TWO_PROMPTS as PROMPTS


class FakeEngine:
    """Records which weights each batch was produced with; ``delay`` slows the producer down."""

    def __init__(self, delay: float = 0.0):
        self.version, self.loads, self.delay = None, [], delay

    def load(self, snapshot: WeightSnapshot) -> None:
        self.version = snapshot.version
        self.loads.append(snapshot.version)

    def produce(self, index, prompts, version):
        time.sleep(self.delay)
        return {"index": index, "prompts": prompts, "engine_version": self.version, "asked": version}


def test_batches_come_from_their_pinned_version_in_order():
    """Batches 0..3 submitted at versions 0, 0, 1, 2 (a lookahead of 1): each is produced by an engine holding
    exactly its version, weights are loaded only when the version changes, nothing is dropped."""
    engine = FakeEngine(delay=0.01)
    pipeline = RolloutPipeline(engine.load, engine.produce)
    try:
        pipeline.publish(WeightSnapshot(0, {}))
        pipeline.submit(0, ["a"], 0)
        pipeline.submit(1, ["b"], 0)
        got = [pipeline.take(0)]
        pipeline.publish(WeightSnapshot(1, {}))
        pipeline.submit(2, ["c"], 1)
        got.append(pipeline.take(1))
        pipeline.publish(WeightSnapshot(2, {}))
        pipeline.submit(3, ["d"], 2)
        got += [pipeline.take(2), pipeline.take(3)]
    finally:
        pipeline.close()
    assert [(g["index"], g["engine_version"], g["asked"]) for g in got] == [
        (0, 0, 0),
        (1, 0, 0),
        (2, 1, 1),
        (3, 2, 2),
    ]
    assert engine.loads == [0, 1, 2] and pipeline.submitted == {} and pipeline.waited_s > 0
    assert set(pipeline.snapshots) == {2}  # old versions are released once no batch needs them


def test_submit_needs_a_published_version_and_each_index_once():
    engine = FakeEngine()
    pipeline = RolloutPipeline(engine.load, engine.produce)
    try:
        with pytest.raises(KeyError, match="version 3, which was never published"):
            pipeline.submit(0, ["a"], 3)
        pipeline.publish(WeightSnapshot(3, {}))
        pipeline.submit(0, ["a"], 3)
        with pytest.raises(ValueError, match="batch 0 was submitted already"):
            pipeline.submit(0, ["a"], 3)
        with pytest.raises(KeyError, match="batch 5 was never submitted"):
            pipeline.take(5)
    finally:
        pipeline.close()


def test_a_producer_error_reaches_the_trainer_with_the_batch():
    def produce(index, prompts, version):
        raise ValueError("reward returned a string")

    pipeline = RolloutPipeline(lambda snapshot: None, produce)
    try:
        pipeline.publish(WeightSnapshot(0, {}))
        pipeline.submit(0, ["a"], 0)
        with pytest.raises(RuntimeError, match=r"failed while generating batch 0 \(version 0\)") as caught:
            pipeline.take(0)
        assert isinstance(caught.value.__cause__, ValueError)
        with pytest.raises(RuntimeError, match="failed while generating batch 0"):
            pipeline.submit(1, ["b"], 0)  # a failed producer takes no more work
    finally:
        pipeline.close()


def test_drain_returns_finished_batches_and_restore_puts_them_back():
    """drain waits for the queued batches (what a checkpoint saves); a new pipeline restored from them hands
    out the same results without producing them again."""
    engine = FakeEngine(delay=0.02)
    pipeline = RolloutPipeline(engine.load, engine.produce)
    pipeline.publish(WeightSnapshot(4, {}))
    for index in (5, 6):
        pipeline.submit(index, [f"p{index}"], 4)
    finished = pipeline.drain()
    versions = dict(pipeline.submitted)
    pipeline.close()
    assert sorted(finished) == [5, 6] and versions == {5: 4, 6: 4}

    calls = []
    restored = RolloutPipeline(engine.load, lambda *args: calls.append(args))
    try:
        restored.restore(finished, versions)
        assert restored.take(5)["prompts"] == ["p5"] and restored.take(6)["index"] == 6
        assert calls == []
    finally:
        restored.close()


def test_exclusive_waits_for_the_producer_and_invalidates_its_weights():
    engine = FakeEngine(delay=0.05)
    pipeline = RolloutPipeline(engine.load, engine.produce)
    try:
        pipeline.publish(WeightSnapshot(0, {}))
        pipeline.submit(0, ["a"], 0)
        with pipeline.exclusive():
            assert 0 in pipeline.results  # generated before the caller got the engine
        assert pipeline.engine_version is None  # the next batch reloads its weights
        pipeline.submit(1, ["b"], 0)
        assert pipeline.take(1)["engine_version"] == 0 and engine.loads == [0, 0]
    finally:
        pipeline.close()


# ---------------------------------------------------------------------- the HF worker process
@pytest.fixture(scope="module")
def worker_and_policy(tokenizer):
    policy = make_tiny_llama(tokenizer, seed=0, **TINY)
    worker = HFWorkerEngine(policy, tokenizer, threads=1)
    yield worker, policy
    worker.close()


def test_worker_samples_what_an_in_process_engine_samples(worker_and_policy, tokenizer):
    """Same weights, same seeded sampling: the same token ids and log-probs (bit for bit)."""
    worker, policy = worker_and_policy
    worker.load_weights(0, policy.state_dict())
    sampling = SamplingParams(max_new_tokens=6, seed=11)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = HFEngine(tokenizer, policy).generate(PROMPTS, 3, sampling)
    finally:
        torch.set_num_threads(threads)
    got = worker.generate(PROMPTS, 3, sampling)
    assert torch.equal(got.response_ids, expected.response_ids) and got.texts == expected.texts
    assert torch.equal(got.logprobs, expected.logprobs)


def test_weight_sync_is_verified(worker_and_policy, monkeypatch):
    """Moved weights reach the worker (its samples change); a sync whose answer does not match the sent
    weights (a worker that kept its old ones) raises instead of sampling from stale weights."""
    worker, policy = worker_and_policy
    sampling = SamplingParams(max_new_tokens=6, seed=3)
    worker.load_weights(1, policy.state_dict())
    before = worker.generate(PROMPTS, 2, sampling)
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.3 * torch.randn_like(p))
    worker.load_weights(2, moved.state_dict())
    after = worker.generate(PROMPTS, 2, sampling)
    assert worker.version == 2 and not torch.equal(before.logprobs, after.logprobs)

    stale = state_checksum(policy.state_dict())
    monkeypatch.setattr(worker, "_reply", lambda what: ("loaded", 3, stale))  # the worker kept version 1's
    with pytest.raises(WeightSyncError, match=r"holds version 3 with checksum .* after a sync to version 3"):
        worker.load_weights(3, moved.state_dict())


def test_checksum_sees_a_swap_and_a_change():
    a = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.5])}
    assert state_checksum(a) == state_checksum({k: v.clone() for k, v in a.items()})
    assert state_checksum(a) != state_checksum({"w": torch.tensor([2.0, 1.0, 3.0]), "b": torch.tensor([0.5])})
    assert state_checksum(a) != state_checksum(
        {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.25])}
    )


def test_a_dead_worker_is_named(tokenizer):
    worker = HFWorkerEngine(make_tiny_llama(tokenizer, seed=0, **TINY), tokenizer)
    worker.process.kill()
    worker.process.join()
    with pytest.raises(RuntimeError, match=r"HF rollout worker \(pid \d+\) died while loading"):
        worker.load_weights(0, {"w": torch.zeros(1)})
    worker.close()
    assert threading.active_count() >= 1


def test_a_lora_policy_reaches_the_worker_merged(tokenizer):
    """A LoRA policy's snapshot is its merged weights under the base model's names; after one change of the
    adapter (what an optimiser step does) the worker's rollouts change, and the sync is verified."""
    from alignlit.models.lora import LoRA, apply_lora
    from alignlit.rollout import RolloutLoop

    policy = apply_lora(make_tiny_llama(tokenizer, seed=0, **TINY), LoRA(rank=4))
    loop = RolloutLoop(sampling=SamplingParams(max_new_tokens=6), samples_per_prompt=2, max_staleness=1)
    loop.setup(policy, tokenizer)
    worker = HFWorkerEngine(policy, tokenizer)
    try:
        before = loop.snapshot(0)
        assert not any("lora_" in name for name in before.state)
        worker.load_weights(0, before.state)
        sampling = SamplingParams(max_new_tokens=6, seed=5)
        first = worker.generate(PROMPTS, 2, sampling)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5 * torch.randn_like(p))
        after = loop.snapshot(1)
        assert not all(torch.equal(before.state[k], after.state[k]) for k in before.state)
        worker.load_weights(1, after.state)
        second = worker.generate(PROMPTS, 2, sampling)
        assert not torch.equal(first.logprobs, second.logprobs)
    finally:
        worker.close()
