"""Partial rollouts: generation that outlives a weight update continues with the newer weights.

With ``rollout.max_staleness = k >= 1`` and ``rollout.partial = L``, the rollout of step ``j`` is generated
in *segments* of ``L`` new tokens. Batch ``j`` is admitted (submitted) at step ``a_j = max(0, j - k)``;
its segment ``s`` is sampled from the weights the policy had at the start of step ``min(j, a_j + s)``, so
every later segment is one step fresher, up to the weights of step ``j`` itself, and no token is more than
``k`` versions older than the policy that trains on it. The unfinished rows of a batch continue from their
prompt and the tokens so far (re-encoded as token ids, nothing re-tokenised); a row that ended (EOS, a stop
string in its response so far, or ``max_new_tokens``) stays ended. Every response token records the
version it was sampled under (:attr:`~alignlit.rollout.base.Rollout.token_versions`) and its log-prob under
that version's weights, the behaviour ``μ`` the rollout correction weighs against.

Which weights a segment uses is fixed by its step, never by timing, and segment ``s`` of batch ``j`` is
sampled with seed ``seed + j + s·2^32`` (segment 0: ``seed + j``, the seed of the unsegmented rollout), so
runs are reproducible. :class:`SegmentedPipeline` runs the segments in one producer thread as soon as the
weights of their step are published, across batches (the oldest step first), and scores the batches in
order. A checkpoint drains it: every segment whose weights exist is sampled, and the batches still in
progress are saved with their tokens, log-probs and versions (:meth:`PartialBatch.state_dict`); their
remaining segments need the weights of steps after the checkpoint, which the resumed run publishes
exactly as the uninterrupted one did, so a resumed run equals it bit for bit.

Only the HF engine generates in segments (its asynchronous worker,
:class:`~alignlit.rollout.hf_worker.HFWorkerEngine`); multi-turn environments and DAPO's dynamic sampling
(whose refills are not segmented) are refused with it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.pipeline import Job, ProducerThread, WeightSnapshot
from alignlit.rollout.postprocess import RawSample, assemble_rollout, stop_cut

SEGMENT_SEED_STRIDE = 2**32
"""Segment ``s`` of batch ``j`` is sampled with seed ``seed + j + s * SEGMENT_SEED_STRIDE``."""


def check_partial(partial: int | None, *, engine: str, max_staleness: int, environment: Any) -> None:
    """Refuse ``rollout.partial`` settings the loop cannot serve (naming the key)."""
    if partial is None:
        return
    if isinstance(partial, bool) or not isinstance(partial, int) or partial < 1:
        raise ValueError(
            f"rollout.partial (segment length in new tokens) must be an integer >= 1 or None, got {partial!r}"
        )
    if engine != "hf":
        raise ValueError(
            f"rollout.partial ({partial}) generates in segments with the HF engine only, got rollout.engine "
            f"{engine!r}: unset rollout.partial"
        )
    if max_staleness < 1:
        raise ValueError(
            f"rollout.partial ({partial}) continues rollouts generated ahead with newer weights; with "
            "rollout.max_staleness 0 every rollout is generated from the current weights: set max_staleness "
            ">= 1 or unset rollout.partial"
        )
    if environment is not None:
        raise ValueError(
            f"rollout.partial ({partial}) segments single responses, not multi-turn episodes: unset "
            "rollout.partial or rollout.environment"
        )


def segment_step(index: int, admitted: int, segment: int) -> int:
    """The step whose weights sample segment ``segment`` of batch ``index`` admitted at step ``admitted``."""
    return min(index, admitted + segment)


@dataclass
class PartialBatch:
    """One step's rollout in progress (module docstring); rows are ``N = len(prompts) * n`` samples.

    Attributes:
        index: the training step it is for.
        prompts: the step's prompts.
        admitted: the step at which it was submitted (its segment 0's weights).
        version: the policy version of segment 0 (:attr:`~alignlit.rollout.base.Experience.versions`).
        segment: segments sampled so far.
        prompt_ids: (N, P) long, left-padded prompt ids (None before segment 0).
        prompt_mask: (N, P) bool.
        tokens, logprobs, versions: per row, the response tokens so far, their log-probs and versions.
        done: per row, whether it ended; ended: whether it ended with an EOS.
        generate_s: seconds spent sampling its segments.
    """

    index: int
    prompts: list[str]
    admitted: int
    version: int
    segment: int = 0
    prompt_ids: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    generate_s: float = 0.0

    @property
    def next_step(self) -> int:
        """The step whose weights its next segment needs."""
        return segment_step(self.index, self.admitted, self.segment)

    @property
    def finished(self) -> bool:
        """Every row ended."""
        return self.segment > 0 and all(self.done)

    def run_segment(
        self, engine, tokenizer, *, n: int, sampling: SamplingParams, length: int, version: int, seed: int
    ) -> None:
        """Sample the next segment of every unfinished row on ``engine`` (holding ``version``'s weights)."""
        room = sampling.max_new_tokens - self.segment * length  # every unfinished row has segment·L tokens
        params = dataclasses.replace(sampling, max_new_tokens=min(length, room), stop=[], seed=seed)
        start = time.perf_counter()
        if self.segment == 0:
            out = engine.generate(self.prompts, n, params)
            self.prompt_ids, self.prompt_mask = out.prompt_ids, out.prompt_mask
            rows = list(range(len(out)))
            self.tokens, self.logprobs, self.versions = (
                [[] for _ in rows],
                [[] for _ in rows],
                [[] for _ in rows],
            )
            self.done, self.ended = [False] * len(rows), [False] * len(rows)
        else:
            rows = [i for i, d in enumerate(self.done) if not d]
            history = [self.prompt_ids[i][self.prompt_mask[i]].tolist() + self.tokens[i] for i in rows]
            out = engine.generate_from_ids(history, 1, params)
        self.generate_s += time.perf_counter() - start
        for k, i in enumerate(rows):
            width = int(out.response_mask[k].sum())
            self.tokens[i] += out.response_ids[k, :width].tolist()
            self.logprobs[i] += out.logprobs[k, :width].tolist()
            self.versions[i] += [version] * width
            self.ended[i] = out.finish_reasons[k] == "stop"  # an EOS: no stop strings were asked for
            self.done[i] = (
                self.ended[i]
                or len(self.tokens[i]) >= sampling.max_new_tokens
                or stop_cut(tokenizer, self.tokens[i], sampling.stop) is not None
            )
        self.segment += 1

    def rollout(self, tokenizer, *, n: int, sampling: SamplingParams) -> tuple[Rollout, dict[str, float]]:
        """The finished batch as a :class:`~alignlit.rollout.base.Rollout` (stop strings cut on the whole
        response, as every engine's), with :attr:`~alignlit.rollout.base.Rollout.token_versions`."""
        samples = [
            RawSample(t, lp, ended_early=e) for t, lp, e in zip(self.tokens, self.logprobs, self.ended)
        ]
        rollout = assemble_rollout(
            tokenizer, self.prompts, n, self.prompt_ids[::n], self.prompt_mask[::n], samples,
            stop=sampling.stop, eos_ids=set(),
        )  # fmt: skip
        versions = torch.zeros_like(rollout.response_ids)  # (N, T)
        for i, kept in enumerate(rollout.response_lengths.tolist()):
            versions[i, :kept] = torch.tensor(self.versions[i][:kept], dtype=torch.long)
        rollout.token_versions = versions
        tokens = int(rollout.response_mask.sum())
        metrics = {
            "rollout/generate_s": self.generate_s,
            "rollout/tokens_per_s": tokens / max(self.generate_s, 1e-9),
            "rollout/samples": float(len(rollout)),
            "rollout/segments": float(self.segment),
        }
        return rollout, metrics

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue it (plain tensors, lists and numbers, for checkpoints)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PartialBatch:
        """The inverse of :meth:`state_dict`."""
        return cls(**state)


class SegmentedPipeline(ProducerThread):
    """The producer of partial rollouts (module docstring): a
    :class:`~alignlit.rollout.pipeline.ProducerThread` whose jobs are segments and scorings, with the step of
    every published snapshot. :meth:`drain` waits until every segment whose weights are published is sampled
    and every finished batch scored (:attr:`batches` holds the ones in progress); :meth:`close` drops the
    batches in progress.

    Args:
        load_weights: ``load_weights(snapshot)``: load a snapshot into the producer's engine.
        segment: ``segment(batch, version)``: sample ``batch``'s next segment on the engine holding ``version``.
        finish: ``finish(batch) -> result``: score a finished batch (in step order).
        timeout_s: longest wait for one batch before the producer counts as hung.
    """

    def __init__(
        self,
        load_weights: Callable[[WeightSnapshot], None],
        segment: Callable[[PartialBatch, int], None],
        finish: Callable[[PartialBatch], Any],
        *,
        timeout_s: float = 3600.0,
    ):
        self.segment, self.finish = segment, finish
        self.steps: dict[int, WeightSnapshot] = {}
        """The published weights by step, as long as a batch in progress may need them."""
        self.batches: dict[int, PartialBatch] = {}
        """The submitted batches not scored yet."""
        super().__init__(load_weights, timeout_s=timeout_s)

    def _next_job(self) -> Job | None:
        """Score the first batch once it is finished, else sample a segment whose weights are published (the
        oldest step first, then the lowest index); None when everything waits for weights."""
        if self.batches and (first := self.batches[min(self.batches)]).finished:
            run = functools.partial(self.finish, first)
            return Job(f"scoring batch {first.index}", None, run, first.index)
        ready = [b for b in self.batches.values() if not b.finished and b.next_step in self.steps]
        if not ready:
            return None
        batch = min(ready, key=lambda b: (b.next_step, b.index))
        snapshot = self.steps[batch.next_step]
        run = functools.partial(self.segment, batch, snapshot.version)
        return Job(f"generating segment {batch.segment} of batch {batch.index}", snapshot, run)

    def _finished(self, index: int) -> None:
        del self.batches[index]

    def _lost(self, index: int) -> bool:
        return index not in self.batches

    def _release(self) -> None:
        oldest = min((b.next_step for b in self.batches.values()), default=max(self.steps, default=0))
        self.steps = {t: s for t, s in self.steps.items() if t >= oldest or t == max(self.steps)}

    def publish(self, snapshot: WeightSnapshot, *, step: int) -> None:
        """Make ``snapshot`` (the weights at the start of ``step``) available to the segments of that step."""
        with self._cond:
            self.steps[step] = snapshot
            self._cond.notify_all()

    def submit(self, index: int, prompts: list[str], version: int, *, step: int) -> None:
        """Queue step ``index``'s rollout of ``prompts``, admitted at ``step`` (segment 0: ``version``)."""
        self._raise_if_failed()
        if index in self.submitted:
            raise ValueError(f"batch {index} was submitted already")
        with self._cond:
            self.submitted[index] = version
            self.batches[index] = PartialBatch(index, list(prompts), step, version)
            self._cond.notify_all()

    def restore(
        self, results: dict[int, Any], versions: dict[int, int], batches: dict[int, PartialBatch]
    ) -> None:
        """Put back scored results and batches in progress (from a checkpoint)."""
        with self._cond:
            super().restore(results, versions)
            self.batches.update(batches)
            self._cond.notify_all()
