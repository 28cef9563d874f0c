"""Rollout/trainer mismatch: monitoring it and truncated importance sampling (algorithms.md §11).

The engine samples ``y_t ~ μ`` and reports ``log μ(y_t)``; the trainer recomputes the same tokens'
log-probs ``log π_old(y_t)`` with its own kernels and precision. The two differ slightly on GPUs
even with identical weights. Both must be log-probs of the same distribution (the rollout contract:
``log_softmax(logits / temperature)`` without top-k/top-p truncation). Tensors are (N, T) over
response tokens; ``mask`` is 1 on response tokens and 0 on padding.
"""

from __future__ import annotations

import torch

from alignlit.ops.kl import kl_k3
from alignlit.ops.stats import check_ndim, check_same_shape, masked_mean


def _valid_tokens(
    trainer_name: str, trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Validate shapes and finiteness on valid tokens; return the (N, T) bool mask."""
    check_ndim(trainer_name, trainer_logprobs, 2, "(N, T)")
    check_same_shape(**{trainer_name: trainer_logprobs, "engine_logprobs": engine_logprobs, "mask": mask})
    valid = mask.bool()  # (N, T)
    for name, tensor in ((trainer_name, trainer_logprobs), ("engine_logprobs", engine_logprobs)):
        bad = valid & ~torch.isfinite(tensor)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} must be finite on valid tokens; found {tensor[row, col].item()} at ({row}, {col})"
            )
    return valid


def logprob_mismatch(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Detached statistics of ``Δ_t = log π_old(y_t) - log μ(y_t)`` over the valid tokens.

    Args:
        trainer_logprobs: (N, T) ``log π_old(y_t)``, the trainer's log-probs of the sampled tokens.
        engine_logprobs: (N, T) ``log μ(y_t)``, the engine's log-probs of the same tokens.
        mask: (N, T) 1 on response tokens.

    Returns:
        ``mismatch_abs_mean``: mean ``|Δ_t|`` over valid tokens; ``mismatch_abs_max``: max ``|Δ_t|``;
        ``mismatch_kl``: the k3 estimate of ``KL(μ ‖ π_old)`` per token, the mean over valid tokens of
        ``w_t - 1 - log w_t`` with ``w_t = π_old(y_t)/μ(y_t)``. The direction follows from the
        sampling: ``y_t ~ μ`` (the engine sampled the tokens), so ``E_μ[w - 1 - log w] = KL(μ ‖ π_old)``
        (as ``E_μ[w] = 1``); it is ≥ 0 token by token and 0 only where the two log-probs agree.
    """
    valid = _valid_tokens("trainer_logprobs", trainer_logprobs, engine_logprobs, mask)
    if not valid.any():
        raise ValueError("mask has no valid token; the mismatch is undefined on an empty batch")
    with torch.no_grad():
        trainer_logprobs = torch.where(valid, trainer_logprobs, 0.0)  # (N, T), padding may hold anything
        engine_logprobs = torch.where(valid, engine_logprobs, 0.0)
        delta = (trainer_logprobs - engine_logprobs).abs()  # (N, T)
        # k3 with the engine as the sampling distribution: w - 1 - log w, w = exp(log π_old - log μ).
        kl = kl_k3(engine_logprobs, trainer_logprobs)  # (N, T)
        return {
            "mismatch_abs_mean": masked_mean(delta, valid),
            "mismatch_abs_max": delta[valid].max(),
            "mismatch_kl": masked_mean(kl, valid),
        }


def truncated_is_weights(
    trainer_old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, cap: float
) -> torch.Tensor:
    """Truncated importance weights ``w_t = min(π_old(y_t)/μ(y_t), C)`` (TIS, Yao et al. 2025).

    The tokens were sampled from the engine's ``μ``, but the policy-gradient loss assumes samples
    from ``π_old``; weighting each token's policy loss by ``π_old/μ`` corrects that, and the cap
    ``C`` bounds the variance the correction adds (at the price of a small bias).

    Args:
        trainer_old_logprobs: (N, T) ``log π_old(y_t)`` from the trainer at rollout time.
        engine_logprobs: (N, T) ``log μ(y_t)`` from the engine.
        mask: (N, T) 1 on response tokens.
        cap: ``C ≥ 1`` (a cap below 1 would down-weight tokens on which both agree).

    Returns:
        (N, T) detached weights ``min(exp(log π_old - log μ), C)``, 0 on padding (all 0 for a batch
        without valid tokens); pass them to :func:`alignlit.losses.policy_gradient_loss` as
        ``is_weights``.
    """
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    valid = _valid_tokens("trainer_old_logprobs", trainer_old_logprobs, engine_logprobs, mask)
    with torch.no_grad():
        log_ratio = torch.where(valid, trainer_old_logprobs - engine_logprobs, 0.0)  # (N, T)
        weights = torch.exp(log_ratio).clamp(max=cap)
        return torch.where(valid, weights, 0.0)
