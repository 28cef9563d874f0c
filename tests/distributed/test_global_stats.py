"""Statistics over the global batch of several data-parallel ranks (``all_reduce`` in alignlit.ops): whitening,
REINFORCE++'s returns and REINFORCE++-baseline's standard deviation computed by ranks that each hold part of
the batch equal the one-process values on the whole batch, and differ from each rank's local statistics.

The ranks are threads here: :class:`ThreadRanks` gives each one an ``all_reduce`` that sums a tensor over
all of them (a barrier, then the sum in rank order), as ``torch.distributed.all_reduce`` does over processes.
"""

from __future__ import annotations

import threading

import pytest
import torch

from alignlit.ops import global_moments, group_advantages, register_advantage, reinforce_pp_returns, whiten
from alignlit.ops.advantages import ADVANTAGE_ESTIMATORS


class ThreadRanks:
    """``world`` threads standing for data-parallel ranks, with an ``all_reduce`` (sum) between them."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def all_reduce(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.slots[rank] = t.detach().clone()
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)  # in rank order, as every rank sees it
            self.barrier.wait()
            return total

        return reduce

    def run(self, fn, parts: list) -> list:
        """``fn(part, all_reduce)`` on rank ``r`` with ``parts[r]``; their results in rank order (an error on
        any rank is raised here)."""
        results: list = [None] * self.world
        errors: list = [None] * self.world

        def target(rank: int) -> None:
            try:
                results[rank] = fn(parts[rank], self.all_reduce(rank))
            except Exception as e:  # re-raised below, in the test's thread
                errors[rank] = e
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [e for e in errors if e is not None]
        if failed:  # the first error that is not another rank's broken barrier
            raise next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)), failed[0])
        return results


def test_global_moments_by_hand():
    """Rank 0 holds 1, 2 (and padding), rank 1 holds 4, 5: count 4, mean 3, M2 = 4 + 1 + 1 + 4 = 10,
    the same on both ranks; two all-reduces each."""
    x = [torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[4.0, 5.0]])]
    masks = [torch.tensor([[1, 1, 0]]), torch.tensor([[1, 1]])]
    ranks = ThreadRanks(2)
    out = ranks.run(lambda part, reduce: global_moments(*part, reduce), list(zip(x, masks)))
    for count, mean, m2 in out:
        assert (count.item(), mean.item(), m2.item()) == (4.0, 3.0, 10.0)
        assert count.dtype == mean.dtype == m2.dtype == torch.float64
    assert ranks.calls == [2, 2]


def test_global_moments_refuse_an_all_padding_batch_on_every_rank():
    masks = [torch.zeros(1, 2), torch.zeros(2, 2)]
    with pytest.raises(ValueError, match="no valid element on any rank"):
        ThreadRanks(2).run(lambda m, reduce: global_moments(torch.ones_like(m), m, reduce), masks)


def _split(generator, rows: list[int], width: int):
    """Random values and right-padded masks for ranks holding ``rows[r]`` rows; the last rank's rows are all
    padding but one token, and one row of rank 0 is empty."""
    parts = []
    for r, n in enumerate(rows):
        x = 2.0 + 3.0 * torch.randn(n, width, generator=generator, dtype=torch.float64)
        lengths = torch.randint(1, width + 1, (n,), generator=generator)
        if r == 0:
            lengths[0] = 0
        if r == len(rows) - 1:
            lengths[:] = 0
            lengths[0] = 1
        mask = torch.arange(width)[None, :] < lengths[:, None]  # (n, width)
        parts.append((x, mask))
    return parts


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_over_ranks_equals_one_process_on_the_whole_batch(shift_mean):
    generator = torch.Generator().manual_seed(0)
    parts = _split(generator, [3, 2, 2], 6)
    x = torch.cat([p[0] for p in parts])
    mask = torch.cat([p[1] for p in parts])
    expected = whiten(x, mask, shift_mean=shift_mean)
    got = ThreadRanks(3).run(
        lambda part, reduce: whiten(*part, shift_mean=shift_mean, all_reduce=reduce), parts
    )
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-12)
    local = torch.cat([whiten(*p, shift_mean=shift_mean) for p in parts[:2]])  # rank 2 has one token only
    assert (local - expected[: len(local)]).abs().max() > 0.1  # each rank's own statistics are not these


def test_whiten_over_ranks_in_float32_matches_one_process():
    """float32 inputs: the global moments are float64, the result float32 within float32 rounding."""
    generator = torch.Generator().manual_seed(1)
    parts = [(x.float(), m) for x, m in _split(generator, [4, 4], 5)]
    expected = whiten(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    got = ThreadRanks(2).run(lambda part, reduce: whiten(*part, all_reduce=reduce), parts)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-5)


def test_whiten_over_ranks_needs_two_valid_elements_in_all():
    masks = [torch.tensor([[1, 0]]), torch.tensor([[0, 0]])]
    with pytest.raises(ValueError, match="at least 2 valid elements over all ranks"):
        ThreadRanks(2).run(lambda m, reduce: whiten(torch.ones(1, 2), m, all_reduce=reduce), masks)


def test_reinforce_pp_baseline_std_over_ranks():
    """Rank 0: rewards (1, 3 | 0, 0) centre to (-1, 1 | 0, 0); rank 1: (2, 6) to (-2, 2). Over the 6 centred
    values mean 0, population variance (1 + 1 + 0 + 0 + 4 + 4)/6 = 5/3, std 1.290994: A = c / 1.290994 on
    both ranks. Rank 0 alone would divide by sqrt(2/4) = 0.707107, rank 1 by 2."""
    parts = [
        torch.tensor([[1.0, 3.0], [0.0, 0.0]], dtype=torch.float64),
        torch.tensor([[2.0, 6.0]], dtype=torch.float64),
    ]
    got = ThreadRanks(2).run(
        lambda r, reduce: group_advantages(r, estimator="reinforce_pp_baseline", eps=0.0, all_reduce=reduce),
        parts,
    )
    std = (5 / 3) ** 0.5
    torch.testing.assert_close(got[0], torch.tensor([[-1.0, 1.0], [0.0, 0.0]], dtype=torch.float64) / std)
    torch.testing.assert_close(got[1], torch.tensor([[-2.0, 2.0]], dtype=torch.float64) / std)
    whole = group_advantages(torch.cat(parts), estimator="reinforce_pp_baseline", eps=0.0)
    torch.testing.assert_close(torch.cat(got), whole, rtol=0, atol=1e-12)
    alone = group_advantages(parts[0], estimator="reinforce_pp_baseline", eps=0.0)
    assert alone[0, 1].item() == pytest.approx(1 / 0.5**0.5)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_per_group_estimators_do_not_reduce(estimator):
    """A group lies on one rank: the per-group estimators give each rank's rows the values of one process
    and call no all-reduce."""
    generator = torch.Generator().manual_seed(2)
    rewards = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    parts = [rewards[:3], rewards[3:]]
    ranks = ThreadRanks(2)
    got = ranks.run(lambda r, reduce: group_advantages(r, estimator=estimator, all_reduce=reduce), parts)
    torch.testing.assert_close(torch.cat(got), group_advantages(rewards, estimator=estimator), rtol=0, atol=0)
    assert ranks.calls == [0, 0]


def test_all_reduce_goes_to_the_estimators_whose_signature_takes_it():
    seen = {}

    @register_advantage("test_batch_scaled")
    def batch_scaled(rewards, *, eps, all_reduce=None):
        seen["all_reduce"] = all_reduce
        total = rewards.abs().sum()[None]
        total = all_reduce(total) if all_reduce is not None else total
        return rewards / total

    @register_advantage("test_any_keyword")
    def any_keyword(rewards, *, eps, **options):
        seen["options"] = sorted(options)
        return rewards

    try:
        reduce = lambda t: 2 * t  # noqa: E731  (a second rank holding the same values)
        out = group_advantages(torch.ones(1, 2), estimator="test_batch_scaled", all_reduce=reduce)
        assert seen["all_reduce"] is reduce and out.tolist() == [[0.25, 0.25]]
        group_advantages(torch.ones(1, 2), estimator="test_any_keyword", all_reduce=reduce)
        assert seen["options"] == ["all_reduce"]
        group_advantages(torch.ones(1, 2), estimator="test_any_keyword")
        assert seen["options"] == []
    finally:
        del ADVANTAGE_ESTIMATORS["test_batch_scaled"], ADVANTAGE_ESTIMATORS["test_any_keyword"]


def test_reinforce_pp_returns_over_ranks_equal_one_process():
    """Returns whitened over the valid tokens of every rank; rank 1 holds a single valid token (on its own
    it could not be whitened) and an empty row (advantages 0)."""
    generator = torch.Generator().manual_seed(3)
    parts = _split(generator, [3, 2], 5)
    scores = [torch.randn(len(m), generator=generator, dtype=torch.float64) for _, m in parts]
    kl = [0.1 * x for x, _ in parts]
    masks = [m for _, m in parts]
    expected = reinforce_pp_returns(
        torch.cat(scores), torch.cat(kl), torch.cat(masks), kl_coef=0.3, gamma=0.9
    )
    got = ThreadRanks(2).run(
        lambda p, reduce: reinforce_pp_returns(*p, kl_coef=0.3, gamma=0.9, all_reduce=reduce),
        list(zip(scores, kl, masks)),
    )
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-12)
    assert int(masks[1].sum()) == 1 and got[1][1].abs().sum() == 0
    with pytest.raises(ValueError, match="whitening the returns needs at least 2"):
        reinforce_pp_returns(scores[1], kl[1], masks[1], kl_coef=0.3)
