"""n responses per prompt from a policy, scored and ranked (:func:`sample_ranked`).

Each group is one prompt with its responses sorted best first (see
:class:`alignlit.data.pairs_from_rm.RankedGroup`); ``alignlit sample`` (:mod:`alignlit.cli.sample`)
writes them as JSONL, with DPO pairs and rejection-sampling SFT records built from them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from alignlit.data.pairs_from_rm import RankedGroup
from alignlit.rollout.base import SamplingParams
from alignlit.rollout.hf_engine import HFEngine

Scorer = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
"""``scorer(prompts, responses) -> scores``, one score per (prompt, response); higher is better."""


def sample_ranked(
    policy,
    tokenizer,
    prompts: Sequence[str],
    *,
    n: int,
    sampling: SamplingParams,
    scorer: Scorer | None,
    batch_size: int = 64,
    log_every: int = 0,
) -> tuple[list[RankedGroup], Counter]:
    """Sample ``n`` responses per prompt with :class:`~alignlit.rollout.HFEngine`, score them, and
    return one group per prompt, sorted best first (unsorted, with ``scores=None``, when ``scorer`` is None).

    Blank responses (e.g. an immediate EOS) can be neither scored by a reward model nor trained on:
    they are left out of their group, so a group may hold fewer than ``n`` responses; a prompt whose
    responses are all blank gives no group. Both are counted in the returned Counter
    (``blank_responses``, ``prompts_without_response``). Prompts are processed in chunks of
    ``batch_size``; with ``sampling.seed`` set, chunk ``c`` is sampled with seed ``sampling.seed + c``,
    so the output is reproducible for a given batch size.

    Returns:
        ``(groups, counts)``.
    """
    engine = HFEngine(tokenizer, policy, micro_batch_size=batch_size)
    groups: list[RankedGroup] = []
    counts: Counter = Counter()
    start_time = time.perf_counter()
    for chunk, start in enumerate(range(0, len(prompts), batch_size)):
        chunk_prompts = list(prompts[start : start + batch_size])
        seed = None if sampling.seed is None else sampling.seed + chunk
        params = SamplingParams(**{**vars(sampling), "seed": seed})
        rollout = engine.generate(chunk_prompts, n, params)
        kept = [j for j, text in enumerate(rollout.texts) if text.strip()]  # rollout rows with text
        counts["blank_responses"] += len(rollout) - len(kept)
        texts = [rollout.texts[j] for j in kept]
        scores = None
        if scorer is not None:
            scores = [float(s) for s in scorer([rollout.prompts[j] for j in kept], texts)]
            if len(scores) != len(kept):
                raise ValueError(f"scorer returned {len(scores)} scores for {len(kept)} responses")
        lengths = rollout.response_lengths.tolist()
        for i, prompt in enumerate(chunk_prompts):
            mine = [m for m, j in enumerate(kept) if j // n == i]  # positions in ``kept``
            if not mine:
                counts["prompts_without_response"] += 1
                continue
            group = RankedGroup(
                prompt,
                [texts[m] for m in mine],
                None if scores is None else [scores[m] for m in mine],
                [lengths[kept[m]] for m in mine],
            )
            groups.append(group if scorer is None else group.ranked())
        if log_every and (chunk + 1) % log_every == 0:
            elapsed = time.perf_counter() - start_time
            print(
                f"alignlit sample: {start + len(chunk_prompts)}/{len(prompts)} prompts ({elapsed:.0f} s)",
                flush=True,
            )
    return groups, +counts
