"""Masked statistics over right-padded token tensors, and running moments.

Tensors are ``(B, T)`` over response tokens unless stated otherwise; ``mask`` is float or bool with
1 (True) on real tokens and 0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

WHITEN_EPS = 1e-8

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""``fn(t) -> t`` summed over the data-parallel ranks, as a new tensor (e.g. ``torch.distributed.all_reduce``
of a copy). Every rank calls it as often, in the same order, with tensors of the same shape and dtype."""


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming both tensors and shapes when any two keyword tensors differ in shape."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.shape != first.shape:
            raise ValueError(
                f"shape mismatch: {first_name} has shape {tuple(first.shape)} but {name} has shape "
                f"{tuple(tensor.shape)}; they must be equal"
            )


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    """Raise ``ValueError`` when ``tensor`` does not have ``ndim`` dimensions (``layout`` e.g. ``"(B, T)"``)."""
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(tensor.shape)}")


def _as_weights(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_same_shape(x=x, mask=mask)
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    return mask.to(dtype)


def _valid_count(weights: torch.Tensor, dim: int | None) -> torch.Tensor:
    count = weights.sum() if dim is None else weights.sum(dim)
    if dim is None:
        if count.item() == 0:
            raise ValueError("mask has no valid element (all zeros); cannot average over it")
    else:
        empty = int((count == 0).sum().item())
        if empty:
            raise ValueError(
                f"mask has no valid element along dim {dim} in {empty} of {count.numel()} slices; "
                "cannot average over an empty slice"
            )
    return count


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is 1: over everything (``dim=None``) or along ``dim``.

    An all-padding slice sums to 0 (a sum over nothing is well defined).
    """
    weights = _as_weights(x, mask)
    return (x * weights).sum() if dim is None else (x * weights).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1: over all valid elements (``dim=None``) or along ``dim``.

    Raises ``ValueError`` when the mask has no valid element (in any slice, when ``dim`` is given).
    """
    weights = _as_weights(x, mask)
    count = _valid_count(weights, dim)
    total = (x * weights).sum() if dim is None else (x * weights).sum(dim)
    return total / count


def masked_var(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all valid elements; ``unbiased`` divides by ``n - 1`` (Bessel), else by ``n``.

    Raises ``ValueError`` when there is no valid element, or only one with ``unbiased=True``.
    """
    weights = _as_weights(x, mask)
    count = _valid_count(weights, None)
    mean = (x * weights).sum() / count
    sq_dev = ((x - mean) ** 2 * weights).sum()
    if unbiased:
        if count.item() < 2:
            raise ValueError("unbiased masked_var needs at least 2 valid elements, the mask has 1")
        return sq_dev / (count - 1)
    return sq_dev / count


def global_moments(
    x: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(count, mean, M2)`` of the valid elements of ``x`` on every rank, float64 scalars: the count and
    the sum are summed over the ranks first, then the squared deviations from that global mean (the two
    passes one process makes over the whole batch). Two calls of ``all_reduce``.

    Raises ``ValueError``, on every rank alike, when no rank holds a valid element.
    """
    weights = _as_weights(x, mask)
    first = all_reduce(torch.stack([(x * weights).sum(), weights.sum()]).double())  # (2,) sum, count
    count = first[1]
    if count.item() == 0:
        raise ValueError("mask has no valid element on any rank (all zeros); cannot average over it")
    mean = first[0] / count
    m2 = all_reduce((((x.double() - mean) ** 2) * weights).sum()[None])[0]
    return count, mean, m2


def whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, all_reduce: AllReduce | None = None
) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over its valid elements (PPO-max advantage whitening).

    ``(x - mean) / sqrt(var + 1e-8)`` with the masked mean and unbiased masked variance over all valid
    elements of the batch. With ``shift_mean=False`` the mean is added back (scale only). Padding
    positions are returned as 0. With ``all_reduce`` (a sum over the data-parallel ranks) the batch is
    the global one: the mean and variance are those of the valid elements on every rank
    (:func:`global_moments`, float64), so each rank whitens its part as one process whitens the whole.
    """
    weights = _as_weights(x, mask)
    if all_reduce is None:
        mean = masked_mean(x, mask)
        var = masked_var(x, mask, unbiased=True)
        out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    else:
        count, global_mean, m2 = global_moments(x, mask, all_reduce)
        if count.item() < 2:
            raise ValueError(
                "whiten needs at least 2 valid elements over all ranks (unbiased variance), the masks hold 1"
            )
        mean = global_mean.to(weights.dtype)
        out = (x - mean) * torch.rsqrt(m2 / (count - 1) + WHITEN_EPS).to(weights.dtype)
    if not shift_mean:
        out = out + mean
    return out * weights


class RunningMoments:
    """Running count, mean and variance of every value ever passed to :meth:`update`.

    Batches are folded in with the parallel-moments formula of Chan, Golub and LeVeque (1979), which
    is exact (up to float64 rounding) for any split of the data: for parts ``a`` and ``b`` with counts
    ``n_a, n_b``, means ``μ_a, μ_b`` and sums of squared deviations ``M2_a, M2_b``,
    ``n = n_a + n_b``, ``δ = μ_b - μ_a``, ``μ = μ_a + δ·n_b/n``, ``M2 = M2_a + M2_b + δ²·n_a·n_b/n``.
    Used for PPO-max reward normalisation (``R̃ = clip((R - μ)/σ, -δ, δ)``). State is kept in float64
    Python numbers, so it lives on no device and goes into a checkpoint as is.
    """

    def __init__(self) -> None:
        self.count: int = 0
        self._mean: float = 0.0
        self._m2: float = 0.0

    def _combine(self, count: int, mean: float, m2: float) -> None:
        if count == 0:
            return
        total = self.count + count
        delta = mean - self._mean
        self._mean += delta * count / total
        self._m2 += m2 + delta * delta * self.count * count / total
        self.count = total

    def update(self, x: torch.Tensor) -> None:
        """Fold in every element of ``x`` (any shape; an empty tensor changes nothing)."""
        values = x.detach().reshape(-1).to(torch.float64)
        if values.numel() == 0:
            return
        mean = values.mean()
        m2 = ((values - mean) ** 2).sum()
        self._combine(values.numel(), mean.item(), m2.item())

    def merge(self, other: RunningMoments) -> None:
        """Fold in the moments of ``other``, as if its values had been passed to :meth:`update`."""
        self._combine(other.count, other._mean, other._m2)

    def all_reduce(self) -> None:
        """Replace this state by the merge of the states of all ``torch.distributed`` ranks.

        A no-op unless a process group is initialised. Every rank ends with the same moments. The
        ranks must hold moments of disjoint data: the usual pattern is, per step, a fresh
        ``RunningMoments`` updated with the local batch, ``all_reduce()``-ed, then merged into the
        long-lived one on every rank.
        """
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        device = torch.device("cpu")
        if torch.distributed.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        local = torch.tensor([float(self.count), self._mean, self._m2], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, local)
        self.count, self._mean, self._m2 = 0, 0.0, 0.0
        for part in gathered:
            count, mean, m2 = part.tolist()
            self._combine(round(count), mean, m2)

    @property
    def mean(self) -> float:
        """Mean of all values seen (raises ``ValueError`` before any value)."""
        if self.count == 0:
            raise ValueError("RunningMoments.mean is undefined: no value has been seen yet")
        return self._mean

    @property
    def var(self) -> float:
        """Unbiased (``n - 1``) variance of all values seen, as ``torch.var``; needs at least 2 values."""
        if self.count < 2:
            raise ValueError(f"RunningMoments.var needs at least 2 values, has seen {self.count}")
        return self._m2 / (self.count - 1)

    @property
    def std(self) -> float:
        """Square root of :attr:`var`."""
        return self.var**0.5

    def state_dict(self) -> dict[str, Any]:
        """Plain-number state for checkpoints."""
        return {"count": self.count, "mean": self._mean, "m2": self._m2}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict`."""
        missing = {"count", "mean", "m2"} - set(state_dict)
        if missing:
            raise KeyError(f"RunningMoments state_dict is missing {sorted(missing)}")
        self.count = int(state_dict["count"])
        self._mean = float(state_dict["mean"])
        self._m2 = float(state_dict["m2"])

    def __repr__(self) -> str:
        return f"RunningMoments(count={self.count}, mean={self._mean:.6g}, m2={self._m2:.6g})"
