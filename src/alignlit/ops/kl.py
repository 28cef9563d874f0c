"""Per-token KL estimators and KL-penalty coefficient controllers (algorithms.md §4).

The estimators are Schulman's k1/k2/k3 of ``KL(π_θ ‖ π_0)`` from samples ``y ~ π_θ``, evaluated per
token from the log-probs of the sampled token under the policy and the reference.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from alignlit.ops.stats import check_same_shape

KLKind = Literal["k1", "k2", "k3"]


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = log π_θ - log π_0`` (unbiased, high variance, can be negative)."""
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = ½(log π_θ - log π_0)²`` (biased, low variance, non-negative)."""
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(log π_0 - log π_θ) - 1 - (log π_0 - log π_θ)`` (unbiased, low variance, non-negative)."""
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k1") -> torch.Tensor:
    """Per-token KL estimate of the given ``kind`` (``"k1"``, ``"k2"`` or ``"k3"``); same shape as the inputs."""
    if kind not in _ESTIMATORS:
        raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {sorted(_ESTIMATORS)}")
    return _ESTIMATORS[kind](logprobs, ref_logprobs)


class FixedKLController:
    """A constant KL-penalty coefficient ``β``."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = float(state_dict["value"])


class AdaptiveKLController:
    """Adaptive KL-penalty coefficient (Ziegler et al. 2019, §2.2).

    ``β ← β·(1 + clip((KL - target)/target, -0.2, 0.2)·n_steps/horizon)``: ``β`` grows when the
    measured KL is above ``target`` and shrinks when below, by at most 20% per ``horizon`` steps.

    Args:
        init_coef: initial ``β``.
        target: KL target (nats), > 0.
        horizon: number of steps over which a full proportional correction applies, > 0.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Adapt ``β`` to the KL measured over the last ``n_steps`` steps (e.g. samples or batches)."""
        proportional_error = min(max((float(current_kl) - self.target) / self.target, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = float(state_dict["value"])
