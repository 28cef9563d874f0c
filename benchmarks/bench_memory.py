"""Peak memory and step time at a real vocabulary: alignlit vs TRL 1.16 on a Qwen2.5-0.5B-shaped model.

The model is Qwen2.5-0.5B's architecture built from its config with random weights (vocabulary
151,936, hidden 896, MLP 4864, 14 query heads and 2 key/value heads of 64, tied embeddings, rope θ 1e6)
with ``--layers`` of its 24 decoder layers (the vocabulary-driven parts, the embedding and the LM head,
are those of the real model; the layers' activations scale with their number). One process per
measurement, each side's own trainer (alignlit's stage modules under Lightning, TRL's SFTTrainer,
RewardTrainer, DPOTrainer and GRPOTrainer), fused AdamW on both sides, for each sequence length:

- ``sft``: ``--rows`` rows of ``L`` tokens, the last 3/4 scored;
- ``dpo``: one pair, prompt ``L/2`` and two responses of ``L/2`` (rows of ``L``), live reference;
- ``reward``: the same pair through a scalar-head model;
- ``grpo``: one update on the ``--group`` samples of one prompt (prompt ``L/4``, responses ``3L/4``,
  fixed completions instead of sampling, the same on both sides), with the old and reference log-probs
  and the k3 KL term (``harness.vs_trl``'s settings).

Peak memory is measured over the second step (the first creates the optimizer states): the tensors alive
at its start (parameters of every model, gradients, optimizer states: "resident") plus the most bytes
allocated at once above that during the step (torch.profiler allocation events: "transient"); the
process's peak RSS is reported beside it. Variants: alignlit with its defaults (fused chunked LM-head
log-probs, packed rows, gated MLPs recomputing two activations), with full logits
(``ForwardSettings(fused_head=False)``), with activation checkpointing, with one row per pass (a token
budget), keeping the MLP activations (``ForwardSettings(recompute_mlp=False)``); TRL with its defaults (TRL 1.16 always computes log-probs with its own fused LM head,
``add_fused_lm_head``, tiles of 4096 positions x 32768 vocabulary entries, every position on CPU) and
with activation checkpointing. Few steps: a memory benchmark; the step times are those of the
profiled step.

This CPU has no native bfloat16 (no avx512_bf16/amx flags), so the model runs in float32 (``--dtype``).
Each cell is a harness cell under ``--work`` (``out/bench/<name>``): a rerun reads back the finished cells of the same
settings and code (``--fresh``: measure them again); the JSON and table hold every cell of the command.

    python benchmarks/bench_memory.py --trl-python /work/venv-bench/bin/python
    python benchmarks/bench_memory.py --lengths 512 --workloads dpo,grpo --layers 24
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import (  # benchmarks/ is on sys.path when a script runs
    QWEN,
    code_stamp,
    measurement_cells,
    write_results,
)

WORKLOADS = ("sft", "dpo", "reward", "grpo")
VARIANTS = {  # name: (side, flags)
    "alignlit": ("alignlit", []),
    "alignlit full logits": ("alignlit", ["--no-fused-head"]),
    "alignlit checkpointing": ("alignlit", ["--gradient-checkpointing"]),
    # minibatches.token_budget of one row at the grpo workload's L tokens: one row per forward and backward,
    # the same gradient (TRL's counterpart, gradient accumulation, is not run)
    "alignlit token budget": ("alignlit", ["--token-budget-rows", "1"]),
    # ForwardSettings.recompute_mlp off: the gated MLPs keep act_fn(gate) and the product (alignlit before it)
    "alignlit keeping MLP activations": ("alignlit", ["--keep-mlp"]),
    "trl": ("trl", []),
    "trl checkpointing": ("trl", ["--gradient-checkpointing"]),
}


def build_assets(root: Path, args) -> None:
    """The model directories (policy, reward model), the tokenizer and the data of every length."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

    from alignlit.data.tokenizer import load_tokenizer
    from alignlit.sim import make_data, write_tokenizer

    make_data(root / "sim", seed=0, n_sft=10, n_pairs=10, n_prompts=10, n_val=10, n_test=10)
    write_tokenizer(str(root / "sim"), vocab_size=512)
    tokenizer = load_tokenizer(root / "sim" / "tokenizer")
    config = Qwen2Config(
        **QWEN, num_hidden_layers=args.layers, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(root / "policy"))
    tokenizer.save_pretrained(str(root / "policy"))
    del model
    torch.manual_seed(1)
    reward = AutoModelForSequenceClassification.from_pretrained(str(root / "policy"), num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(str(root / "reward"))
    tokenizer.save_pretrained(str(root / "reward"))
    del reward

    special = set(tokenizer.all_special_ids)
    plain = [i for i in range(len(tokenizer)) if i not in special]
    task_prompt = json.loads((root / "sim" / "prompts_train.jsonl").read_text().splitlines()[0])["prompt"]
    rng = random.Random(0)
    for length in args.lengths:
        folder = root / f"L{length}"
        folder.mkdir()
        ids = lambda k: [rng.choice(plain) for _ in range(k)]  # noqa: E731
        sft = [{"input_ids": ids(length), "prompt_length": length // 4} for _ in range(args.rows * 2)]
        pairs = [
            {"prompt_ids": ids(length // 2), "chosen_ids": ids(length // 2), "rejected_ids": ids(length // 2),
             "prompt": "p", "chosen": "c", "rejected": "r"}
            for _ in range(2)
        ]  # fmt: skip
        prompt = grpo_prompt(tokenizer, task_prompt, length // 4)
        completions = [ids(length - length // 4) for _ in range(args.group)]
        (folder / "sft.json").write_text(json.dumps(sft))
        (folder / "pairs.json").write_text(json.dumps(pairs))
        (folder / "prompts.json").write_text(json.dumps([prompt, prompt]))
        (folder / "check_batch.json").write_text(json.dumps({"completion_ids": completions}))
        for name in ("policy", "reward", "sim"):
            (folder / name).symlink_to(root / name)


def grpo_prompt(tokenizer, task_prompt: str, tokens: int) -> str:
    """The task prompt after context symbols (``harness.vs_trl.with_context``, which the reward strips),
    about ``tokens`` tokens in all."""
    from harness.vs_trl import with_context

    words = max(0, tokens - len(tokenizer(task_prompt)["input_ids"]))
    while words and len(tokenizer(with_context(task_prompt, words, 0))["input_ids"]) > tokens:
        words -= 1
    return with_context(task_prompt, words, 0)


def worker(args) -> None:
    """One measurement in this process; prints ``RESULT {json}``."""
    if args.keep_mlp:  # the gated MLPs keep act_fn(gate) and the product (ForwardSettings.recompute_mlp off)
        from alignlit.models.forward_settings import use_forward_settings

        with use_forward_settings(recompute_mlp=False):
            return measure(args)
    return measure(args)


def measure(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    root = Path(args.assets)
    common = dict(
        lr=1e-5, weight_decay=0.0, batch_size=args.rows, warmup=1, steps=1, profile=False, compile=False,
        no_fused_adamw=False, no_packing=False, no_fused_head=args.no_fused_head, max_length=args.length,
        max_prompt_length=args.length, memory=True, gradient_checkpointing=args.gradient_checkpointing,
        # the online workloads: one prompt, --group samples, one update per rollout
        rollout_prompts=1, group=args.group, minibatch=args.group, max_new_tokens=args.length - args.length // 4,
        online_lr=1e-5, online_warmup=0, rollouts=2,
        token_budget=None if args.token_budget_rows is None else args.token_budget_rows * args.length,
    )  # fmt: skip
    ns = argparse.Namespace(**common)
    if args.workload == "grpo":
        from harness import vs_trl

        fn = vs_trl.alignlit_online_worker if args.side == "alignlit" else vs_trl.trl_online_worker
        result = fn("grpo", root, ns, "memory")
    else:
        from harness import vs_trl

        workload = "dpo_live" if args.workload == "dpo" else args.workload
        if args.workload != "sft":
            ns.batch_size = 1  # one pair
        fn = vs_trl.alignlit_worker if args.side == "alignlit" else vs_trl.trl_worker
        out = fn(workload, root, ns)
        result = {**out["memory"], "peak_rss_mb": out["peak_rss_mb"], "losses": [out["first_loss"]]}
    print("RESULT " + json.dumps(result), flush=True)


def run_cell(python: str, side: str, flags: list[str], workload: str, length: int, root: Path, args) -> dict:
    command = [
        python, __file__, "--worker", side, "--workload", workload, "--length", str(length),
        "--assets", str(root / f"L{length}"), "--threads", str(args.threads), "--rows", str(args.rows),
        "--group", str(args.group), *flags,
    ]  # fmt: skip
    env = {
        **os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
        "BENCH_SIM_DIR": str(root / "sim"),
    }  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout[-2000:] + proc.stderr[-6000:]).strip()
        return {
            "status": "failed",
            "exit": proc.returncode,
            "error": tail.splitlines()[-1] if tail else "",
            "log": tail,
        }
    return {"status": "ok", **json.loads(lines[-1][len("RESULT ") :])}


def table(cells: list[dict], args) -> str:
    """A markdown table of the cells, alignlit's peak over TRL's (same length, same checkpointing)."""
    by_key = {(c["workload"], c["length"], c["variant"]): c for c in cells if c.get("status") == "ok"}
    rows = [
        "| workload | L | variant | peak MB | resident MB | transient MB | step s | RSS MB | peak / TRL's |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        if c.get("status") != "ok":
            rows.append(
                f"| {c['workload']} | {c['length']} | {c['variant']} | {c.get('status')}: {c.get('error', '')[:80]} | | | | | |"
            )
            continue
        reference = "trl checkpointing" if "checkpointing" in c["variant"] else "trl"
        trl = by_key.get((c["workload"], c["length"], reference))
        ratio = (
            f"**{c['peak_mb'] / trl['peak_mb']:.2f}**" if trl and c["variant"].startswith("alignlit") else ""
        )
        rows.append(
            f"| {c['workload']} | {c['length']} | {c['variant']} | {c['peak_mb']:.0f} | {c['resident_mb']:.0f} | "
            f"{c['transient_peak_mb']:.0f} | {c['step_s']:.1f} | {c['peak_rss_mb']:.0f} | {ratio} |"
        )
    return "\n".join(rows)


def cell_specs(args, workloads: list[str], variants: list[str], ablation: set[int]) -> dict[str, dict]:
    """The command's cells, ``<workload>-L<length>-<variant>``, each with its spec: the model and step settings
    and the code, so a cell is measured again for other settings or other code."""
    common = {k: getattr(args, k) for k in ("layers", "rows", "group", "threads", "dtype")}
    common["code"] = code_stamp()
    return {
        f"{w}-L{n}-{v}": {**common, "workload": w, "length": n, "variant": v}
        for n in args.lengths
        for w in workloads
        for v in variants
        if (v in ("alignlit", "trl") or n in ablation)
        and not (v == "alignlit full logits" and w == "reward")  # a scalar head has no vocabulary
    }


def measure_cells(args, cells_dir, spec: dict[str, dict]) -> list[dict]:
    """Each cell of ``spec``, read back or measured in its own process (the shared assets built once, when a
    cell is measured); a failed cell keeps no record, so the next run measures it again."""
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        built = False
        for key, cell_spec in spec.items():
            workload, length, variant = cell_spec["workload"], cell_spec["length"], cell_spec["variant"]

            def measure(workload=workload, length=length, variant=variant) -> dict:
                nonlocal built
                if not built:
                    build_assets(root, args)
                    built = True
                side, flags = VARIANTS[variant]
                python = args.trl_python if side == "trl" else sys.executable
                return run_cell(python, side, flags, workload, length, root, args)

            cell = {"workload": workload, "length": length, "variant": variant,
                    **cells_dir.run(key, measure, cell_spec)}  # fmt: skip
            if cell["status"] != "ok":
                cells_dir.path(key).unlink()
            cells.append(cell)
            status = (
                f"peak {cell['peak_mb']:.0f} MB, step {cell['step_s']:.1f} s"
                if cell["status"] == "ok"
                else cell["error"]
            )
            print(f"  {workload} L={length} {variant}: {status}", flush=True)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--lengths", default="512,1024,2048", help="comma-separated sequence lengths")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}"
    )
    parser.add_argument(
        "--ablation-lengths",
        default="2048",
        help="lengths at which the variants other than 'alignlit' and 'trl' run (default: the longest)",
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen2.5-0.5B has 24)")
    parser.add_argument("--rows", type=int, default=2, help="sft: rows per step")
    parser.add_argument("--group", type=int, default=4, help="grpo: samples of the one prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype", default="float32", choices=["float32"], help="bf16 is not native on this CPU"
    )
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--out", default="benchmarks/results/memory.json")
    parser.add_argument("--fresh", action="store_true", help="measure every cell again (not from --work)")
    parser.add_argument(
        "--work", default=None, help="the cells, kept between runs (default: out/bench/<--out's name>)"
    )
    parser.add_argument("--worker", choices=["alignlit", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    parser.add_argument("--no-fused-head", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--token-budget-rows", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep-mlp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.side = args.worker
        worker(args)
        return

    workloads = [w for w in args.workloads.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    ablation = {int(x) for x in args.ablation_lengths.split(",") if x}
    for given, known, what in ((workloads, WORKLOADS, "--workloads"), (variants, VARIANTS, "--variants")):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"{what}: unknown {unknown}; choose from {list(known)}")
    out = Path(args.out)
    cells_dir = measurement_cells(out.stem, args.work)
    spec = cell_specs(args, workloads, variants, ablation)
    for key in spec if args.fresh else ():
        cells_dir.path(key).unlink(missing_ok=True)
    done = sum(cells_dir.get(key, spec[key]) is not None for key in spec)
    payload = {
        "benchmark": "memory",
        "model": {**QWEN, "layers": args.layers, "dtype": args.dtype},
        "config": {
            k: v for k, v in vars(args).items() if k not in ("worker", "side", "workload", "length", "assets")
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "cells": [],
    }
    print(f"{len(spec)} cells ({done} measured before, in {cells_dir.dir})", flush=True)
    payload["cells"] = measure_cells(args, cells_dir, spec)
    order = {(w, length, v): i for i, (w, length, v) in enumerate(
        (w, length, v) for w in WORKLOADS for length in sorted({c["length"] for c in payload["cells"]}) for v in VARIANTS)}  # fmt: skip
    payload["cells"].sort(key=lambda c: order.get((c["workload"], c["length"], c["variant"]), 1 << 30))
    markdown = table(payload["cells"], args)
    print(markdown)
    write_results(out.stem, payload, table=markdown, results_dir=out.parent)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
