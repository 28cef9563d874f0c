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
takes exactly the batches the uninterrupted one would have. Its producer thread and the trainer's side
of it are a :class:`ProducerThread`, shared with partial rollouts' pipeline, which chooses its jobs
differently (:class:`~alignlit.rollout.partial.SegmentedPipeline`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass
class WeightSnapshot:
    """The policy's full state dict at one version (CPU tensors, copied: the trainer keeps training)."""

    version: int
    state: dict[str, torch.Tensor]


class Job(NamedTuple):
    """One piece of the producer's work: chosen under the lock, run in the producer thread without it."""

    what: str
    """What it does, for the error message (``"generating batch 3 (version 1)"``)."""
    snapshot: WeightSnapshot | None
    """The weights it needs (loaded unless the engine holds their version); None: it needs none."""
    run: Callable[[], Any]
    index: int | None = None
    """The batch whose result ``run`` returns (None: it returns none)."""


class ProducerThread:
    """One producer thread and the trainer's side of it, shared by :class:`RolloutPipeline` and
    :class:`~alignlit.rollout.partial.SegmentedPipeline`, which choose its jobs (:meth:`_next_job`). A
    subclass sets up its own state first: ``__init__`` starts the thread.

    Args:
        load_weights: ``load_weights(snapshot)``: load a snapshot into the producer's engine (and verify it).
        timeout_s: longest wait for one batch before the producer counts as hung.
    """

    def __init__(self, load_weights: Callable[[WeightSnapshot], None], *, timeout_s: float = 3600.0):
        self.load_weights, self.timeout_s = load_weights, timeout_s
        self.results: dict[int, Any] = {}
        self.submitted: dict[int, int] = {}
        """Index -> version (partial rollouts: segment 0's) of every batch submitted and not yet taken."""
        self.error: BaseException | None = None
        self.failed_job = ""
        self.engine_version: int | None = None
        self.waited_s = 0.0
        """Seconds the trainer spent waiting for batches (the share of time the trainer waits)."""
        self._cond = threading.Condition()
        self._busy = self._closed = False
        self._thread = threading.Thread(target=self._run, name="alignlit-rollout-producer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what a subclass chooses
    def _next_job(self) -> Job | None:
        """Under the lock: the next job, claimed (a queued one leaves its queue); None: none can run yet."""
        raise NotImplementedError

    def _ready(self) -> bool:
        """Under the lock: whether a job can run now (:meth:`drain` waits until none can); override it if
        :meth:`_next_job` takes the job off a queue."""
        return self._next_job() is not None

    def _finished(self, index: int) -> None:
        """Under the lock: batch ``index``'s result is in."""

    def _lost(self, index: int) -> bool:
        """Under the lock: whether submitted batch ``index`` is neither generated nor on its way."""
        return False

    def _release(self) -> None:
        """Under the lock, after a batch is taken: drop the snapshots no batch needs any more."""

    # ------------------------------------------------------------------ the producer thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (job := self._next_job()) is None:
                    self._cond.wait()
                if self._closed:
                    return
                self._busy = True
            try:
                if job.snapshot is not None and self.engine_version != job.snapshot.version:
                    self.load_weights(job.snapshot)
                    self.engine_version = job.snapshot.version
                result = job.run()
            except BaseException as err:  # handed to the trainer's thread, which re-raises it
                with self._cond:
                    self.error, self.failed_job = err, job.what
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                if job.index is not None:
                    self.results[job.index] = result
                    self._finished(job.index)
                self._busy = False
                self._cond.notify_all()

    # ------------------------------------------------------------------ the trainer's side
    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"the rollout producer failed while {self.failed_job}: {self.error!r}"
            ) from self.error

    def take(self, index: int) -> Any:
        """Step ``index``'s result, waiting for it if the producer is not done (the time is counted)."""
        if index not in self.submitted:
            raise KeyError(f"batch {index} was never submitted (submitted: {sorted(self.submitted)})")
        start = time.perf_counter()
        with self._cond:
            while index not in self.results:
                self._raise_if_failed()
                if self._lost(index):
                    raise RuntimeError(
                        f"batch {index} was submitted but is neither generated nor in progress"
                    )
                if not self._thread.is_alive():
                    raise RuntimeError("the rollout producer thread is gone")
                if not self._cond.wait(timeout=5.0) and time.perf_counter() - start > self.timeout_s:
                    raise TimeoutError(f"batch {index} was not generated in {self.timeout_s:.0f} s")
            del self.submitted[index]
            result = self.results.pop(index)
            self._release()
        self.waited_s += time.perf_counter() - start
        return result

    def drain(self) -> dict[int, Any]:
        """Wait until every job that can run is done; returns the finished, untaken results by index."""
        with self._cond:
            while self._busy or self._ready():
                self._raise_if_failed()
                self._cond.wait(timeout=5.0)
            self._raise_if_failed()
            return dict(self.results)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The producer's engine to the caller alone: every job that can run is done first, nothing runs
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
        """Stop the producer (after its current job); the work not started is dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)


class RolloutPipeline(ProducerThread):
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
        self.produce = produce
        self.jobs: deque = deque()
        self.snapshots: dict[int, WeightSnapshot] = {}
        """The published weights of the versions that queued batches need."""
        super().__init__(load_weights, timeout_s=timeout_s)

    def _next_job(self) -> Job | None:
        """The first queued batch, generated from its version's snapshot."""
        if not self.jobs:
            return None
        index, prompts, version = self.jobs.popleft()
        run = functools.partial(self.produce, index, prompts, version)
        return Job(f"generating batch {index} (version {version})", self.snapshots[version], run, index)

    def _ready(self) -> bool:
        return bool(self.jobs)

    def _release(self) -> None:
        needed = set(self.submitted.values()) | {max(self.snapshots, default=-1)}
        self.snapshots = {v: s for v, s in self.snapshots.items() if v in needed}

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
        self._raise_if_failed()
        with self._cond:
            self.jobs.append((index, list(prompts), version))
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the producer (after its current job); queued jobs are dropped."""
        with self._cond:
            self.jobs.clear()
        super().close()
