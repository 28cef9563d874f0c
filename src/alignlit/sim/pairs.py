"""More annotator labels for a written simulated data set: extra demonstration pairs, and pairs of a
policy's own samples (on-policy pairs, as RLHF-Workflow labels the policy's samples).

Both add files next to those of ``alignlit sim make-data`` and leave them unchanged; both label with the
annotator recorded in its ``manifest.json`` (same τ, length bias and label noise) and with their own seeded
generator, and both write only training-split prompts, so validation and test prompts never reach a
reward model through them:

- :func:`make_extra_pairs`: ``n`` pairs of two different demonstrations on training prompts that no file
  of ``make-data`` uses (the prompts after its SFT, pair and online prompts in the same seeded order);
- :func:`label_samples`: pairs of different responses to one prompt from an ``alignlit sample`` output
  (``{"prompt", "responses": [...]}`` rows), ``pairs_per_prompt`` disjoint pairs per prompt.

Each writes ``{"prompt", "chosen", "rejected"}`` JSONL and a ``<name>.stats.json`` beside it (rows, how
often the annotator agrees with gold, how often the chosen response is the longer one).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from alignlit.sim.annotator import Annotator
from alignlit.sim.data import _mean, load_sim, two_demonstrations, write_jsonl
from alignlit.sim.task import SimTask, num_words, split_of

EXTRA_PAIRS = "pairs_extra_train.jsonl"
"""Where ``make-pairs`` writes under a ``make-data`` directory unless told otherwise."""


def annotator_of(manifest: dict[str, Any], task: SimTask, seed: int) -> Annotator:
    """The annotator a ``make-data`` manifest records, with generator seed ``seed``."""
    a = manifest["annotator"]
    return Annotator(
        temperature=a["temperature"],
        length_bias=a["length_bias"],
        label_noise=a["label_noise"],
        seed=seed,
        task=task,
    )


def _label(
    task: SimTask, annotator: Annotator, triples: list[tuple[str, str, str]], rng: random.Random
) -> tuple[list[dict], dict[str, Any]]:
    """Annotator-ordered ``{"prompt", "chosen", "rejected"}`` of each ``(prompt, y1, y2)``, and statistics."""
    rows, agree, decided, longer, unequal = [], 0, 0, 0, 0
    gold_chosen, gold_rejected, words_chosen, words_rejected = [], [], [], []
    for prompt, y1, y2 in triples:
        chosen, rejected = (y1, y2) if annotator.label(prompt, y1, y2, rng) else (y2, y1)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        gc, gr = task.gold_reward(prompt, chosen), task.gold_reward(prompt, rejected)
        wc, wr = num_words(chosen), num_words(rejected)
        gold_chosen.append(gc)
        gold_rejected.append(gr)
        words_chosen.append(wc)
        words_rejected.append(wr)
        if gc != gr:
            decided += 1
            agree += gc > gr
        if wc != wr:
            unequal += 1
            longer += wc > wr
    stats = {
        "rows": len(rows),
        "gold_ties": len(rows) - decided,
        "annotator_gold_agreement": round(agree / decided, 6) if decided else None,
        "chosen_mean_gold": _mean(gold_chosen),
        "rejected_mean_gold": _mean(gold_rejected),
        "chosen_mean_words": _mean(words_chosen),
        "rejected_mean_words": _mean(words_rejected),
        "chosen_longer_fraction": round(longer / unequal, 6) if unequal else None,
    }
    return rows, stats


def _write(out: Path, rows: list[dict], stats: dict[str, Any]) -> dict[str, Any]:
    write_jsonl(out, rows)
    stats_path = out.with_name(out.name.removesuffix(".jsonl") + ".stats.json")
    stats_path.write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats


def make_extra_pairs(
    sim_dir: str | Path, n: int, *, out: str | Path | None = None, seed: int = 1
) -> dict[str, Any]:
    """Write ``n`` more annotator-labelled demonstration pairs on unused training prompts.

    Args:
        sim_dir: a ``make-data`` directory (its manifest gives the task, the annotator and the prompt
            counts already used).
        n: pairs to write, one per new prompt.
        out: output file (default ``<sim_dir>/pairs_extra_train.jsonl``, :data:`EXTRA_PAIRS`).
        seed: seeds the demonstrations and the labels (another seed, other pairs on the same prompts).

    Returns:
        The statistics written beside ``out`` (also ``prompts_offset``: how many training prompts
        ``make-data`` had used, where the new ones start).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    task, manifest = load_sim(sim_dir)
    files = manifest["files"]
    used = sum(files[f"{kind}_train"]["rows"] for kind in ("sft", "pairs", "prompts"))
    capacity = task.capacity("train")
    if used + n > capacity:
        raise ValueError(
            f"{sim_dir}: {n} more pairs need {used + n} training prompts, but the training split holds {capacity}"
        )
    prompts = task.prompts(used + n, "train")[used:]
    rng = random.Random(f"alignlit.sim.extra_pairs:{manifest['seed']}:{seed}")
    annotator = annotator_of(manifest, task, seed)
    triples = [(prompt, *two_demonstrations(task, prompt, rng)) for prompt in prompts]
    rows, stats = _label(task, annotator, triples, rng)
    out = Path(out) if out is not None else Path(sim_dir) / EXTRA_PAIRS
    return _write(out, rows, {**stats, "prompts_offset": used, "seed": seed, "source": "demonstrations"})


def label_samples(
    sim_dir: str | Path,
    samples: str | Path,
    out: str | Path,
    *,
    pairs_per_prompt: int = 1,
    seed: int = 1,
    include: list[str | Path] | None = None,
) -> dict[str, Any]:
    """Annotator-labelled pairs of a policy's own samples (an ``alignlit sample --out`` file).

    For each row ``{"prompt", "responses": [...]}``, the distinct non-empty responses (first occurrence
    order) are paired ``(0, 1), (2, 3), ...`` up to ``pairs_per_prompt`` pairs; a prompt with fewer than two
    distinct responses gives none (counted as ``prompts_without_pair``). Prompts outside the training
    split are refused: these pairs are training data.

    Args:
        sim_dir: the ``make-data`` directory (task and annotator).
        samples: the sample file.
        out: the pair file to write.
        pairs_per_prompt: at most this many disjoint pairs per prompt.
        seed: seeds the annotator's draws.
        include: pair files whose rows are written first, unchanged (e.g. ``make_extra_pairs``'s output),
            so one training file holds both; their prompts must be training prompts too. The statistics
            are those of the labelled samples (``included_rows`` counts the rest).
    """
    if not isinstance(pairs_per_prompt, int) or pairs_per_prompt < 1:
        raise ValueError(f"pairs_per_prompt must be an int >= 1, got {pairs_per_prompt!r}")
    task, manifest = load_sim(sim_dir)
    triples, without = [], 0
    with open(samples, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            where = f"{samples}:{line_no}"
            if not isinstance(row.get("prompt"), str) or not isinstance(row.get("responses"), list):
                raise ValueError(
                    f"{where}: expected {{'prompt': str, 'responses': [str, ...]}}, got keys {sorted(row)}"
                )
            prompt = row["prompt"]
            if split_of(prompt) != "train":
                raise ValueError(
                    f"{where}: prompt {prompt!r} is in the {split_of(prompt)!r} split; only training prompts "
                    "may become training pairs"
                )
            distinct = list(dict.fromkeys(r for r in row["responses"] if isinstance(r, str) and r.strip()))
            got = [(prompt, distinct[i], distinct[i + 1]) for i in range(0, len(distinct) - 1, 2)]
            without += not got
            triples += got[:pairs_per_prompt]
    if not triples:
        raise ValueError(f"{samples}: no prompt has two different non-empty responses; nothing to label")
    rows, stats = _label(
        task, annotator_of(manifest, task, seed), triples, random.Random(f"alignlit.sim.label:{seed}")
    )
    included = []
    for path in include or []:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict) or not all(
                        isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")
                    ):
                        raise ValueError(
                            f"{path}:{line_no}: expected {{'prompt', 'chosen', 'rejected'}} strings, got {row!r:.200}"
                        )
                    if split_of(row["prompt"]) != "train":
                        raise ValueError(
                            f"{path}:{line_no}: prompt {row['prompt']!r} is not a training prompt"
                        )
                    included.append(row)
    extra = {
        "prompts_without_pair": without,
        "seed": seed,
        "source": str(samples),
        "included_rows": len(included),
    }
    return _write(Path(out), included + rows, {**stats, **extra})
