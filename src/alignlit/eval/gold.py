"""Evaluate policies on held-out prompts: gold reward, response length, KL to a reference.

Used by ``alignlit eval`` and the quality benchmark; works with any reward callable
``reward_fn(prompts, responses) -> list[float]`` (the simulated task's gold reward, a trained
reward model's ``score``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from alignlit.models.forward import response_logprobs
from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.hf_engine import HFEngine
from alignlit.rollout.reward import RewardFn


@dataclass
class EvalResult:
    """Mean (and standard error) of the gold reward over all samples, and diagnostics.

    ``kl_to_reference`` is the Monte-Carlo estimate of ``KL(π ‖ π_ref)`` per response,
    ``mean over samples of Σ_t (log π(y_t) - log π_ref(y_t))`` on the sampled tokens (unbiased for
    samples drawn at temperature 1; None without a reference).
    """

    name: str
    mode: str
    gold: float
    gold_stderr: float
    length: float
    kl_to_reference: float | None
    samples: int

    def as_dict(self) -> dict:
        return asdict(self)


def _stats(values: torch.Tensor) -> tuple[float, float]:
    n = values.numel()
    stderr = values.std(unbiased=True).item() / n**0.5 if n > 1 else float("nan")
    return values.mean().item(), stderr


def sample_responses(
    policy, tokenizer, prompts: Sequence[str], *, n: int, sampling: SamplingParams, batch_size: int = 64
) -> Rollout:
    """``n`` responses per prompt from ``policy`` with the embedded engine."""
    return HFEngine(tokenizer, policy, micro_batch_size=batch_size).generate(prompts, n, sampling)


@torch.no_grad()
def kl_to_reference(rollout: Rollout, reference, *, temperature: float) -> torch.Tensor:
    """(N,) per-response ``Σ_t (log π - log π_ref)`` over the sampled tokens."""
    ref = response_logprobs(
        reference,
        rollout.prompt_ids,
        rollout.prompt_mask,
        rollout.response_ids,
        rollout.response_mask,
        temperature=temperature,
    )
    return ((rollout.logprobs - ref) * rollout.response_mask).sum(-1)


def evaluate_policy(
    policy,
    tokenizer,
    prompts: Sequence[str],
    reward_fn: RewardFn,
    *,
    sampling: SamplingParams,
    n: int = 1,
    reference=None,
    name: str = "policy",
    batch_size: int = 64,
) -> EvalResult:
    """Sample ``n`` responses per prompt and report mean gold reward, length (tokens) and KL."""
    rollout = sample_responses(policy, tokenizer, prompts, n=n, sampling=sampling, batch_size=batch_size)
    gold = torch.tensor(list(reward_fn(rollout.prompts, rollout.texts)), dtype=torch.float64)
    mean, stderr = _stats(gold)
    kl = None
    if reference is not None:
        kl = kl_to_reference(rollout, reference, temperature=sampling.temperature).mean().item()
    mode = "greedy" if sampling.temperature == 0 else f"T={sampling.temperature:g}"
    return EvalResult(
        name, mode, mean, stderr, rollout.response_lengths.float().mean().item(), kl, len(rollout)
    )


def best_of_n(
    policy,
    tokenizer,
    prompts: Sequence[str],
    reward_fn: RewardFn,
    *,
    n: int,
    sampling: SamplingParams,
    select_fn: RewardFn | None = None,
    name: str = "policy",
    batch_size: int = 64,
) -> EvalResult:
    """Best-of-n: sample ``n`` responses per prompt, keep the one ``select_fn`` scores highest (a
    reward model; default: ``reward_fn`` itself, the oracle), report the gold reward of the kept ones.

    The KL of best-of-n to the sampling policy is the analytic ``log n - (n-1)/n``
    (Stiennon et al., 2020), reported as ``kl_to_reference``.
    """
    rollout = sample_responses(policy, tokenizer, prompts, n=n, sampling=sampling, batch_size=batch_size)
    gold = torch.tensor(list(reward_fn(rollout.prompts, rollout.texts)), dtype=torch.float64).view(-1, n)
    select = (
        gold
        if select_fn is None
        else torch.tensor(list(select_fn(rollout.prompts, rollout.texts)), dtype=torch.float64).view(-1, n)
    )
    best = select.argmax(-1)  # (B,)
    mode = f"best-of-{n}" + ("" if select_fn is None else " (RM)")
    kept = gold.gather(-1, best[:, None]).squeeze(-1)
    lengths = rollout.response_lengths.view(-1, n).gather(-1, best[:, None]).squeeze(-1).float()
    mean, stderr = _stats(kept)
    kl = float(torch.log(torch.tensor(float(n))) - (n - 1) / n)
    return EvalResult(name, mode, mean, stderr, lengths.mean().item(), kl, len(rollout))


def format_table(results: Sequence[EvalResult]) -> str:
    """A Markdown table of results."""
    lines = [
        "| policy | mode | gold reward | ± s.e. | length (tokens) | KL to reference | samples |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        kl = "" if r.kl_to_reference is None else f"{r.kl_to_reference:.3f}"
        lines.append(
            f"| {r.name} | {r.mode} | {r.gold:.3f} | {r.gold_stderr:.3f} | {r.length:.1f} | {kl} | {r.samples} |"
        )
    return "\n".join(lines)
