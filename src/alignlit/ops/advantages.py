"""Advantage estimators: critic-free over groups of samples (algorithms.md §10) and per token (§12).

Two registries of small pure functions, keyed by the name a config uses (one name never in both):

- group estimators, :data:`ADVANTAGE_ESTIMATORS` (add one with :func:`register_advantage`, call them
  through :func:`group_advantages`): a group is the ``n`` responses sampled for one prompt,
  ``rewards[i, j]`` the sequence reward of prompt ``i``'s sample ``j``, shape (B, n), and every
  estimator returns one advantage per sample, shape (B, n), which the policy-gradient loss broadcasts
  over the sample's tokens;
- per-token estimators, :data:`TOKEN_ADVANTAGE_ESTIMATORS` (:func:`register_token_advantage`; the
  entries and :func:`~alignlit.ops.token_advantages.token_advantages` are in
  :mod:`alignlit.ops.token_advantages`): per-token rewards (N, T), and a critic's values where the
  estimator uses one, to per-token advantages and returns (N, T): PPO's GAE, discounted returns,
  REINFORCE++.

Several data-parallel ranks: a group never spans ranks (a rank samples all ``n`` responses of its
prompts), so the per-group estimators need nothing from the other ranks; statistics over the whole
batch (REINFORCE++'s whitening, REINFORCE++-baseline's standard deviation) take an optional
``all_reduce`` (:data:`alignlit.ops.stats.AllReduce`, a sum over the ranks) and are then those of the
global batch, as one process computes them on it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

import torch

from alignlit.ops.stats import AllReduce, check_ndim, global_moments

AdvantageEstimator = Callable[..., torch.Tensor]
"""``fn(rewards (B, n), *, eps: float) -> advantages (B, n)``; ``rewards`` is finite and floating. An
estimator that takes statistics over the whole batch (not only over each group) also takes
``all_reduce: AllReduce | None = None`` and, when it is given, takes them over every rank's batch;
:func:`group_advantages` passes it to the estimators whose signature has it."""

TokenAdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(token_rewards (N, T), values (N, T) | None, mask (N, T) bool, *, gamma: float, lam: float,
all_reduce: AllReduce | None = None) -> (advantages (N, T), returns (N, T))``, both 0 at padding.

:func:`token_advantages` calls it with finite float ``token_rewards`` that are 0 at padding, a
right-padded ``mask``, ``γ, λ ∈ [0, 1]``, and ``values`` (the critic's ``V(s_t)``, finite, 0 at
padding, of the rewards' dtype) or None. An estimator that needs a critic raises when ``values`` is
None; one without a critic raises when values are given (a critic would be trained for nothing).
``all_reduce`` (a sum over the data-parallel ranks; None in one process) is for statistics over the
whole batch; an estimator that takes none ignores it."""

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
"""Group advantage estimators by name (the value of ``estimator`` in :func:`group_advantages`)."""

TOKEN_ADVANTAGE_ESTIMATORS: dict[str, TokenAdvantageEstimator] = {}
"""Per-token advantage estimators by name (the value of ``estimator`` in :func:`token_advantages`)."""


def _register(registry: dict, name: str) -> Callable:
    def decorate(fn):
        for kind, taken in (("group", ADVANTAGE_ESTIMATORS), ("per-token", TOKEN_ADVANTAGE_ESTIMATORS)):
            if name in taken:
                raise ValueError(f"advantage estimator {name!r} is already registered (a {kind} estimator)")
        registry[name] = fn
        return fn

    return decorate


def register_advantage(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding ``fn(rewards (B, n), *, eps) -> (B, n)`` to :data:`ADVANTAGE_ESTIMATORS` as ``name``
    (with an ``all_reduce`` keyword when it uses statistics of the whole batch, see :data:`AdvantageEstimator`).

    Raises ``ValueError`` when ``name`` is already registered, as a group or a per-token estimator (a
    second estimator never silently replaces the first).
    """
    return _register(ADVANTAGE_ESTIMATORS, name)


def register_token_advantage(name: str) -> Callable[[TokenAdvantageEstimator], TokenAdvantageEstimator]:
    """Decorator adding ``fn(token_rewards, values, mask, *, gamma, lam, all_reduce=None) -> (advantages,
    returns)`` (see :data:`TokenAdvantageEstimator`) to :data:`TOKEN_ADVANTAGE_ESTIMATORS` as ``name``.

    Raises ``ValueError`` when ``name`` is already registered, as a group or a per-token estimator.
    """
    return _register(TOKEN_ADVANTAGE_ESTIMATORS, name)


def _unknown(name: object) -> ValueError:
    names = [*ADVANTAGE_ESTIMATORS, *TOKEN_ADVANTAGE_ESTIMATORS]
    close = difflib.get_close_matches(name, names, n=1) if isinstance(name, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"unknown advantage estimator {name!r}; expected one of {sorted(ADVANTAGE_ESTIMATORS)} (group "
        f"estimators, alignlit.ops.group_advantages) or {sorted(TOKEN_ADVANTAGE_ESTIMATORS)} (per-token, "
        f"alignlit.ops.token_advantages){hint} (or register one with alignlit.ops.register_advantage or "
        "alignlit.ops.register_token_advantage)"
    )


# ---------------------------------------------------------------- group estimators


def _centred(rewards: torch.Tensor) -> torch.Tensor:
    """(B, n) ``r_ij - mean_j r_ij``, exactly 0 in a group whose rewards are all equal.

    The mean is taken of the differences to the group's first reward, which are exactly 0 in such a
    group. The float mean of equal values is not always that value (eight float32 0.1 average to
    0.1 + 7e-9), and dividing that residue by the group's standard deviation, of the same tiny order,
    would give advantages up to ±1 to a group that carries no signal.
    """
    shifted = rewards - rewards[:, :1]  # (B, n)
    return shifted - shifted.mean(dim=1, keepdim=True)


def _scaled(centred: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``centred / scale``, 0 where ``scale`` is 0 (no spread and ε = 0: 0/0 would be NaN)."""
    return torch.where(scale > 0, centred / scale, torch.zeros_like(centred))


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, *, eps: float) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + ε)``.

    The standard deviation is the population one (divide by ``n``) over the group; a group whose
    rewards are all equal gets advantages exactly 0.
    """
    centred = _centred(rewards)  # (B, n)
    std = centred.pow(2).mean(dim=1, keepdim=True).sqrt()  # (B, 1)
    return _scaled(centred, std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, *, eps: float) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): ``A_ij = r_ij - mean_j r_ij`` (no division by the group std)."""
    return _centred(rewards)


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor, *, eps: float) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): ``A_ij = r_ij - (1/(n-1))·Σ_{k≠j} r_ik``.

    The baseline of each sample is the mean reward of the other samples of its prompt (the
    leave-one-out baseline of Kool et al. 2019), so it does not depend on the sample itself.
    Computed as the equal ``n/(n-1)·(r_ij - mean_j r_ij)``; needs ``n ≥ 2``.
    """
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(
            f"rloo needs at least 2 samples per prompt (rewards of shape (B, n >= 2)), got n={n}"
        )
    return _centred(rewards) * (n / (n - 1))


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, *, eps: float, all_reduce: AllReduce | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): ``c_ij = r_ij - mean_j r_ij``, ``A_ij = c_ij / (std(c) + ε)``.

    The group mean removes the prompt's difficulty; the standard deviation is the population one
    over all ``B·n`` centred values of the batch, so every group is scaled by the same number. With
    ``all_reduce`` (a sum over the data-parallel ranks) it is over the centred values of every rank
    (:func:`~alignlit.ops.stats.global_moments`, float64).
    """
    centred = _centred(rewards)  # (B, n)
    if all_reduce is None:
        return _scaled(centred, centred.std(unbiased=False) + eps)
    count, _, m2 = global_moments(centred, torch.ones_like(centred, dtype=torch.bool), all_reduce)
    std = (m2 / count).sqrt().to(centred.dtype)
    return _scaled(centred, std + eps)


# ---------------------------------------------------------------- lookups


def _as_float(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        return tensor
    if tensor.is_complex():
        raise ValueError(f"{name} must be real, got dtype {tensor.dtype}")
    return tensor.to(torch.get_default_dtype())


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    bad = ~torch.isfinite(tensor)
    if bad.any():
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{name} must be finite; found {int(bad.sum())} non-finite value(s), the first at index "
            f"{tuple(first)}: {tensor[tuple(first)].item()}"
        )


def _on_valid(name: str, tensor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a float, 0 at padding (which may hold anything), checked finite at valid tokens."""
    tensor = _as_float(name, tensor)
    tensor = torch.where(valid, tensor, torch.zeros_like(tensor))
    _check_finite(f"{name} (at valid tokens)", tensor)
    return tensor


def _takes_all_reduce(fn: AdvantageEstimator) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature
        return False
    return "all_reduce" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def group_advantages(
    rewards: torch.Tensor,
    *,
    estimator: str | AdvantageEstimator,
    eps: float = 1e-6,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """Per-sample advantages from the rewards of ``n`` samples per prompt (algorithms.md §10).

    Args:
        rewards: (B, n) sequence rewards, prompt ``i``'s samples in row ``i``; integer or boolean
            rewards (e.g. 0/1 correctness) are converted to the default float dtype.
        estimator: a name in :data:`ADVANTAGE_ESTIMATORS` (``"grpo"``, ``"dr_grpo"``, ``"rloo"``,
            ``"reinforce_pp_baseline"``, or one added with :func:`register_advantage`), or such a
            function itself.
        eps: ``ε ≥ 0`` added to standard deviations before dividing.
        all_reduce: with several data-parallel ranks, a sum over them
            (:data:`~alignlit.ops.stats.AllReduce`), passed on to an estimator that takes statistics
            of the whole batch (``"reinforce_pp_baseline"``; see :data:`AdvantageEstimator`) so that they
            are those of the global batch; the per-group estimators do not need it. None: one process.

    Returns:
        (B, n) advantages, same dtype as the (float) rewards; exactly 0 for every sample of a group whose
        rewards are all equal, with every built-in estimator.
    """
    check_ndim("rewards", rewards, 2, "(B, n)")
    if rewards.shape[0] == 0 or rewards.shape[1] == 0:
        raise ValueError(
            f"rewards must hold at least one prompt and one sample, got shape {tuple(rewards.shape)}"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards = _as_float("rewards", rewards)
    _check_finite("rewards", rewards)
    if callable(estimator):
        fn = estimator
    elif estimator in ADVANTAGE_ESTIMATORS:
        fn = ADVANTAGE_ESTIMATORS[estimator]
    elif estimator in TOKEN_ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"estimator {estimator!r} needs per-token KL or rewards and a token mask, not only (B, n) "
            "rewards: it is a per-token estimator; use alignlit.ops.token_advantages (REINFORCE++ from "
            "sequence scores and token KL: alignlit.ops.reinforce_pp_returns)"
        )
    else:
        raise _unknown(estimator)
    if all_reduce is not None and _takes_all_reduce(fn):
        advantages = fn(rewards, eps=eps, all_reduce=all_reduce)
    else:
        advantages = fn(rewards, eps=eps)
    if advantages.shape != rewards.shape:
        raise ValueError(
            f"advantage estimator {estimator!r} returned shape {tuple(advantages.shape)}, expected the "
            f"shape of rewards {tuple(rewards.shape)}"
        )
    return advantages
