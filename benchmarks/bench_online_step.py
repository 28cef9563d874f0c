"""The online step broken down: where a rollout's time goes, for PPO and critic-free policy gradients.

For each stage (``ppo``: PPOModule with a critic; ``grpo``: PolicyGradientModule with group
advantages) and rollout engine (``hf``; ``vllm`` when it is importable, else a "not installed" row),
a few rollouts of the quickstart-sized tiny Llama (hidden 128, 4 layers, a 512-token BPE vocabulary
trained on the simulated task) against a tiny reward model, and per rollout, in seconds and share:

- ``generate``: sampling the responses (``rollout/generate_s`` the module logs);
- ``score``: the reward model (``rollout/score_s``);
- ``sync``: pushing the policy's weights to the engine (``rollout/sync_s``; nothing to do for ``hf``);
- ``old logp``: the trainer's ``log π_old`` (``time/old_logp_s``);
- ``ref logp``: the reference's ``log π_0`` (``time/ref_logp_s``);
- ``values``: the critic's values at experience time (PPO; ``time/values_s``);
- ``train``: the rest of ``time/train_s``: advantages and the minibatch updates;
- ``other``: the rest of the step's wall time (parity checks, Lightning, logging).

The first rollout is a warm-up and is left out. Each stage also runs with alignlit's forward path
switched to its earlier behaviour (full logits, padded rows: ``ForwardSettings(fused_head=False,
packing=False)``), the "before" rows. A second table times ``HFEngine.generate`` alone on one rollout's
prompts: all prompts in one ``generate`` call vs micro-batches, Hugging Face's static KV cache vs its
dynamic one, and the engine's own work around ``model.generate`` (log-probs, trimming, padding).
Prints both tables and writes ``benchmarks/results/online_step.json``.

    python benchmarks/bench_online_step.py
    python benchmarks/bench_online_step.py --stages ppo --rollouts 4
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see bench_vs_trl.py)

import argparse
import functools
import importlib.util
import json
import logging
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch

from alignlit.models import export_pretrained, make_tiny_llama
from alignlit.models.forward_settings import use_forward_settings
from alignlit.rollout import HFEngine, RolloutLoop, SamplingParams
from harness import (  # benchmarks/ is on sys.path when a script runs
    code_stamp,
    measurement_cells,
    write_results,
)

STAGES = ("ppo", "grpo")
ENGINES = ("hf", "vllm")
PARTS = ("generate", "score", "sync", "old_logp", "ref_logp", "values", "train", "other")
MODEL = dict(hidden_size=128, num_layers=4, num_heads=2, head_dim=64, intermediate_size=512)


def build_assets(root: Path, args) -> tuple[Path, Path, list[str]]:
    from transformers import AutoModelForSequenceClassification

    from alignlit.data.tokenizer import load_tokenizer
    from alignlit.sim import make_data, write_tokenizer

    sim = root / "sim"
    make_data(
        sim, seed=0, n_sft=200, n_pairs=200, n_prompts=args.prompts * (args.rollouts + 1), n_val=10, n_test=10
    )
    write_tokenizer(str(sim), vocab_size=512)
    tokenizer = load_tokenizer(sim / "tokenizer")
    export_pretrained(
        make_tiny_llama(tokenizer, seed=0, max_position_embeddings=256, **MODEL), tokenizer, root / "policy",
        stage="bench",
    )  # fmt: skip
    torch.manual_seed(1)
    reward = AutoModelForSequenceClassification.from_pretrained(str(root / "policy"), num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(str(root / "reward"))
    tokenizer.save_pretrained(str(root / "reward"))
    prompts = [json.loads(line)["prompt"] for line in (sim / "prompts_train.jsonl").read_text().splitlines()]
    return root / "policy", root / "reward", prompts


class RolloutClock(L.Callback):
    """Wall time of each rollout's whole training step."""

    def __init__(self):
        self.wall: dict[int, float] = {}
        self.start = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.wall[batch_idx] = time.perf_counter() - self.start


def run_stage(stage: str, engine: str, root: Path, prompts: list[str], args, *, interleave: bool) -> dict:
    from alignlit.modules import Minibatches, Optim, PolicyGradientModule, PPOModule

    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    common = dict(
        policy=str(root / "policy"), reward=str(root / "reward"), optim=Optim(lr=1e-5, min_lr_ratio=1.0)
    )
    if stage == "ppo":
        rollout = RolloutLoop(engine=engine, sampling=sampling, samples_per_prompt=1)
        module = PPOModule(rollout=rollout, minibatches=Minibatches(size=16, epochs=2), **common)
        batch = args.prompts
    else:
        rollout = RolloutLoop(engine=engine, sampling=sampling, samples_per_prompt=args.group)
        module = PolicyGradientModule(
            advantage="grpo", kl_loss_coef=0.01, rollout=rollout, minibatches=Minibatches(size=16), **common
        )
        batch = args.prompts // args.group

    last: dict[str, object] = {}
    make_trajectory = module.make_trajectory

    def keep_last(experience):
        last["experience"] = experience  # the last accepted experience, which interleaved_parts remakes
        return make_trajectory(experience)

    module.make_trajectory = keep_last
    clock = RolloutClock()
    loader = torch.utils.data.DataLoader(prompts[: batch * args.rollouts], batch_size=batch, collate_fn=list)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=str(root),  # the curves the module writes at the end of fit
        max_epochs=1,
        limit_train_batches=args.rollouts,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(module, train_dataloaders=loader)

    rows = []
    for k, h in enumerate(module.progress.history):
        if k == 0:  # warm-up
            continue
        parts = {
            "generate": h["rollout/generate_s"],
            "score": h["rollout/score_s"],
            "sync": h.get("rollout/sync_s", 0.0),
            **{p: h.get(f"time/{p}_s", 0.0) for p in ("old_logp", "ref_logp", "values")},  # inside train_s
        }
        parts["train"] = h["time/train_s"] - parts["old_logp"] - parts["ref_logp"] - parts["values"]
        parts["other"] = clock.wall[k] - sum(parts.values())
        rows.append(parts)
    mean = {p: statistics.fmean(r[p] for r in rows) for p in PARTS}
    if interleave and args.interleaved:
        module.make_trajectory = make_trajectory
        interleaved = interleaved_parts(module, stage, last["experience"], args)
    else:
        interleaved = None
    return {
        "interleaved": interleaved,
        "stage": stage,
        "engine": engine,
        "responses_per_rollout": batch * (1 if stage == "ppo" else args.group),
        "rollouts_timed": len(rows),
        "seconds": mean,
        "total_s": sum(mean.values()),
        "per_rollout": rows,
    }


BEFORE = {"fused_head": False, "packing": False}


def interleaved_parts(module, stage: str, experience, args) -> dict[str, dict[str, float]]:
    """The parts the forward path drives, on the last rollout, alternating after/before settings:
    ``experience`` (the trajectory's old and reference log-probs, then the stage's values and advantages:
    ``make_trajectory`` + ``advantages``) and ``update`` (forward and backward of the losses on the whole batch, no
    optimizer step). Medians of ``--interleaved`` alternations, each path once per alternation."""
    times: dict[str, dict[str, list[float]]] = {
        p: {"experience": [], "update": []} for p in ("after", "before")
    }
    for _ in range(args.interleaved):
        for path, settings in (("after", {}), ("before", BEFORE)):
            with use_forward_settings(**settings):
                start = time.perf_counter()
                batch, _ = module.make_trajectory(experience)
                module.advantages(batch)
                batch = module.trainable(batch)
                middle = time.perf_counter()
                module.zero_grad(set_to_none=True)
                losses = (
                    [module.critic_loss(batch)[0], module.actor_loss(batch)[0]]
                    if stage == "ppo"
                    else [module.policy_loss(batch)[0]]
                )
                for loss in losses:
                    loss.backward()
                end = time.perf_counter()
            times[path]["experience"].append(middle - start)
            times[path]["update"].append(end - middle)
    return {p: {k: statistics.median(v) for k, v in parts.items()} for p, parts in times.items()}


def generation_table(policy: Path, prompts: list[str], args) -> list[dict]:
    """``HFEngine.generate`` alone: batch sizes, static vs dynamic KV cache, the engine's own work."""
    from alignlit.models.loading import load_policy

    model, tokenizer = load_policy(str(policy))
    model.eval()
    batch = prompts[: args.prompts]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    inner = {"s": 0.0}
    original_generate = model.generate

    def timed_generate(*a, **k):
        start = time.perf_counter()
        try:
            return original_generate(*a, **k)
        finally:
            inner["s"] += time.perf_counter() - start

    model.generate = timed_generate

    class StaticCacheEngine(HFEngine):
        def _generation_config(self, sampling, eos_ids):
            config = super()._generation_config(sampling, eos_ids)
            config.cache_implementation = "static"
            return config

    variants = [(f"micro-batches of {m}", HFEngine, m) for m in args.micro_batches if m < len(batch)]
    variants += [
        ("one call (default)", HFEngine, None),
        ("one call, static KV cache", StaticCacheEngine, None),
    ]
    out = []
    for name, cls, micro in variants:
        engine = cls(tokenizer, model, micro_batch_size=micro)
        engine.generate(batch, 1, sampling)
        times, inside, tokens = [], [], 0
        for _ in range(args.repeats):
            inner["s"] = 0.0
            start = time.perf_counter()
            rollout = engine.generate(batch, 1, sampling)
            times.append(time.perf_counter() - start)
            inside.append(inner["s"])
            tokens = int(rollout.response_mask.sum())
        seconds = statistics.median(times)
        engine_s = statistics.median(t - i for t, i in zip(times, inside))
        out.append(
            {"variant": name, "prompts": len(batch), "tokens": tokens, "seconds": seconds,
             "tokens_per_s": tokens / seconds, "engine_own_s": engine_s, "engine_own_share": engine_s / seconds}
        )  # fmt: skip
    return out


def measure(stage: str, engine: str, work: Path, prompts, args, path: str, settings: dict) -> dict:
    """One cell: ``stage`` on ``engine`` with the forward ``settings`` of ``path`` (after / before)."""
    with use_forward_settings(**settings):
        return run_stage(stage, engine, work, prompts, args, interleave=path == "after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {ENGINES}")
    parser.add_argument("--rollouts", type=int, default=6, help="rollouts per run (the first is a warm-up)")
    parser.add_argument("--prompts", type=int, default=32, help="responses per rollout")
    parser.add_argument("--group", type=int, default=4, help="grpo: responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--micro-batches", type=int, nargs="*", default=[8])
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls per engine variant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--no-before", action="store_true", help="skip the runs with the earlier forward path"
    )
    parser.add_argument(
        "--interleaved", type=int, default=5, help="after/before alternations on the last rollout (0: none)"
    )
    parser.add_argument("--work", default=None, help="measured cells (default out/bench/online_step)")
    parser.add_argument("--out", default="benchmarks/results/online_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for given, known, what in ((stages, STAGES, "--stages"), (engines, ENGINES, "--engines")):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"{what}: unknown {unknown}; choose from {list(known)}")
    vllm_installed = importlib.util.find_spec("vllm") is not None
    load_start = os.getloadavg()
    results, generation = [], []
    cells, spec = measurement_cells("online_step", args.work), {"config": vars(args), "code": code_stamp()}
    with tempfile.TemporaryDirectory() as tmp:
        policy, _, prompts = build_assets(Path(tmp), args)
        for stage in stages:
            for engine in engines:
                if engine == "vllm" and not vllm_installed:
                    results.append({"stage": stage, "engine": engine, "path": "-", "status": "not installed"})
                    continue
                paths = [("after", {})] + ([] if args.no_before else [("before", BEFORE)])
                for path, settings in paths:
                    compute = functools.partial(
                        measure, stage, engine, Path(tmp), prompts, args, path, settings
                    )
                    result = cells.run(f"{stage}-{engine}-{path}", compute, spec)  # a cut run resumes here
                    results.append({**result, "path": path, "status": "ok"})
                    print(f"  {stage} {engine} {path}: {result['total_s']:.2f} s per rollout", flush=True)
        generation = generation_table(policy, prompts, args)

    print(
        f"\nper rollout, seconds (share); tiny Llama (quickstart size), {args.prompts} responses per rollout, "
        f"max_new_tokens {args.max_new_tokens}, {args.threads} threads; means over rollouts 2..{args.rollouts}"
    )
    print(f"{'stage':<6} {'engine':<6} {'path':<7} " + " ".join(f"{p:>14}" for p in PARTS) + f" {'total':>7}")
    for r in results:
        if r["status"] != "ok":
            print(f"{r['stage']:<6} {r['engine']:<6} {'-':<7} {r['status']}")
            continue
        cells = " ".join(
            f"{r['seconds'][p]:>7.3f} ({100 * r['seconds'][p] / r['total_s']:>3.0f}%)" for p in PARTS
        )
        print(f"{r['stage']:<6} {r['engine']:<6} {r['path']:<7} {cells} {r['total_s']:>7.2f}")
    print(
        "\nthe forward-driven parts on the last rollout, after vs before, alternated "
        f"{args.interleaved} times (median seconds): experience = old/ref log-probs, values, advantages; "
        "update = loss forward + backward on the whole rollout"
    )
    print(
        f"{'stage':<6} {'engine':<6} {'experience after':>17} {'before':>8} {'x':>5} {'update after':>13} {'before':>8} {'x':>5}"
    )
    for r in results:
        if r["status"] != "ok" or r["path"] != "after" or not r.get("interleaved"):
            continue
        a, b = r["interleaved"]["after"], r["interleaved"]["before"]
        print(
            f"{r['stage']:<6} {r['engine']:<6} {a['experience']:>17.3f} {b['experience']:>8.3f} "
            f"{b['experience'] / a['experience']:>5.2f} {a['update']:>13.3f} {b['update']:>8.3f} "
            f"{b['update'] / a['update']:>5.2f}"
        )
    print(f"\nHFEngine.generate alone ({args.prompts} prompts, median of {args.repeats}):")
    print(f"{'variant':<28} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'engine own s':>13}")
    for g in generation:
        print(
            f"{g['variant']:<28} {g['tokens']:>7} {g['seconds']:>8.3f} {g['tokens_per_s']:>9.0f} "
            f"{g['engine_own_s']:>8.4f} ({100 * g['engine_own_share']:.1f}%)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "online_step",
        "config": vars(args),
        "model": MODEL,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_start": load_start,
            "load_average_at_end": os.getloadavg(),
            "torch": torch.__version__,
            "vllm": "installed" if vllm_installed else "not installed",
        },
        "results": results,
        "generation": generation,
    }
    write_results(out.stem, payload, results_dir=out.parent)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
