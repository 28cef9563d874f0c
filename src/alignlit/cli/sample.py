"""``alignlit sample``: n responses per prompt from a policy, scored and ranked, written as JSONL.

Each output row is one prompt with its responses sorted best first (see
:class:`alignlit.data.pairs_from_rm.RankedGroup`)::

    {"prompt": "...", "responses": [...], "scores": [...], "lengths": [...]}

The same run can also write DPO pairs (best vs worst, ``--pairs``) and rejection-sampling SFT
records (best of n, ``--rft``). The scorer is a reward-model directory, ``gold`` with ``--sim`` for the
simulated task's gold reward, or the dotted path of a reward function. Example (the quickstart)::

    alignlit sample --policy out/quickstart/sft --prompts data/sim/prompts_train.jsonl --n 4 \\
        --scorer out/quickstart/reward --out out/quickstart/samples/ranked.jsonl \\
        --pairs out/quickstart/samples/pairs.jsonl --rft out/quickstart/samples/rft.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from alignlit.data.encoding import OVERFLOW_CHOICES
from alignlit.data.pairs_from_rm import RankedGroup, best_of_n_records, best_worst_pairs, write_jsonl
from alignlit.data.records import DataError, read_records
from alignlit.data.sft import record_prompt
from alignlit.data.sources import columns_from_pairs, rename_columns
from alignlit.eval.lengths import Reader, describe, fit_prompts
from alignlit.hub import ModelNotFoundError, RemoteCodeError, is_repo_id
from alignlit.models.reward_model import model_positions, resolve_model_path
from alignlit.rollout.base import SamplingParams
from alignlit.rollout.reward_protocol import resolve_reward, score_texts
from alignlit.rollout.sampling import Scorer, sample_ranked


def load_scorer(spec: str, *, sim: str | Path | None = None, batch_size: int = 64) -> Scorer:
    """The scorer a ``--scorer`` value names: ``"gold"`` (the simulated task's gold reward,
    :class:`alignlit.sim.SimGoldReward` of ``sim``, the ``alignlit sim make-data`` directory), a
    reward-model directory, or the dotted path of a reward function
    (:func:`alignlit.rollout.reward_protocol.resolve_reward`, ``batch_size`` sequences per forward)."""
    if spec == "gold":
        if sim is None:
            raise ValueError(
                "--scorer gold needs --sim DIR (the directory written by `alignlit sim make-data`)"
            )
        from alignlit.sim import SimGoldReward

        return SimGoldReward(str(sim)).task.gold_rewards
    if is_repo_id(spec) and not Path(spec).exists():  # a reward model by hub id: its snapshot directory
        spec = str(resolve_model_path(spec, what="scorer"))
    if ("/" in spec or Path(spec).exists()) and not Path(spec).is_dir():
        raise FileNotFoundError(f"scorer {spec!r} is neither 'gold' nor a reward-model directory")
    reward = resolve_reward(spec, batch_size=batch_size)

    def scorer(prompts, responses):
        return score_texts(reward, prompts, responses).tolist()

    scorer.reward = reward  # for the truncation report of a reward model (RewardModel.counts)
    return scorer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignlit sample", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policy", required=True, help="policy directory (any stage's export) or hub id org/name[@revision]"
    )
    p.add_argument(
        "--prompts", required=True, help="prompt records (JSONL/JSON/Parquet; 'prompt' or HH format)"
    )
    p.add_argument("--n", type=int, default=4, help="responses per prompt (default: %(default)s)")
    p.add_argument("--out", required=True, help="ranked JSONL to write")
    p.add_argument(
        "--scorer",
        help="reward-model directory, 'gold' (needs --sim), or a reward function's dotted path; none: unscored",
    )
    p.add_argument("--sim", help="`alignlit sim make-data` directory (for --scorer gold)")
    p.add_argument("--pairs", help="also write best-vs-worst DPO pairs here")
    p.add_argument("--rft", help="also write best-of-n SFT records here (rejection-sampling fine-tuning)")
    p.add_argument(
        "--length-penalty",
        type=float,
        default=0.0,
        help="λ: choose best/worst by score - λ·tokens for --pairs/--rft (default: %(default)s)",
    )
    p.add_argument(
        "--min-gap",
        type=float,
        default=0.0,
        help="--pairs keeps pairs whose score gap is > this (default: 0)",
    )
    p.add_argument("--max-prompts", type=int, help="use only the first N prompts")
    p.add_argument(
        "--chat",
        action="store_true",
        help="render string prompts as a user message with the policy's chat template (message-list prompts "
        "always are), as PromptDataModule(chat=True) does in training",
    )
    p.add_argument("--system-prompt", help="a system message before every rendered prompt")
    p.add_argument(
        "--columns",
        nargs="*",
        default=[],
        metavar="SRC:DST",
        help="rename record fields, e.g. question:prompt",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k (default: 0, off)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="response token limit (default: 24)")
    p.add_argument(
        "--prompt-overflow",
        choices=OVERFLOW_CHOICES,
        default="error",
        help="a prompt too long for the policy's positions with --max-new-tokens after it: refuse "
        "('error', the default), keep its end ('truncate') or leave it out ('drop'); counted",
    )
    p.add_argument("--stop", nargs="*", default=[], help="stop strings, e.g. '\\n\\nHuman:'")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per generate call (default: 64)")
    p.add_argument("--dtype", default="float32", help="dtype the policy is loaded in (default: float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def sample_with_progress(
    policy, tokenizer, prompts, *, n, sampling, scorer, batch_size, progress
) -> tuple[list[RankedGroup], Counter]:
    """:func:`~alignlit.rollout.sampling.sample_ranked` one chunk of ``batch_size`` prompts at a time,
    with a tqdm bar over the prompts. Chunk ``c`` is sampled with seed ``sampling.seed + c``, exactly as
    one ``sample_ranked`` call over all prompts samples it, so the output does not depend on the bar."""
    from tqdm.auto import tqdm

    groups: list[RankedGroup] = []
    counts: Counter = Counter()
    with tqdm(
        total=len(prompts), desc="alignlit sample", unit="prompt", disable=not progress, dynamic_ncols=True
    ) as bar:
        for chunk, start in enumerate(range(0, len(prompts), batch_size)):
            seed = None if sampling.seed is None else sampling.seed + chunk
            got, got_counts = sample_ranked(
                policy,
                tokenizer,
                prompts[start : start + batch_size],
                n=n,
                sampling=SamplingParams(**{**vars(sampling), "seed": seed}),
                scorer=scorer,
                batch_size=batch_size,
            )
            groups += got
            counts.update(got_counts)
            bar.update(len(prompts[start : start + batch_size]))
    return groups, +counts


def main(argv: Sequence[str] | None = None) -> list[RankedGroup]:
    """Run ``alignlit sample``; returns the ranked groups it wrote."""
    from alignlit.models import load_policy

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_prompts is not None and args.max_prompts < 1:
        parser.error(f"--max-prompts must be >= 1, got {args.max_prompts}")
    if (args.pairs or args.rft) and not args.scorer:
        parser.error("--pairs and --rft need --scorer (a reward-model directory or 'gold')")
    if args.pairs and args.n < 2:
        parser.error("--pairs needs --n >= 2")
    try:
        columns = columns_from_pairs(args.columns)
    except ValueError as e:
        parser.error(str(e))
    records = rename_columns(read_records(args.prompts)[: args.max_prompts], columns)
    if not records:
        parser.error(f"{args.prompts}: no prompts")
    try:  # a hub id that does not resolve, or a model that needs its own code: one line, no traceback
        scorer = load_scorer(args.scorer, sim=args.sim, batch_size=args.batch_size) if args.scorer else None
        policy, tokenizer = load_policy(args.policy, dtype=args.dtype)
    except (ModelNotFoundError, RemoteCodeError) as e:
        sys.exit(f"alignlit sample: {e}")
    try:
        prompts = [
            record_prompt(r, tokenizer, chat=args.chat, system_prompt=args.system_prompt) for r in records
        ]
    except DataError as e:
        parser.error(str(e))
    policy.eval()
    readers = [Reader(f"the policy {args.policy}", tokenizer, model_positions(policy.config))]
    try:
        prompts, fitted = fit_prompts(
            prompts,
            readers,
            max_new_tokens=args.max_new_tokens,
            overflow=args.prompt_overflow,
            sources=[r.source for r in records],
        )
    except ValueError as e:
        parser.error(str(e))
    if describe(fitted, readers, args.max_new_tokens):
        print(f"alignlit sample: {describe(fitted, readers, args.max_new_tokens)}")
    if not prompts:
        parser.error(f"{args.prompts}: no prompt fits the policy (--prompt-overflow drop left none)")
    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        stop=list(args.stop),
        seed=args.seed,
    )
    torch.manual_seed(args.seed)
    groups, counts = sample_with_progress(
        policy,
        tokenizer,
        prompts,
        n=args.n,
        sampling=sampling,
        scorer=scorer,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    write_jsonl([g.to_record() for g in groups], args.out)
    summary = f"alignlit sample: {len(groups)} prompts x {args.n} responses -> {args.out}"
    if scorer is not None and groups:
        mean = sum(sum(g.scores) for g in groups) / sum(len(g.scores) for g in groups)
        best = sum(g.scores[0] for g in groups) / len(groups)
        summary += f"; mean score {mean:.4f}, mean best-of-{args.n} score {best:.4f}"
    print(summary + (f" (left out: {dict(counts)})" if counts else ""))
    rm_cut = getattr(getattr(scorer, "reward", None), "describe_truncation", None)
    if callable(rm_cut) and rm_cut():
        print(f"alignlit sample: {rm_cut()}")
    if args.pairs:
        pairs, counts = best_worst_pairs(groups, length_penalty=args.length_penalty, min_gap=args.min_gap)
        write_jsonl(pairs, args.pairs)
        print(f"alignlit sample: {len(pairs)} pairs -> {args.pairs} ({dict(counts)})")
    if args.rft:
        records, counts = best_of_n_records(groups, length_penalty=args.length_penalty)
        write_jsonl(records, args.rft)
        print(f"alignlit sample: {len(records)} best-of-{args.n} SFT records -> {args.rft} ({dict(counts)})")
    return groups
