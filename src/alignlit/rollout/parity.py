"""Check that an engine's log-probs are the trainer's: a stale or mis-loaded engine fails loudly.

The engine reports ``log π(y_t | x, y_<t)`` for the tokens it sampled; the trainer recomputes them
with a teacher-forced forward pass (:func:`~alignlit.models.forward.response_logprobs`). When the
engine generates with the policy's current weights the two agree to float32 round-off (~1e-6 on
the tiny test models); a missed ``sync``, wrong weight names or a different tokenization shows up
as differences of order 0.1–1.
"""

from __future__ import annotations

import torch

from alignlit.models.forward import response_logprobs
from alignlit.rollout.base import Rollout


class ParityError(RuntimeError):
    """The engine's log-probs disagree with the policy's: its rollouts would be off-policy."""


def logprob_parity(
    policy: torch.nn.Module, rollout: Rollout, *, temperature: float, max_samples: int = 4
) -> dict[str, float]:
    """Compare ``rollout.logprobs`` with the policy's teacher-forced log-probs on a few samples.

    Uses the first ``max_samples`` samples that have at least one response token, trimmed to their
    own prompt/response widths, in eval mode under ``torch.no_grad`` (the policy's train/eval mode is restored).

    Args:
        policy: the causal LM the engine should be generating with.
        rollout: an engine's output.
        temperature: the temperature the rollout was sampled at (0 for greedy).
        max_samples: how many samples to recompute.

    Returns:
        ``{"max_abs_diff", "mean_abs_diff", "num_tokens"}`` over the compared response tokens
        (``nan`` differences and 0 tokens when no sample has a response token).
    """
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    rows = rollout.response_mask.any(-1).nonzero().flatten()[:max_samples]  # (S,)
    if len(rows) == 0:
        return {"max_abs_diff": float("nan"), "mean_abs_diff": float("nan"), "num_tokens": 0}
    prompt_mask = rollout.prompt_mask[rows]
    response_mask = rollout.response_mask[rows]
    first = int(prompt_mask.any(0).nonzero()[0])  # drop columns that are padding in every row
    width = int(response_mask.sum(-1).max())
    prompt_mask = prompt_mask[:, first:]  # (S, P')
    response_mask = response_mask[:, :width]  # (S, T')
    num_tokens = int(response_mask.sum())

    device = next(policy.parameters()).device
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            trainer_logprobs = response_logprobs(
                policy,
                rollout.prompt_ids[rows][:, first:].to(device),
                prompt_mask.to(device),
                rollout.response_ids[rows][:, :width].to(device),
                response_mask.to(device),
                temperature=temperature,
            )  # (S, T)
    finally:
        policy.train(was_training)
    engine_logprobs = rollout.logprobs[rows][:, :width].to(device=device, dtype=trainer_logprobs.dtype)
    diff = (trainer_logprobs - engine_logprobs).abs()[response_mask.to(device)]  # (num_tokens,)
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "num_tokens": num_tokens,
    }


def check_parity(
    policy: torch.nn.Module,
    rollout: Rollout,
    *,
    temperature: float,
    tol: float = 1e-3,
    max_samples: int = 4,
) -> dict[str, float]:
    """:func:`logprob_parity`, raising :class:`ParityError` when ``max_abs_diff > tol`` (or not finite).

    A rollout without a single response token has nothing to compare and passes.

    The default ``tol = 1e-3`` is loose enough for float32 engines with different kernels and far
    below the ~0.1+ a stale engine produces. Use a larger one for bfloat16 engines.

    Returns:
        the parity metrics when they pass.
    """
    metrics = logprob_parity(policy, rollout, temperature=temperature, max_samples=max_samples)
    if metrics["num_tokens"] == 0:
        return metrics
    max_diff = metrics["max_abs_diff"]
    if not max_diff <= tol:
        raise ParityError(
            f"engine log-probs differ from the policy's by up to {max_diff:.3g} (mean "
            f"{metrics['mean_abs_diff']:.3g}, {metrics['num_tokens']} tokens, tol {tol:g}): the engine "
            "is generating with different weights (missed sync?), a different tokenization or a "
            "different temperature; its rollouts would be off-policy"
        )
    return metrics
