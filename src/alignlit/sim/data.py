"""Write the simulated task as JSONL files in the formats real data uses.

``make_data(out_dir)`` writes, for the ``train`` and ``val`` splits (``test``: prompts only):

========================  =================================================================
file                      one JSON object per line
========================  =================================================================
``sft_{split}.jsonl``        ``{"prompt", "response"}``: a noisy demonstration per prompt
``pairs_{split}.jsonl``      ``{"prompt", "chosen", "rejected"}``: two different demonstrations
                             for one prompt, ordered by a simulated :class:`Annotator`
``pairs_hh_{split}.jsonl``   the same pairs in HH-RLHF form ``{"chosen": prompt + chosen,
                             "rejected": prompt + rejected}``
``pairs_gold_{split}.jsonl`` the same pairs ordered by the noise-free gold reward (pairs with
                             equal gold dropped): ground truth for reward-model accuracy
``prompts_{split}.jsonl``    ``{"prompt"}``: prompts for online stages and evaluation
``manifest.json``            counts, seed, task and annotator parameters, summary statistics
========================  =================================================================

Within a split the SFT, pair and prompt files use disjoint prompts; splits are disjoint by
construction (:func:`alignlit.sim.task.split_of`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from alignlit.data.records import read_records
from alignlit.data.tokenizer import train_bpe_tokenizer
from alignlit.sim.annotator import Annotator
from alignlit.sim.task import DEMO_KINDS, SimTask, num_words

MANIFEST = "manifest.json"
MAX_PAIR_ATTEMPTS = 100


def load_sim(sim_dir: str | Path) -> tuple[SimTask, dict]:
    """The :class:`~alignlit.sim.SimTask` and manifest of a ``alignlit sim make-data`` directory."""
    manifest_path = Path(sim_dir) / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"{manifest_path} not found: run `alignlit sim make-data --out {sim_dir}` first"
        )
    manifest = json.loads(manifest_path.read_text())
    task_args = dict(manifest["task"])
    task_args["ops"] = tuple(task_args["ops"])
    return SimTask(**task_args), manifest


def two_demonstrations(task, prompt: str, rng: random.Random) -> tuple[str, str]:
    """Two different demonstrations of ``prompt`` (the second redrawn up to ``MAX_PAIR_ATTEMPTS`` times)."""
    y1 = task.demonstration(prompt, rng)
    for _ in range(MAX_PAIR_ATTEMPTS):
        y2 = task.demonstration(prompt, rng)
        if y2 != y1:
            return y1, y2
    raise RuntimeError(
        f"no second demonstration different from {y1!r} for {prompt!r} in {MAX_PAIR_ATTEMPTS} draws; "
        f"demo_mix {task.demo_mix} is too concentrated to build pairs"
    )


def file_name(kind: str, split: str) -> str:
    """File name of one output, e.g. ``file_name("pairs_hh", "train") == "pairs_hh_train.jsonl"``."""
    return f"{kind}_{split}.jsonl"


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Write ``records`` one JSON object per line, atomically (temporary file, then ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    _write_atomic(path, text)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 6) if values else None


def sft_records(task: SimTask, prompts: list[str], rng: random.Random) -> tuple[list[dict], dict[str, Any]]:
    """One demonstration per prompt, and statistics: mean gold of the demonstrations and of the ideal
    answers, mean length in words, share of each demonstration kind."""
    records, golds, kinds, words = [], [], Counter(), []
    for prompt in prompts:
        kind = task.demo_kind(rng)
        response = task.demonstration(prompt, rng, kind=kind)
        records.append({"prompt": prompt, "response": response})
        golds.append(task.gold_reward(prompt, response))
        kinds[kind] += 1
        words.append(num_words(response))
    ideal = [task.gold_reward(p, task.ideal(p)) for p in prompts]
    stats = {
        "rows": len(records),
        "demo_mean_gold": _mean(golds),
        "ideal_mean_gold": _mean(ideal),
        "demo_mean_words": _mean(words),
        "kind_fraction": {k: round(kinds[k] / len(prompts), 6) if prompts else None for k in DEMO_KINDS},
    }
    return records, stats


def pair_records(
    task: SimTask, annotator: Annotator, prompts: list[str], rng: random.Random
) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """For each prompt, two different demonstrations ordered by ``annotator`` (``{"prompt", "chosen",
    "rejected"}``), the same pairs ordered by gold with gold ties dropped, and statistics."""
    labelled, gold_labelled = [], []
    chosen_gold, rejected_gold, chosen_words, rejected_words = [], [], [], []
    agree = ties = longer = unequal = 0
    for prompt in prompts:
        y1, y2 = two_demonstrations(task, prompt, rng)
        chosen, rejected = (y1, y2) if annotator.label(prompt, y1, y2, rng) else (y2, y1)
        labelled.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        g_chosen, g_rejected = task.gold_reward(prompt, chosen), task.gold_reward(prompt, rejected)
        chosen_gold.append(g_chosen)
        rejected_gold.append(g_rejected)
        chosen_words.append(num_words(chosen))
        rejected_words.append(num_words(rejected))
        if chosen_words[-1] != rejected_words[-1]:
            unequal += 1
            longer += chosen_words[-1] > rejected_words[-1]
        if g_chosen == g_rejected:
            ties += 1
            continue
        agree += g_chosen > g_rejected
        best, worst = (chosen, rejected) if g_chosen > g_rejected else (rejected, chosen)
        gold_labelled.append({"prompt": prompt, "chosen": best, "rejected": worst})
    stats = {
        "rows": len(labelled),
        "gold_rows": len(gold_labelled),
        "gold_ties_dropped": ties,
        "annotator_gold_agreement": round(agree / len(gold_labelled), 6) if gold_labelled else None,
        "chosen_mean_gold": _mean(chosen_gold),
        "rejected_mean_gold": _mean(rejected_gold),
        "chosen_mean_words": _mean(chosen_words),
        "rejected_mean_words": _mean(rejected_words),
        "chosen_longer_fraction": round(longer / unequal, 6) if unequal else None,
    }
    return labelled, gold_labelled, stats


def make_data(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_sft: int = 20000,
    n_pairs: int = 10000,
    n_prompts: int = 5000,
    n_val: int = 500,
    n_test: int = 1000,
    task: SimTask | None = None,
    annotator: Annotator | None = None,
) -> dict[str, Any]:
    """Write the simulated data set under ``out_dir`` (see the module docstring) and return the manifest.

    Train prompts: ``n_sft`` for SFT, ``n_pairs`` for preference pairs, ``n_prompts`` for online stages,
    all distinct. Validation: ``n_val`` of each kind, also distinct. Test: ``n_test`` prompts. Same
    arguments give byte-identical files.

    Args:
        out_dir: output directory (created if missing; existing files of the same names are replaced).
        seed: seeds the prompts (unless ``task`` is given), the demonstrations and the annotator draws.
        n_sft: SFT demonstrations (one per prompt) in ``sft_train.jsonl``.
        n_pairs: preference pairs (one per prompt) in ``pairs_train.jsonl``.
        n_prompts: prompts in ``prompts_train.jsonl``.
        n_val: rows of each ``*_val.jsonl`` file.
        n_test: prompts in ``prompts_test.jsonl``.
        task: the task (default ``SimTask(seed=seed)``).
        annotator: the annotator (default ``Annotator(seed=seed, task=task)``).
    """
    for name, value in (("n_sft", n_sft), ("n_pairs", n_pairs), ("n_prompts", n_prompts), ("n_val", n_val)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if not isinstance(n_test, int) or n_test < 0:
        raise ValueError(f"n_test must be an int >= 0, got {n_test!r}")
    task = task if task is not None else SimTask(seed=seed)
    annotator = annotator if annotator is not None else Annotator(seed=seed, task=task)
    if dataclasses.replace(annotator.task, seed=task.seed) != task:
        raise ValueError(f"the annotator's task {annotator.task} scores differently from task {task}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    sizes = {"train": (n_sft, n_pairs, n_prompts), "val": (n_val, n_val, n_val)}
    files: dict[str, dict[str, Any]] = {}
    stats: dict[str, dict[str, Any]] = {"sft": {}, "pairs": {}}

    def emit(kind: str, split: str, records: list[dict[str, Any]]) -> None:
        write_jsonl(out / file_name(kind, split), records)
        files[f"{kind}_{split}"] = {"path": file_name(kind, split), "rows": len(records)}

    for split, (k_sft, k_pairs, k_prompts) in sizes.items():
        pool = task.prompts(k_sft + k_pairs + k_prompts, split)
        sft_prompts, pair_prompts = pool[:k_sft], pool[k_sft : k_sft + k_pairs]
        sft, stats["sft"][split] = sft_records(
            task, sft_prompts, random.Random(f"alignlit.sim.sft:{seed}:{split}")
        )
        pairs, gold_pairs, stats["pairs"][split] = pair_records(
            task, annotator, pair_prompts, random.Random(f"alignlit.sim.pairs:{seed}:{split}")
        )
        emit("sft", split, sft)
        emit("pairs", split, pairs)
        emit(
            "pairs_hh",
            split,
            [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in pairs],
        )
        emit("pairs_gold", split, gold_pairs)
        emit("prompts", split, [{"prompt": p} for p in pool[k_sft + k_pairs :]])
    emit("prompts", "test", [{"prompt": p} for p in task.prompts(n_test, "test")])

    manifest = {
        "seed": seed,
        "task": {**dataclasses.asdict(task), "ops": list(task.ops)},
        "annotator": {
            "temperature": annotator.temperature,
            "length_bias": annotator.length_bias,
            "label_noise": annotator.label_noise,
            "seed": annotator.seed,
        },
        "files": files,
        "stats": stats,
    }
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def write_tokenizer(out_dir: str, *, vocab_size: int) -> None:
    """Train the tokenizer of the task's tiny policies on the SFT, pair and prompt text under ``out_dir``
    (written to ``out_dir/tokenizer``)."""
    texts = [
        value
        for f in sorted(Path(out_dir).glob("*_train.jsonl"))
        for record in read_records(f)
        for value in record.fields.values()
        if isinstance(value, str)
    ]
    train_bpe_tokenizer(texts, vocab_size=vocab_size, out_dir=Path(out_dir) / "tokenizer")
