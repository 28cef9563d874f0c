"""One vLLM engine on training rank 0 serving every rank: :class:`RankZeroServedEngine`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.vllm_engine import VLLMEngine


def take_prompts(rollout: Rollout, prompt_rows: Sequence[int]) -> Rollout:
    """The samples of the prompts ``prompt_rows`` (indices into the generate call's prompts, in that
    order) as a rollout of their own: prompt indices renumbered from 0, padding columns that are padding
    in every kept row dropped (left of the prompts, right of the responses)."""
    n = rollout.n
    rows = torch.tensor([p * n + k for p in prompt_rows for k in range(n)], dtype=torch.long)  # (M,)
    prompt_mask = rollout.prompt_mask[rows]  # (M, P)
    response_mask = rollout.response_mask[rows]  # (M, T)
    real = prompt_mask.any(0).nonzero()
    first = int(real[0]) if len(real) else prompt_mask.shape[1] - 1
    width = int(response_mask.sum(-1).max()) if len(rows) else 0
    return Rollout(
        prompts=[rollout.prompts[int(r)] for r in rows],
        prompt_index=torch.arange(len(prompt_rows), dtype=torch.long).repeat_interleave(n),
        prompt_ids=rollout.prompt_ids[rows, first:],
        prompt_mask=prompt_mask[:, first:],
        response_ids=rollout.response_ids[rows, :width],
        response_mask=response_mask[:, :width],
        logprobs=rollout.logprobs[rows, :width],
        texts=[rollout.texts[int(r)] for r in rows],
        finish_reasons=[rollout.finish_reasons[int(r)] for r in rows],
        n=n,
    )


class RankZeroServedEngine:
    """One vLLM engine on rank 0 serving every training rank (CPU: gloo; GPU: NCCL).

    ``generate`` is a collective every rank calls with its own prompts: rank 0 gathers them, generates
    for all of them in one call and scatters each rank its share. Ranks of one data-parallel group
    (tensor-parallel peers) ask for the same prompts and get the same samples. When every
    data-parallel rank has as many prompts, their prompts are interleaved as the data sampler dealt
    them (row ``i`` of data-parallel rank ``r`` is row ``i·W + r`` of the global batch), so the global
    batch, and with it each request's seed, is the one a single process would sample. ``sync`` is
    :meth:`VLLMEngine.sync`: the weights are gathered once per sync (only sharded models need every
    rank) and loaded on rank 0.

    Args:
        engine: the :class:`VLLMEngine` (its ``llm`` lives on rank 0 only).
        data_parallel_rank: this rank's data-parallel rank.
        data_parallel_size: the number of data-parallel ranks.
    """

    def __init__(self, engine: VLLMEngine, *, data_parallel_rank: int, data_parallel_size: int):
        self.engine = engine
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __getattr__(self, name: str):
        return getattr(self.__dict__["engine"], name)

    def sync(self, policy: torch.nn.Module, *, force: bool = False) -> None:
        self.engine.sync(policy, force=force)

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> Rollout:
        """Sample ``n`` responses per prompt for every rank; returns this rank's share (a collective)."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object((self.data_parallel_rank, list(prompts)), gathered, dst=0)
        shares: list | None = None
        if rank == 0:
            by_group: dict[int, list[str]] = {}
            for group, asked in gathered:
                by_group.setdefault(group, asked)
            groups = sorted(by_group)
            sizes = {len(by_group[g]) for g in groups}
            if len(sizes) == 1:  # as dealt by the data sampler: row i of group r is global row i*W + r
                size = sizes.pop()
                rows = {g: [i * len(groups) + j for i in range(size)] for j, g in enumerate(groups)}
            else:
                offsets = [0]
                for g in groups:
                    offsets.append(offsets[-1] + len(by_group[g]))
                rows = {g: list(range(offsets[j], offsets[j + 1])) for j, g in enumerate(groups)}
            everything = [""] * sum(len(v) for v in rows.values())
            for g in groups:
                for row, prompt in zip(rows[g], by_group[g]):
                    everything[row] = prompt
            rollout = self.engine.generate(everything, n, sampling)
            parts = {g: take_prompts(rollout, rows[g]) for g in groups}
            shares = [parts[group] for group, _ in gathered]
        received: list = [None]
        dist.scatter_object_list(received, shares, src=0)
        return received[0]
