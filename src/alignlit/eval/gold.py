"""Evaluate policies on held-out prompts: gold reward, response length, KL to a reference.

Used by ``alignlit eval`` and the quality benchmark; works with any reward callable
``reward_fn(prompts, responses) -> list[float]`` (the simulated task's gold reward, a trained
reward model's ``score``), called through :func:`~alignlit.rollout.reward_protocol.score_texts` (checked, and
given the prompts' record columns such as a reference ``answer`` when it names them). Prompts are sampled in chunks of ``batch_size`` (one progress-bar step
each) from one seeded random stream, so the samples do not depend on ``progress``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from alignlit.models.forward import response_logprobs
from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.hf_engine import HFEngine
from alignlit.rollout.reward_protocol import RewardFn, score_texts


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
    prompt_gold: list[float] | None = field(default=None, repr=False, compare=False)
    """Per prompt, in prompt order: the mean gold reward of its samples (the kept one for best-of-n);
    what :func:`win_rate` compares. Not part of :meth:`as_dict`."""

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["prompt_gold"]
        return out


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


def chunked_rollouts(
    policy,
    tokenizer,
    prompts: Sequence[str],
    *,
    n: int,
    sampling: SamplingParams,
    batch_size: int = 64,
    progress: bool = False,
    desc: str | None = None,
) -> Iterator[Rollout]:
    """``n`` responses per prompt, one :class:`Rollout` per chunk of ``batch_size`` prompts, in order.

    With ``sampling.seed`` set, the chunks are drawn from one stream seeded with it on a forked RNG
    (the global RNG state is unchanged afterwards), so the samples are those of one
    :func:`sample_responses` call with the same ``batch_size``. ``progress`` shows a tqdm bar over
    the prompts (on stderr), labelled ``desc``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    engine = HFEngine(tokenizer, policy, micro_batch_size=batch_size)
    device = next(policy.parameters()).device
    unseeded = SamplingParams(**{**vars(sampling), "seed": None})
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc=desc, unit="prompt", dynamic_ncols=True)
    try:
        with torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], enabled=sampling.seed is not None
        ):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            for start in range(0, len(prompts), batch_size):
                chunk = list(prompts[start : start + batch_size])
                yield engine.generate(chunk, n, unseeded)
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()


def _mode(sampling: SamplingParams) -> str:
    return "greedy" if sampling.temperature == 0 else f"T={sampling.temperature:g}"


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
    progress: bool = False,
) -> EvalResult:
    """Sample ``n`` responses per prompt and report mean gold reward, length (tokens) and KL
    (``progress``: a tqdm bar over the prompts)."""
    gold, lengths, kls = [], [], []
    for rollout in chunked_rollouts(
        policy,
        tokenizer,
        prompts,
        n=n,
        sampling=sampling,
        batch_size=batch_size,
        progress=progress,
        desc=f"eval {name}",
    ):
        gold.append(score_texts(reward_fn, rollout.prompts, rollout.texts).double())
        lengths.append(rollout.response_lengths.float())
        if reference is not None:
            kls.append(kl_to_reference(rollout, reference, temperature=sampling.temperature))
    all_gold = torch.cat(gold)  # (B * n,)
    mean, stderr = _stats(all_gold)
    kl = torch.cat(kls).mean().item() if kls else None
    return EvalResult(
        name,
        _mode(sampling),
        mean,
        stderr,
        torch.cat(lengths).mean().item(),
        kl,
        all_gold.numel(),
        prompt_gold=all_gold.view(-1, n).mean(-1).tolist(),
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
    progress: bool = False,
) -> EvalResult:
    """Best-of-n: sample ``n`` responses per prompt, keep the one ``select_fn`` scores highest (a
    reward model; default: ``reward_fn`` itself, the oracle), report the gold reward of the kept ones
    (``progress``: a tqdm bar over the prompts).

    The KL of best-of-n to the sampling policy is the analytic ``log n - (n-1)/n``
    (Stiennon et al., 2020), reported as ``kl_to_reference``.
    """
    kept, lengths = [], []
    for rollout in chunked_rollouts(
        policy,
        tokenizer,
        prompts,
        n=n,
        sampling=sampling,
        batch_size=batch_size,
        progress=progress,
        desc=f"best-of-{n} {name}",
    ):
        gold = score_texts(reward_fn, rollout.prompts, rollout.texts).double().view(-1, n)  # (B, n)
        select = gold
        if select_fn is not None:
            scores = list(select_fn(rollout.prompts, rollout.texts))
            select = torch.tensor(scores, dtype=torch.float64).view(-1, n)  # (B, n)
        best = select.argmax(-1)  # (B,)
        kept.append(gold.gather(-1, best[:, None]).squeeze(-1))
        lengths.append(rollout.response_lengths.view(-1, n).gather(-1, best[:, None]).squeeze(-1).float())
    all_kept = torch.cat(kept)  # (B,)
    mean, stderr = _stats(all_kept)
    mode = f"best-of-{n}" + ("" if select_fn is None else " (RM)")
    kl = float(torch.log(torch.tensor(float(n))) - (n - 1) / n)
    return EvalResult(
        name,
        mode,
        mean,
        stderr,
        torch.cat(lengths).mean().item(),
        kl,
        all_kept.numel() * n,
        prompt_gold=all_kept.tolist(),
    )


def win_rate(policy_gold: Sequence[float], baseline_gold: Sequence[float]) -> float:
    """Fraction of prompts on which the policy's gold reward beats the baseline's, ties counting ½:
    ``mean_i [g_i > b_i] + ½·[g_i = b_i]`` over per-prompt values in the same prompt order
    (:attr:`EvalResult.prompt_gold`)."""
    if len(policy_gold) != len(baseline_gold) or not policy_gold:
        raise ValueError(
            f"win_rate needs two equally long non-empty per-prompt lists, got {len(policy_gold)} "
            f"and {len(baseline_gold)}"
        )
    g = torch.tensor(list(policy_gold), dtype=torch.float64)
    b = torch.tensor(list(baseline_gold), dtype=torch.float64)
    return float(((g > b).double() + 0.5 * (g == b).double()).mean())


def format_table(results: Sequence[EvalResult], *, baseline: str | None = None) -> str:
    """A Markdown table of results; with ``baseline`` (a row name), a column with each row's
    :func:`win_rate` against the first row of that name (same prompts, per-prompt gold)."""
    base = None
    if baseline is not None:
        base = next((r for r in results if r.name == baseline), None)
        if base is None or base.prompt_gold is None:
            raise ValueError(f"format_table: no row {baseline!r} with per-prompt gold among the results")
    win_header = "" if base is None else f" win vs {baseline} |"
    lines = [
        f"| policy | mode | gold reward | ± s.e. | length (tokens) | KL to reference |{win_header} samples |",
        "|---|---|---:|---:|---:|---:|" + ("---:|" if base is not None else "") + "---:|",
    ]
    for r in results:
        kl = "" if r.kl_to_reference is None else f"{r.kl_to_reference:.3f}"
        win = ""
        if base is not None:
            win = " |" if r.prompt_gold is None else f" {win_rate(r.prompt_gold, base.prompt_gold):.3f} |"
        lines.append(
            f"| {r.name} | {r.mode} | {r.gold:.3f} | {r.gold_stderr:.3f} | {r.length:.1f} | {kl} |{win} "
            f"{r.samples} |"
        )
    return "\n".join(lines)
