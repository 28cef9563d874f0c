"""Training rollouts collected ahead of the trainer (``rollout.max_staleness = k >= 1``).

An :class:`AheadCollector` drives the loop's :class:`~alignlit.rollout.pipeline.RolloutPipeline`: at step
``index`` it publishes a snapshot of the policy, submits the steps up to ``index + k`` with the prompts the
trainer's ``schedule`` gives for them, and takes step ``index``'s experience, asserting the staleness bound
on every sample::

    experience, metrics = ahead.collect(prompts, version=v, schedule=prompts_of_step, last=final_step)

The producer thread runs :meth:`AheadCollector.produce`, a :class:`~alignlit.rollout.collector.Collector`
call on the producer's engine; it never touches the trainer's objects. The state of the pipeline (the
finished batches not trained on yet, and the versions they were generated from) is :meth:`state_dict
<AheadCollector.state_dict>`: saved after draining the producer, put back into the pipeline on resume.

With ``rollout.partial`` the producer is a :class:`~alignlit.rollout.partial.SegmentedPipeline`: every step
publishes its weights (the segments of the batches in progress continue with them), the producer runs
:meth:`AheadCollector.segment` and :meth:`AheadCollector.finish`, the state holds the batches in progress
too, and the per-token staleness is asserted and logged.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from alignlit.rollout.base import Experience, Rollout
from alignlit.rollout.collector import Collector
from alignlit.rollout.partial import SEGMENT_SEED_STRIDE, PartialBatch, SegmentedPipeline
from alignlit.rollout.reward_protocol import reward_counters, score_rollout

Result = tuple[Experience | None, dict[str, float]]
"""An accepted experience (None: nothing to train on) and its metrics."""


def experience_state(result: Result) -> dict[str, Any]:
    """A pipeline result ``(experience, metrics)`` as plain tensors, lists and numbers (checkpoints)."""
    experience, metrics = result
    if experience is None:
        return {"experience": None, "metrics": dict(metrics)}
    rollout = {f.name: getattr(experience.rollout, f.name) for f in dataclasses.fields(experience.rollout)}
    return {
        "experience": {"rollout": rollout, "rewards": experience.rewards, "versions": experience.versions},
        "metrics": dict(metrics),
    }


def load_experience(state: dict[str, Any]) -> Result:
    """The inverse of :func:`experience_state`."""
    saved = state["experience"]
    if saved is None:
        return None, dict(state["metrics"])
    experience = Experience(Rollout(**saved["rollout"]), saved["rewards"], saved["versions"])
    return experience, dict(state["metrics"])


def token_staleness(rollout: Rollout, version: int, *, index: int, bound: int) -> dict[str, float]:
    """``async/token_staleness_mean`` and ``_max`` of a partial rollout's response tokens trained by
    ``version``; raises when a token lies outside ``[0, bound]``."""
    staleness = version - rollout.token_versions[rollout.response_mask]  # (tokens,)
    if not len(staleness):
        return {}
    if int(staleness.max()) > bound or int(staleness.min()) < 0:
        raise AssertionError(
            f"step {index}: tokens of versions {sorted(set((version - staleness).tolist()))} trained by version "
            f"{version}: staleness outside [0, max_staleness={bound}]"
        )
    return {
        "async/token_staleness_mean": float(staleness.float().mean()),
        "async/token_staleness_max": float(staleness.max()),
    }


class AheadCollector:
    """Generates training rollouts ahead with bounded staleness (module docstring).

    Args:
        collector: what generates, scores and accepts one step's rollout (its loop holds the pipeline).
    """

    def __init__(self, collector: Collector):
        self.collector, self.loop = collector, collector.loop
        self.restored: tuple[dict[int, Result], dict[int, int]] = ({}, {})
        """Finished batches (and their versions) from a checkpoint, put back when the pipeline starts."""
        self.restored_partial: dict[int, PartialBatch] = {}
        """Batches in progress from a checkpoint (``rollout.partial``)."""

    def produce(self, index: int, prompts: list[str], version: int) -> Result:
        """Step ``index``'s rollout on the pipeline's engine (which holds ``version``), seeded as the
        synchronous rollout ``index`` is, scored and accepted; runs in the producer thread."""
        loop = self.loop
        return self.collector.collect(
            prompts, version=version, seed=loop.seed + index, engine=loop.async_engine
        )

    def segment(self, batch: PartialBatch, version: int) -> None:
        """The next segment of a partial rollout on the pipeline's engine (holding ``version``); runs in the
        producer thread (:mod:`alignlit.rollout.partial`)."""
        loop = self.loop
        seed = loop.seed + batch.index + batch.segment * SEGMENT_SEED_STRIDE
        batch.run_segment(
            loop.async_engine, loop.tokenizer, n=loop.samples_per_prompt, sampling=loop.sampling,
            length=loop.partial, version=version, seed=seed,
        )  # fmt: skip

    def finish(self, batch: PartialBatch) -> Result:
        """A finished partial rollout, scored and accepted (as :meth:`produce`'s); runs in the producer thread."""
        loop, collector = self.loop, self.collector
        rollout, metrics = batch.rollout(loop.tokenizer, n=loop.samples_per_prompt, sampling=loop.sampling)
        start = time.perf_counter()
        rewards = score_rollout(collector.reward, rollout)
        metrics.update({"rollout/score_s": time.perf_counter() - start, **reward_counters(collector.reward)})
        versions = torch.full((len(rollout),), batch.version, dtype=torch.long)
        return collector.accept(Experience(rollout, rewards, versions, metrics), engine=loop.async_engine)

    def start(self) -> Any:
        """Start the loop's pipeline (segmented with ``rollout.partial``) and put back the restored batches."""
        loop = self.loop
        if loop.partial is None:
            pipeline = loop.start_pipeline(self.produce)
            pipeline.restore(*self.restored)
            return pipeline
        pipeline = loop.start_pipeline(
            self.produce, make=lambda load: SegmentedPipeline(load, self.segment, self.finish)
        )
        pipeline.restore(*self.restored, self.restored_partial)
        return pipeline

    def collect(
        self, prompts: list[str], *, version: int, schedule: Callable[[int], list[str]], last: int
    ) -> Result:
        """Take step ``index = loop.rollouts``'s experience from the pipeline, after submitting the steps up
        to ``min(index + k, last)`` (the prompts of step ``j`` are ``schedule(j)``) from the current weights
        (``version``); ``prompts`` must be ``schedule(index)``. Asserts the staleness bound on every sample
        and logs ``async/staleness_mean``, ``async/staleness_max``, ``async/wait_s``."""
        loop, k = self.loop, self.loop.max_staleness
        index = loop.rollouts
        pipeline = loop.pipeline
        if pipeline is None:
            pipeline = self.start()
        scheduled = schedule(index)
        if list(prompts) != list(scheduled):
            raise RuntimeError(
                f"step {index}: the training loader gave prompts {list(prompts)[:2]}... but the rollout pipeline "
                f"generated {list(scheduled)[:2]}... for it: the loader's order is not the sampler's"
            )
        ahead = [j for j in range(index, min(index + k, max(last, index)) + 1) if j not in pipeline.submitted]
        if loop.partial is not None:  # the segments of every batch in progress may need this step's weights
            pipeline.publish(loop.snapshot(version), step=index)
            for j in ahead:
                pipeline.submit(j, schedule(j), version, step=index)
        elif ahead:
            pipeline.publish(loop.snapshot(version))
            for j in ahead:
                pipeline.submit(j, schedule(j), version)
        waited = pipeline.waited_s
        experience, metrics = pipeline.take(index)
        loop.rollouts = index + 1
        metrics = {**metrics, "async/wait_s": pipeline.waited_s - waited}
        if experience is not None:
            staleness = version - experience.versions  # (N,)
            if int(staleness.max()) > k or int(staleness.min()) < 0:
                raise AssertionError(
                    f"step {index}: samples of versions {sorted(set(experience.versions.tolist()))} trained by "
                    f"version {version}: staleness outside [0, max_staleness={k}]"
                )
            metrics["async/staleness_mean"] = float(staleness.float().mean())
            metrics["async/staleness_max"] = float(staleness.max())
            if experience.rollout.token_versions is not None:
                metrics.update(token_staleness(experience.rollout, version, index=index, bound=k))
        return experience, metrics

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """The finished, untrained batches by step, with their versions, and with ``rollout.partial`` the
        batches in progress (``"partial"``: their tokens, log-probs and versions so far). Drains the producer
        first, so the state of everything it touches (the loop's counters, the collector's generator)
        settles: call it before theirs."""
        pipeline = self.loop.pipeline
        ahead = pipeline.drain() if pipeline is not None else {}
        state = {
            j: {"result": experience_state(r), "version": pipeline.submitted[j]} for j, r in ahead.items()
        }
        for j, batch in getattr(pipeline, "batches", {}).items():
            state[j] = {"partial": batch.state_dict(), "version": pipeline.submitted[j]}
        return state

    def load_state_dict(self, state: dict[int, dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`: the batches go back into the pipeline when it starts."""
        done = {int(j): s for j, s in state.items() if "partial" not in s}
        self.restored = (
            {j: load_experience(s["result"]) for j, s in done.items()},
            {int(j): int(s["version"]) for j, s in state.items()},
        )
        self.restored_partial = {
            int(j): PartialBatch.from_state(s["partial"]) for j, s in state.items() if "partial" in s
        }

    def resume_notice(self) -> str:
        """The notice of a resume that cannot match an uninterrupted run ("" when it can).

        With ``max_staleness = k``, a checkpoint holds the ``k`` batches generated ahead of its step, from
        the weights of ``k`` steps earlier. A checkpoint written within ``k`` steps of the end its run had
        planned (at the end of a finished run, say) has fewer: its run never generated the batches past its
        end. Resumed with a longer run (``max_epochs`` raised), those batches are generated from the
        weights of the resume, staleness 0 instead of up to ``k``: a valid run, but not the one a run planned
        that long from the start would have trained (its weights from earlier versions are gone)."""
        k, index = self.loop.max_staleness, self.loop.rollouts
        missing = [j for j in range(index, index + k) if j not in self.restored[1]]
        if not k or not index or not missing:
            return ""
        steps = ", ".join(map(str, missing))
        return (
            f"alignlit: notice: this checkpoint (rollout step {index}, max_staleness {k}) holds no rollouts "
            f"generated ahead for step(s) {steps}: it was written at (or within {k} steps of) the end its run "
            f"had planned. If this run trains them, they are generated from the resumed weights (staleness 0), "
            f"not from the weights of {k} step(s) earlier as in a run planned this long from the start, so the "
            "result is a valid asynchronous run but not bit-identical to that one."
        )
