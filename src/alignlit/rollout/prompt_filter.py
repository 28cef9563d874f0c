"""Prompt filtering by reward variance (ChatGLM-RLHF §3.4).

For each prompt the policy samples ``k`` responses and the reward scores them; a prompt whose
rewards vary by less than ``epsilon`` (unbiased variance over the ``k`` samples) offers little to
learn from against the current policy and is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from alignlit.data.args import resolve_seed
from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.reward_protocol import Reward, score_rollout

Generate = Callable[[Sequence[str], int, SamplingParams], Rollout]
"""``generate(prompts, n, sampling) -> Rollout``: an engine's ``generate`` or the rollout loop's."""


def reward_variance(
    generate: Generate,
    reward: Reward,
    prompts: Sequence[str],
    *,
    k: int,
    sampling: SamplingParams,
    batch_size: int = 64,
) -> torch.Tensor:
    """(B,) unbiased variance of the rewards of ``k`` sampled responses per prompt.

    Prompts go to ``generate`` ``batch_size`` at a time; with ``sampling.seed`` set, chunk ``c`` is
    sampled with seed ``sampling.seed + c`` (reproducible for a given batch size).
    """
    if k < 2:
        raise ValueError(f"reward variance needs k >= 2 samples per prompt, got k={k}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    variances = []
    for chunk, start in enumerate(range(0, len(prompts), batch_size)):
        seed = None if sampling.seed is None else sampling.seed + chunk
        params = SamplingParams(**{**vars(sampling), "seed": seed})
        rollout = generate(list(prompts[start : start + batch_size]), k, params)
        rewards = score_rollout(reward, rollout).view(-1, k).double()  # (b, k)
        variances.append(rewards.var(dim=-1, unbiased=True))
    return torch.cat(variances) if variances else torch.zeros(0, dtype=torch.float64)


@dataclass
class PromptFilter:
    """Drop prompts whose reward variance over ``k`` policy samples is below ``epsilon``.

    Args:
        k: responses sampled per prompt (>= 2).
        epsilon: prompts with variance ``< epsilon`` are dropped.
        sampling: how the ``k`` responses are sampled (default: like the stage's rollouts — same
            temperature, length limit and stop strings — seeded with ``seed``).
        seed: sampling seed when ``sampling`` is not given (makes the filter reproducible; None: the run's
            ``seed_everything``, :func:`alignlit.data.args.resolve_seed`).
        batch_size: prompts per ``generate`` call.
    """

    k: int = 4
    epsilon: float = 1e-3
    sampling: SamplingParams | None = None
    seed: int | None = None
    batch_size: int = 64

    def __post_init__(self) -> None:
        self.seed = resolve_seed(self.seed)
        if self.k < 2:
            raise ValueError(f"prompt_filter.k must be >= 2, got {self.k}")
        if self.batch_size < 1:
            raise ValueError(f"prompt_filter.batch_size must be >= 1, got {self.batch_size}")

    def __call__(
        self,
        generate: Generate,
        reward: Reward,
        prompts: Sequence[str],
        *,
        default_sampling: SamplingParams | None = None,
    ) -> tuple[list[str], dict[str, float]]:
        """The kept prompts (in their order) and a report ``{prompts, kept, dropped, mean_variance}``.

        ``default_sampling`` (the rollout's) is used, seeded with :attr:`seed`, when :attr:`sampling`
        is None.
        """
        sampling = self.sampling
        if sampling is None:
            sampling = replace(default_sampling or SamplingParams(), seed=self.seed)
        variances = reward_variance(
            generate, reward, prompts, k=self.k, sampling=sampling, batch_size=self.batch_size
        )
        keep = (variances >= self.epsilon).tolist()
        kept = [p for p, ok in zip(prompts, keep) if ok]
        report = {
            "prompts": float(len(prompts)),
            "kept": float(len(kept)),
            "dropped": float(len(prompts) - len(kept)),
            "mean_variance": float(variances.mean()) if len(variances) else float("nan"),
        }
        return kept, report
