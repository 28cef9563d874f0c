"""Training rollouts generated ahead of the trainer with bounded staleness (asynchronous RL).

With ``rollout.max_staleness = k >= 1`` the rollout of training step ``j`` is generated while the trainer
trains on earlier ones, from the weights the policy had at the start of step ``j - k`` (step 0's for the
first ``k``): each batch's weights are *pinned*, so which version generated a sample never depends on
timing, the staleness at training time is at most ``k`` versions (asserted on every batch), nothing
generated is dropped, and a run is reproducible and resumes bit for bit. This is admission, not
dropping: a batch is started only once the version it needs exists, so ``accepted + running <=
(k + v + 1)`` batches at version ``v`` (AReaL's and SkyRL's bound, in batches).

:class:`RolloutPipeline` runs one producer thread over queued rollouts (step ``j``'s prompts, generated
and scored by the stage's ``produce`` function). The producer's engine holds weights of its own: before a
batch it loads the snapshot of the batch's version if it holds another one. The trainer publishes a
snapshot of its current weights, submits the batches it is ahead by, and takes the batch of the current
step, waiting only if it is not done yet. A checkpoint first :meth:`drains
<RolloutPipeline.drain>` the pipeline and saves the finished, untrained batches, so the resumed run
takes exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WeightSnapshot:
    """The policy's full state dict at one version (CPU tensors, copied: the trainer keeps training)."""

    version: int
    state: dict[str, torch.Tensor]


class RolloutPipeline:
    """Generates training rollouts in a producer thread from pinned weight versions (module docstring).

    Args:
        load_weights: ``load_weights(snapshot)``: load a snapshot into the producer's engine (and verify it).
        produce: ``produce(index, prompts, version) -> result``: generate and score step ``index``'s
            rollout on the engine, which holds ``version``; runs in the producer thread.
        timeout_s: longest wait for one batch before the producer counts as hung.
    """

    def __init__(
        self,
        load_weights: Callable[[WeightSnapshot], None],
        produce: Callable[[int, list[str], int], Any],
        *,
        timeout_s: float = 3600.0,
    ):
        self.load_weights, self.produce, self.timeout_s = load_weights, produce, timeout_s
        self.jobs: deque = deque()
        self.snapshots: dict[int, WeightSnapshot] = {}
        """The published weights of the versions that queued batches need."""
        self.results: dict[int, Any] = {}
        self.submitted: dict[int, int] = {}
        """Index -> version of every batch submitted and not yet taken."""
        self.error: BaseException | None = None
        self.failed_job = ""
        self.engine_version: int | None = None
        self.waited_s = 0.0
        """Seconds the trainer spent waiting for batches (the share of time the trainer waits)."""
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="alignlit-rollout-producer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the producer thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self.jobs.popleft()
                self._busy = True
            index, prompts, version = job
            try:
                if self.engine_version != version:
                    self.load_weights(self.snapshots[version])
                    self.engine_version = version
                result = self.produce(index, prompts, version)
            except BaseException as err:  # handed to the trainer's thread, which re-raises it
                with self._cond:
                    self.error, self.failed_job = err, f"generating batch {index} (version {version})"
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self.results[index] = result
                self._busy = False
                self._cond.notify_all()

    # ------------------------------------------------------------------ the trainer's side
    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"the rollout producer failed while {self.failed_job}: {self.error!r}"
            ) from self.error

    def _put(self, job: tuple) -> None:
        self._raise_if_failed()
        with self._cond:
            self.jobs.append(job)
            self._cond.notify_all()

    def publish(self, snapshot: WeightSnapshot) -> None:
        """Make ``snapshot``'s weights available to the batches submitted with its version."""
        with self._cond:
            self.snapshots[snapshot.version] = snapshot

    def submit(self, index: int, prompts: list[str], version: int) -> None:
        """Queue step ``index``'s rollout of ``prompts``, from the weights of ``version`` (published before)."""
        if index in self.submitted:
            raise ValueError(f"batch {index} was submitted already")
        if version not in self.snapshots:
            raise KeyError(f"batch {index} needs version {version}, which was never published")
        self.submitted[index] = version
        self._put((index, list(prompts), version))

    def take(self, index: int) -> Any:
        """Step ``index``'s result, waiting for it if the producer is not done (the time is counted)."""
        if index not in self.submitted:
            raise KeyError(f"batch {index} was never submitted (submitted: {sorted(self.submitted)})")
        start = time.perf_counter()
        with self._cond:
            while index not in self.results:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise RuntimeError("the rollout producer thread is gone")
                if not self._cond.wait(timeout=5.0) and time.perf_counter() - start > self.timeout_s:
                    raise TimeoutError(f"batch {index} was not generated in {self.timeout_s:.0f} s")
            del self.submitted[index]
            result = self.results.pop(index)
            needed = set(self.submitted.values()) | {max(self.snapshots, default=-1)}
            self.snapshots = {v: s for v, s in self.snapshots.items() if v in needed}
        self.waited_s += time.perf_counter() - start
        return result

    def drain(self) -> dict[int, Any]:
        """Wait until every queued job is done; returns the finished, untaken results by index."""
        with self._cond:
            while self.jobs or self._busy:
                self._raise_if_failed()
                self._cond.wait(timeout=5.0)
            self._raise_if_failed()
            return dict(self.results)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The producer's engine to the caller alone: every queued batch is generated first, nothing runs
        while the block does, and afterwards the engine counts as holding unknown weights (the next batch
        reloads its version), so the caller may load other weights into it (e.g. validation on vLLM)."""
        with self._cond:
            self.drain()
            try:
                yield
            finally:
                self.engine_version = None

    def restore(self, results: dict[int, Any], versions: dict[int, int]) -> None:
        """Put back finished, untaken results (from a checkpoint) as if they had been submitted and generated."""
        with self._cond:
            self.results.update(results)
            self.submitted.update(versions)

    def close(self) -> None:
        """Stop the producer (after its current job); queued jobs are dropped."""
        with self._cond:
            self._closed = True
            self.jobs.clear()
            self._cond.notify_all()
        self._thread.join(timeout=60)
