"""Evaluate a policy on real prompts with a verifiable reward: accuracy, pass@k, length, KL.

A sample is *correct* when the reward gives it at least ``threshold`` (1.0 for a 0/1 answer check such
as :class:`~alignlit.rewards.MathVerifyReward`). For each policy:

- ``accuracy``: the mean correctness of one greedy response per prompt (when ``greedy``);
- ``mean@k``: the mean correctness of ``k`` sampled responses per prompt (temperature ``T``), and
  ``pass@k`` with the unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)`` per prompt
  from ``n = k`` samples of which ``c`` are correct (so here simply: any of the ``k`` correct);
- the mean response length in tokens, the share of responses cut at ``max_new_tokens``;
- ``kl``: the Monte-Carlo ``KL(π ‖ π_ref)`` per response on the sampled responses (with a reference).

The prompts are the ones training renders (a :class:`~alignlit.data.PromptDataModule` builds them), so the
chat template, system prompt and the reference answer each prompt carries are the same as in training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from alignlit.eval.gold import chunked_rollouts, kl_to_reference
from alignlit.rollout.base import SamplingParams
from alignlit.rollout.reward_protocol import Reward, score_texts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (Chen et al., 2021): ``1 - C(n-c, k)/C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class VerifiableResult:
    """One policy's row (see the module docstring); None where a row was not asked for."""

    name: str
    prompts: int
    accuracy: float | None
    accuracy_stderr: float | None
    k: int
    temperature: float
    mean_at_k: float | None
    pass_at_k: float | None
    length: float
    truncated: float
    kl_to_reference: float | None
    per_prompt_correct: list[float] | None = None

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["per_prompt_correct"]
        return out


def _scores(reward: Reward, rollout, threshold: float) -> torch.Tensor:
    return (score_texts(reward, rollout.prompts, rollout.texts) >= threshold).double()


def evaluate_verifiable(
    policy,
    tokenizer,
    prompts: Sequence[str],
    reward: Reward,
    *,
    name: str = "policy",
    greedy: bool = True,
    k: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = 512,
    threshold: float = 1.0,
    reference=None,
    seed: int = 0,
    batch_size: int = 32,
    progress: bool = False,
) -> VerifiableResult:
    """The row of one policy (see the module docstring). ``k = 0``: no sampled rows."""
    if not greedy and k < 1:
        raise ValueError("evaluate_verifiable: nothing to do (greedy is False and k < 1)")
    accuracy = stderr = mean_k = pass_k = kl = None
    lengths, cut, per_prompt = [], [], None
    common = dict(batch_size=batch_size, progress=progress)
    if greedy:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        correct = []
        for rollout in chunked_rollouts(
            policy, tokenizer, prompts, n=1, sampling=sampling, desc=f"greedy {name}", **common
        ):
            correct.append(_scores(reward, rollout, threshold))
            lengths.append(rollout.response_lengths.float())
            cut += [r == "length" for r in rollout.finish_reasons]
        values = torch.cat(correct)
        accuracy = values.mean().item()
        stderr = values.std(unbiased=True).item() / len(values) ** 0.5 if len(values) > 1 else float("nan")
        per_prompt = values.tolist()
    if k >= 1:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        correct, kls = [], []
        for rollout in chunked_rollouts(
            policy, tokenizer, prompts, n=k, sampling=sampling, desc=f"{k} samples {name}", **common
        ):
            correct.append(_scores(reward, rollout, threshold).view(-1, k))
            if not greedy:
                lengths.append(rollout.response_lengths.float())
                cut += [r == "length" for r in rollout.finish_reasons]
            if reference is not None:
                kls.append(kl_to_reference(rollout, reference, temperature=temperature))
        values = torch.cat(correct)  # (B, k)
        mean_k = values.mean().item()
        pass_k = sum(pass_at_k(k, int(c), k) for c in values.sum(-1).tolist()) / len(values)
        kl = torch.cat(kls).mean().item() if kls else None
        if per_prompt is None:
            per_prompt = values.mean(-1).tolist()
    return VerifiableResult(
        name, len(prompts), accuracy, stderr, k, temperature, mean_k, pass_k,
        torch.cat(lengths).mean().item(), sum(cut) / max(len(cut), 1), kl, per_prompt,
    )  # fmt: skip


def format_verifiable(results: Sequence[VerifiableResult]) -> str:
    """A Markdown table of :class:`VerifiableResult` rows."""
    k = next((r.k for r in results if r.k), 0)
    t = next((r.temperature for r in results if r.k), 1.0)
    head = ["policy", "prompts", "accuracy (greedy)", "± s.e."]
    if k:
        head += [f"mean@{k} (T={t:g})", f"pass@{k}"]
    head += ["length (tokens)", "cut at limit", "KL to reference"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def f(v, spec=".3f"):
        return "" if v is None else format(v, spec)

    for r in results:
        row = [r.name, str(r.prompts), f(r.accuracy), f(r.accuracy_stderr)]
        if k:
            row += [f(r.mean_at_k), f(r.pass_at_k)]
        row += [f(r.length, ".1f"), f(r.truncated, ".1%"), f(r.kl_to_reference)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
