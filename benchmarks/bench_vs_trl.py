"""alignlit vs TRL, step for step: SFT, reward model, DPO with a cached and with a live reference.

Both sides train the same tiny random Llama (hidden 256, 4 layers, 4 heads of 64, MLP 640, a BPE
vocabulary of 512 trained on the simulated task: 3.3M parameters) on the same simulated data
(``alignlit.sim``, generated in-process and tokenised once, so both sides see the same token ids),
in the same order (no shuffling), with the same batch size, AdamW (torch's fused kernel on both sides,
each library's default; same lr, betas, weight decay, constant schedule, no warmup, no clipping),
float32, no gradient checkpointing, and the same number of torch threads, with ``OMP_WAIT_POLICY=PASSIVE`` (on a machine shared with other jobs, OpenMP's
default spinning made step times vary 20-fold). Each measurement runs in its own subprocess (clean
peak RSS), alternating sides, ``--reps`` repetitions; the median over repetitions is reported.

Per workload and side: examples/s and tokens/s (real and padded) over the timed steps (after
``--warmup`` steps), peak RSS, the first-step loss (both sides must agree: the cheapest correctness
check against an independent implementation), and MFU: training FLOP/s (``6·N·tokens``; ``8·N``
with a live reference, whose forward is ``2·N``) over the machine's float32 matmul peak measured in
the same run (a timed 2048² matmul on the same threads). ``N`` counts the weights that take part in
matmuls (all but the input embedding); tokens are real (non-padding) tokens. Prints a table and
writes ``benchmarks/results/vs_trl.json``.

    python benchmarks/bench_vs_trl.py                       # TRL must be importable (nox -s bench)
    python benchmarks/bench_vs_trl.py --workloads dpo_cached --reps 1 --steps 10
    python benchmarks/bench_vs_trl.py --trl-python /path/to/venv/bin/python
    python benchmarks/bench_vs_trl.py --workloads grpo,rloo     # the online step (see vs_trl_online.py)

alignlit runs its stage modules (SFTModule, RewardModule, DPOModule) under a Lightning Trainer with
their own collation; TRL runs SFTTrainer, RewardTrainer and DPOTrainer with ``padding_free`` off
(their default) and its defaults otherwise. The online workloads (``grpo``: GRPOTrainer vs
PolicyGradientModule; ``rloo``: RLOOTrainer vs PolicyGradientModule) are described in
``benchmarks/vs_trl_online.py``: samples/s, the step split into generate / score / log-probs / update,
and a loss check on the same completions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import stamp  # benchmarks/ is on sys.path when a script runs
from vs_trl_online import (
    ONLINE_WORKLOADS,
    MemoryWindow,
    alignlit_online_worker,
    build_online_assets,
    print_online,
    summarise_online,
    trl_online_worker,
)

OFFLINE_WORKLOADS = ("sft", "reward", "dpo_cached", "dpo_live")
WORKLOADS = OFFLINE_WORKLOADS + ONLINE_WORKLOADS
SIDES = ("alignlit", "trl")
TRL_VERSION = "1.16.0"
MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, head_dim=64, intermediate_size=640)


# ------------------------------------------------------------------------------ shared assets


def build_assets(root: Path, args) -> dict:
    """Simulated data, tokenizer, policy and reward-model directories, and the tokenised examples."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from alignlit.data.encoding import Truncation
    from alignlit.data.preference import PairEncoder
    from alignlit.data.records import read_records
    from alignlit.data.tokenizer import load_tokenizer
    from alignlit.models import export_pretrained, make_tiny_llama
    from alignlit.sim import make_data, write_tokenizer

    needed = args.batch_size * (args.warmup + args.steps)
    sim = root / "sim"
    prompts = max(10, args.rollout_prompts * (args.online_warmup + args.rollouts))
    make_data(sim, seed=0, n_sft=needed, n_pairs=needed, n_prompts=prompts, n_val=10, n_test=10)
    write_tokenizer(str(sim), vocab_size=args.vocab)
    tokenizer = load_tokenizer(sim / "tokenizer")
    policy = make_tiny_llama(tokenizer, seed=0, max_position_embeddings=512, **MODEL)
    export_pretrained(policy, tokenizer, root / "policy", stage="bench")
    torch.manual_seed(1)  # the reward model's fresh scalar head, saved so both sides load the same one
    reward = AutoModelForSequenceClassification.from_pretrained(str(root / "policy"), num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(str(root / "reward"))
    tokenizer.save_pretrained(str(root / "reward"))

    truncation = Truncation(tokenizer, max_length=args.max_length, max_prompt_length=args.max_prompt_length)
    sft = []
    for record in read_records(sim / "sft_train.jsonl")[:needed]:
        enc = truncation.encode(record.fields["prompt"], record.fields["response"], record.source)
        sft.append({"input_ids": enc.input_ids, "prompt_length": enc.prompt_length})
    encoder = PairEncoder(tokenizer, max_length=args.max_length, max_prompt_length=args.max_prompt_length)
    pairs = []
    for record in read_records(sim / "pairs_train.jsonl")[:needed]:
        f = record.fields
        chosen = encoder.encode(f["prompt"], f["chosen"], record.source)
        rejected = encoder.encode(f["prompt"], f["rejected"], record.source)
        pairs.append(
            {
                "prompt_ids": chosen.input_ids[: chosen.prompt_length],
                "chosen_ids": chosen.input_ids[chosen.prompt_length :],
                "rejected_ids": rejected.input_ids[rejected.prompt_length :],
                "prompt": f["prompt"],
                "chosen": f["chosen"],
                "rejected": f["rejected"],
            }
        )
    (root / "sft.json").write_text(json.dumps(sft))
    (root / "pairs.json").write_text(json.dumps(pairs))

    embedding = policy.get_input_embeddings().weight.numel()
    score = reward.score.weight.numel()
    backbone = sum(p.numel() for p in policy.parameters()) - policy.lm_head.weight.numel()
    return {
        "parameters": sum(p.numel() for p in policy.parameters()),
        "matmul_parameters": {"policy": backbone - embedding + policy.lm_head.weight.numel(),
                              "reward": backbone - embedding + score},
        "vocab": len(tokenizer),
        "sft": sft,
        "pairs": pairs,
    }  # fmt: skip


def batch_tokens(workload: str, assets: dict, args) -> list[tuple[int, int]]:
    """(real, padded) tokens of every batch, as both sides collate it (right padding to the longest row)."""
    out = []
    for b in range(args.warmup + args.steps):
        if workload == "sft":
            rows = [
                len(e["input_ids"]) for e in assets["sft"][b * args.batch_size : (b + 1) * args.batch_size]
            ]
        else:
            chunk = assets["pairs"][b * args.batch_size : (b + 1) * args.batch_size]
            rows = [
                len(e["prompt_ids"]) + len(e[side]) for side in ("chosen_ids", "rejected_ids") for e in chunk
            ]
        out.append((sum(rows), len(rows) * max(rows)))
    return out


def matmul_peak(threads: int, size: int = 2048, repeats: int = 5) -> float:
    """Best float32 matmul FLOP/s of this process on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# ------------------------------------------------------------------------------------ workers


MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv", "aten::dot"}


def step_breakdown(events, wall: float, steps: int) -> dict[str, float]:
    """Milliseconds per step in matmuls, attention, the optimizer step, other tensor ops, and outside
    tensor ops (Python, framework, autograd engine): the wall time no aten op accounts for."""
    totals = dict.fromkeys(("matmul", "attention", "optimizer", "other_ops"), 0.0)
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent, in_optimizer = e.cpu_parent, False
        while parent is not None and not in_optimizer:
            in_optimizer = parent.name in (OPTIMIZER_MARK, "Optimizer.zero_grad#AdamW.zero_grad")
            parent = parent.cpu_parent
        if in_optimizer:
            key = "optimizer"
        elif e.name in MATMUL_OPS:
            key = "matmul"
        elif "scaled_dot_product" in e.name or "flash_attention" in e.name:
            key = "attention"
        else:
            key = "other_ops"
        totals[key] += e.self_cpu_time_total / 1e3  # ms
    totals["python_framework"] = max(0.0, wall * 1e3 - sum(totals.values()))
    return {k: v / steps for k, v in totals.items()}


OPTIMIZER_MARK = "bench::adamw_update"


def mark_optimizer_update() -> None:
    """Wrap AdamW's update (``torch.optim.adam.adam``, which ``Adam.step`` calls after any closure)
    in a profiler range: Lightning runs forward and backward inside ``optimizer.step(closure)``."""
    import torch.optim.adam as adam_module
    from torch.profiler import record_function

    update = adam_module.adam

    def marked(*args, **kwargs):
        with record_function(OPTIMIZER_MARK):
            return update(*args, **kwargs)

    adam_module.adam = marked


class StepClock:
    """Wall and CPU time at the end of every optimizer step, the first step's loss, (``profile``)
    a torch.profiler breakdown of the timed steps, and (``memory``) the peak memory of the first timed
    step (``vs_trl_online.MemoryWindow``)."""

    def __init__(self, warmup: int, total: int, profile: bool = False, memory: bool = False):
        self.warmup, self.total, self.profile, self.memory = warmup, total, profile, memory
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.first_loss: float | None = None
        self.profiler = None
        self.events = None
        self.window = MemoryWindow() if memory else None

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if self.window is not None and len(self.wall) == self.warmup:
            self.window.start()
        elif self.window is not None and len(self.wall) == self.warmup + 1:
            self.window.stop()
        if self.profile and len(self.wall) == self.warmup:
            from torch.profiler import ProfilerActivity, profile

            mark_optimizer_update()
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.start()
        if self.profiler is not None and len(self.wall) == self.total:
            self.profiler.stop()
            self.events = self.profiler.events()

    def result(self) -> dict:
        steps = len(self.wall) - self.warmup
        seconds = self.wall[-1] - self.wall[self.warmup - 1]
        out = {
            "steps": steps,
            "seconds": seconds,
            "cpu_seconds": self.cpu[-1] - self.cpu[self.warmup - 1],
            "first_loss": self.first_loss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.window is not None:
            out["memory"] = self.window.result
        if self.events is not None:
            out["profile_ms_per_step"] = step_breakdown(self.events, seconds, steps)
            averages = sorted(self.events.key_averages(), key=lambda a: -a.self_cpu_time_total)
            out["top_ops_ms_per_step"] = {a.key: a.self_cpu_time_total / 1e3 / steps for a in averages[:12]}
        return out


def alignlit_worker(workload: str, root: Path, args) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from alignlit.callbacks import CompileDecoder
    from alignlit.data.encoding import Encoded, collate_lm
    from alignlit.data.preference import PairExample, collate_preference
    from alignlit.data.processing import Pair
    from alignlit.models.forward_settings import use_forward_settings
    from alignlit.modules import DPOModule, Optim, RewardModule, SFTModule

    optim = Optim(
        lr=args.lr,
        betas=(0.9, 0.999),
        weight_decay=args.weight_decay,
        warmup_steps=0,
        min_lr_ratio=1.0,
        fused=False if args.no_fused_adamw else None,  # None: alignlit's default (fused where it applies)
    )
    clock = StepClock(args.warmup, args.warmup + args.steps, args.profile, getattr(args, "memory", False))
    size = args.batch_size
    checkpointing = getattr(args, "gradient_checkpointing", False)

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if clock.first_loss is None:
                clock.first_loss = float(outputs["loss"])
            clock.tick()

    if workload == "sft":
        data = [
            Encoded(e["input_ids"], e["prompt_length"]) for e in json.loads((root / "sft.json").read_text())
        ]
        module = SFTModule(policy=str(root / "policy"), optim=optim, gradient_checkpointing=checkpointing)
        pad = module.tokenizer.pad_token_id

        def collate(examples):
            return collate_lm(examples, pad)
    else:
        data = []
        for e in json.loads((root / "pairs.json").read_text()):
            prompt = e["prompt_ids"]
            chosen = Encoded(prompt + e["chosen_ids"], len(prompt))
            rejected = Encoded(prompt + e["rejected_ids"], len(prompt))
            data.append(PairExample(chosen, rejected, 0.0, Pair(e["prompt"], e["chosen"], e["rejected"])))
        if workload == "reward":
            module = RewardModule(
                model=str(root / "reward"), optim=optim, histogram=False, gradient_checkpointing=checkpointing
            )
        else:
            module = DPOModule(
                policy=str(root / "policy"),
                reference=str(root / "policy"),
                beta=0.1,
                precompute_reference=workload == "dpo_cached",
                reference_cache_dir=str(root / f"cache-{os.getpid()}"),
                optim=optim,
                gradient_checkpointing=checkpointing,
            )
        pad = module.tokenizer.pad_token_id

        def collate(examples):
            return collate_preference(examples, pad)

    class Data(L.LightningDataModule):
        def __init__(self, train_file: str):
            super().__init__()
            self.save_hyperparameters()

        def train_dataloader(self):
            return DataLoader(data, batch_size=size, shuffle=False, collate_fn=collate)

        def val_dataloader(self):
            return []

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[
            Clock(),
            *([CompileDecoder()] if args.compile else []),
        ],  # --compile: as a user switches it on
    )
    settings = {"packing": not args.no_packing, "fused_head": not args.no_fused_head}
    with use_forward_settings(**settings):
        trainer.fit(module, datamodule=Data(str(root / "pairs.json")))
    return clock.result()


def trl_worker(workload: str, root: Path, args) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback

    from alignlit.data.tokenizer import load_tokenizer

    clock = StepClock(args.warmup, args.warmup + args.steps, args.profile, getattr(args, "memory", False))
    tokenizer = load_tokenizer(root / "policy")
    common = dict(
        output_dir=str(root / f"trl-{os.getpid()}"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps,
        learning_rate=args.lr,
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=args.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0.0,
        # TRL's default with torch >= 2.8 is the fused kernel, as alignlit's; --no-fused-adamw: both loop
        optim="adamw_torch" if args.no_fused_adamw else "adamw_torch_fused",
        bf16=False,
        gradient_checkpointing=getattr(args, "gradient_checkpointing", False),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
        seed=0,
    )

    class Clock(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            clock.tick()

    def first_loss(cls):
        class Recorded(cls):
            def compute_loss(self, *a, **kw):
                out = super().compute_loss(*a, **kw)
                if clock.first_loss is None:
                    loss = out[0] if isinstance(out, tuple) else out
                    clock.first_loss = float(loss.detach())
                return out

            def _prepare_dataset(self, dataset, *a, **kw):  # already tokenised by the benchmark
                return dataset if workload.startswith("dpo") else super()._prepare_dataset(dataset, *a, **kw)

        return Recorded

    if workload == "sft":
        rows = [
            {"input_ids": e["input_ids"], "completion_mask": [0] * e["prompt_length"] + [1] * (len(e["input_ids"]) - e["prompt_length"])}
            for e in json.loads((root / "sft.json").read_text())
        ]  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(str(root / "policy"), dtype=torch.float32)
        config = trl.SFTConfig(max_length=args.max_length, completion_only_loss=True, **common)
        trainer = first_loss(trl.SFTTrainer)(
            model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
            callbacks=[Clock()],
        )  # fmt: skip
    elif workload == "reward":
        rows = [
            {
                "chosen_ids": e["prompt_ids"] + e["chosen_ids"],
                "rejected_ids": e["prompt_ids"] + e["rejected_ids"],
            }
            for e in json.loads((root / "pairs.json").read_text())
        ]
        model = AutoModelForSequenceClassification.from_pretrained(
            str(root / "reward"), num_labels=1, dtype=torch.float32
        )
        config = trl.RewardConfig(max_length=args.max_length, **common)
        trainer = first_loss(trl.RewardTrainer)(
            model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
            callbacks=[Clock()],
        )  # fmt: skip
    else:
        rows = [
            {k: e[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
            for e in json.loads((root / "pairs.json").read_text())
        ]
        model = AutoModelForCausalLM.from_pretrained(str(root / "policy"), dtype=torch.float32)
        live = workload == "dpo_live"
        reference = (
            AutoModelForCausalLM.from_pretrained(str(root / "policy"), dtype=torch.float32) if live else None
        )
        config = trl.DPOConfig(
            beta=0.1, max_length=args.max_length, precompute_ref_log_probs=not live, **common
        )
        trainer = first_loss(trl.DPOTrainer)(
            model=model, ref_model=reference, args=config, train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer, callbacks=[Clock()],
        )  # fmt: skip
    trainer.train()
    return clock.result()


def worker_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    root = Path(args.assets)
    if args.workload in ONLINE_WORKLOADS:
        worker = alignlit_online_worker if args.worker == "alignlit" else trl_online_worker
        result = worker(args.workload, root, args, "check" if args.check else "timed")
    elif args.worker == "alignlit":
        result = alignlit_worker(args.workload, root, args)
    else:
        result = trl_worker(args.workload, root, args)
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------- driver


def run_worker(python: str, side: str, workload: str, root: Path, args, check: bool = False) -> dict:
    command = [
        python, __file__, "--worker", side, "--workload", workload, "--assets", str(root),
        "--threads", str(args.threads), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--lr", str(args.lr), "--weight-decay", str(args.weight_decay),
        "--max-length", str(args.max_length), "--max-prompt-length", str(args.max_prompt_length),
        *(["--no-packing"] if args.no_packing else []), *(["--no-fused-head"] if args.no_fused_head else []),
        *(["--compile"] if args.compile else []), *(["--profile"] if args.profile else []),
        *(["--no-fused-adamw"] if args.no_fused_adamw else []),
        "--rollouts", str(args.rollouts), "--online-warmup", str(args.online_warmup),
        "--rollout-prompts", str(args.rollout_prompts), "--group", str(args.group),
        "--minibatch", str(args.minibatch), "--max-new-tokens", str(args.max_new_tokens),
        "--online-lr", str(args.online_lr), *(["--check"] if check else []),
        "--prompt-words", str(args.prompt_words),
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "OMP_WAIT_POLICY": args.omp_wait_policy,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONWARNINGS": "ignore",
        "BENCH_SIM_DIR": str(root / "sim"),
    }
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{side} {workload} worker failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def alternating_runs(workload: str, root: Path, args) -> dict[str, list[dict]]:
    """``--reps`` timed runs of each side, each in its own process, the order alternating per repetition."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for rep in range(args.reps):
        for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
            python = args.trl_python if side == "trl" else sys.executable
            runs[side].append(run_worker(python, side, workload, root, args))
            print(f"  {workload} rep {rep} {side}: {runs[side][-1]['seconds']:.2f} s", flush=True)
    return runs


def check_trl(python: str) -> str:
    proc = subprocess.run(
        [python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"TRL is not importable by {python}: install trl=={TRL_VERSION} beside alignlit "
            "(`nox -s bench` does) or pass --trl-python"
        )
    return proc.stdout.strip()


def summarise(workload: str, side: str, runs: list[dict], tokens, assets: dict, peak: float, args) -> dict:
    timed = tokens[args.warmup :]
    real, padded = sum(t[0] for t in timed), sum(t[1] for t in timed)
    seconds = statistics.median(r["seconds"] for r in runs)
    n = assets["matmul_parameters"]["reward" if workload == "reward" else "policy"]
    flops_per_token = 8 * n if workload == "dpo_live" else 6 * n
    examples = args.batch_size * args.steps
    return {
        "workload": workload,
        "side": side,
        "runs": runs,
        "seconds": seconds,
        "examples_per_s": examples / seconds,
        "real_tokens_per_s": real / seconds,
        "padded_tokens_per_s": padded / seconds,
        "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "first_loss": runs[0]["first_loss"],
        "profile_ms_per_step": runs[0].get("profile_ms_per_step"),
        "tflops": flops_per_token * real / seconds / 1e12,
        "mfu": flops_per_token * real / seconds / peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--batch-size", type=int, default=16, help="examples (pairs) per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--max-prompt-length", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--trl-python", default=sys.executable, help="python that imports TRL (default: this one)"
    )
    parser.add_argument("--no-packing", action="store_true", help="alignlit: padded rows (ForwardSettings)")
    parser.add_argument(
        "--no-fused-head", action="store_true", help="alignlit: full logits (ForwardSettings)"
    )
    parser.add_argument("--compile", action="store_true", help="alignlit: torch.compile the decoder")
    parser.add_argument(
        "--no-fused-adamw",
        action="store_true",
        help="alignlit: torch's per-parameter AdamW loop (Optim(fused=False); the default is the fused "
        "kernel where it applies: the same updates)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler breakdown of the timed steps (slower; not for timing)",
    )
    parser.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of both sides (PASSIVE: idle OpenMP threads sleep instead of spinning; on a "
        "shared machine spinning threads made step times vary 20-fold)",
    )
    parser.add_argument("--loss-tol", type=float, default=1e-5)
    online = parser.add_argument_group("online workloads (grpo, rloo)")
    online.add_argument("--rollouts", type=int, default=6, help="timed rollouts per run")
    online.add_argument("--online-warmup", type=int, default=1, help="untimed rollouts before them")
    online.add_argument("--rollout-prompts", type=int, default=8, help="prompts per rollout")
    online.add_argument("--group", type=int, default=4, help="samples per prompt")
    online.add_argument("--minibatch", type=int, default=16, help="samples per optimizer step")
    online.add_argument("--max-new-tokens", type=int, default=32)
    online.add_argument("--online-lr", type=float, default=1e-5)
    online.add_argument(
        "--prompt-words", type=int, default=0, help="symbols of context before each prompt (long prompts)"
    )
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        default=None,
        help="JSON written (default: benchmarks/results/vs_trl.json, or vs_trl_online.json when every workload "
        "is an online one)",
    )
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {list(WORKLOADS)}")
    trl_version = check_trl(args.trl_python)
    peak = matmul_peak(args.threads)
    load_start = os.getloadavg()
    results, online_results, failures = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = build_assets(root, args)
        if any(w in ONLINE_WORKLOADS for w in workloads):
            assets["online"] = build_online_assets(root, args)
        for workload in workloads:
            if workload in ONLINE_WORKLOADS:
                online_results.append(run_online(workload, root, args, failures))
                print_online(online_results[-1:], args)
                continue
            tokens = batch_tokens(workload, assets, args)
            runs = alternating_runs(workload, root, args)
            pair = {side: summarise(workload, side, runs[side], tokens, assets, peak, args) for side in SIDES}
            diff = abs(pair["alignlit"]["first_loss"] - pair["trl"]["first_loss"])
            if diff > args.loss_tol:
                failures.append(f"{workload}: first-step losses differ by {diff:.3g} (> {args.loss_tol})")
            results.append({**pair, "ratio": pair["alignlit"]["examples_per_s"] / pair["trl"]["examples_per_s"],
                            "first_loss_diff": diff})  # fmt: skip
    peak = max(peak, matmul_peak(args.threads))
    for r in results:  # MFU against the better of the two peak measurements
        for side in SIDES:
            r[side]["mfu"] = r[side]["tflops"] * 1e12 / peak

    print(
        f"\nmodel: tiny Llama, {assets['parameters'] / 1e6:.2f}M parameters, vocab {assets['vocab']}; TRL {trl_version}"
    )
    if results:
        print_offline(results, args, peak)
    if online_results:
        print_online(online_results, args)
    online_only = all(w in ONLINE_WORKLOADS for w in workloads)
    out = Path(args.out or f"benchmarks/results/{'vs_trl_online' if online_only else 'vs_trl'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "vs_trl",
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "workload", "assets", "check")},
        "model": {"parameters": assets["parameters"], "matmul_parameters": assets["matmul_parameters"],
                  "vocab": assets["vocab"], **MODEL},
        "trl": trl_version,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_start": load_start,
            "load_average_at_end": os.getloadavg(),
            "matmul_peak_flops": peak,
        },
        "results": results,
        "online_results": online_results,
        "failures": failures,
    }  # fmt: skip
    out.write_text(json.dumps(stamp(payload), indent=2) + "\n")
    print(f"wrote {out}")
    if failures:
        raise SystemExit("; ".join(failures))


def run_online(workload: str, root: Path, args, failures: list[str]) -> dict:
    """The loss check (one untimed run per side on the driver's completions), then ``--reps`` timed runs
    per side, alternating."""
    checks = {}
    for side in SIDES:
        python = args.trl_python if side == "trl" else sys.executable
        checks[side] = run_worker(python, side, workload, root, args, check=True)
    runs = alternating_runs(workload, root, args)
    result = summarise_online(workload, runs, checks, args)
    for name, diff in result.get("check_diffs", {}).items():
        if diff > args.loss_tol:
            failures.append(f"{workload}: {name} differs by {diff:.3g} (> {args.loss_tol})")
    return result


def print_offline(results: list[dict], args, peak: float) -> None:
    print(
        f"batch {args.batch_size}, max_length {args.max_length}, {args.steps} timed steps after {args.warmup}, "
        f"{args.reps} reps, {args.threads} threads; matmul peak {peak / 1e9:.1f} GFLOP/s"
    )
    header = (
        f"{'workload':<11} {'side':<8} {'ex/s':>7} {'tok/s real':>10} {'tok/s pad':>10} {'CPU ms/step':>11} "
        f"{'RSS MB':>7} {'MFU':>6} {'first loss':>12} {'ratio':>6} {'|Δ loss|':>9}"
    )
    print(header)
    for r in results:
        for side in SIDES:
            s = r[side]
            tail = f"{r['ratio']:>6.2f} {r['first_loss_diff']:>9.1e}" if side == "alignlit" else ""
            print(
                f"{r['alignlit']['workload']:<11} {side:<8} {s['examples_per_s']:>7.1f} "
                f"{s['real_tokens_per_s']:>10.0f} {s['padded_tokens_per_s']:>10.0f} "
                f"{1e3 * s['cpu_seconds'] / args.steps:>11.0f} {s['peak_rss_mb']:>7.0f} "
                f"{100 * s['mfu']:>5.1f}% {s['first_loss']:>12.7f} {tail}"
            )
    if args.profile:
        keys = ("matmul", "attention", "other_ops", "optimizer", "python_framework")
        print(f"\nwhere a step's time goes (torch.profiler, ms per step): {', '.join(keys)}")
        for r in results:
            for side in SIDES:
                p = r[side]["profile_ms_per_step"]
                total = sum(p.values())
                cells = " ".join(f"{p[k]:>7.1f} ({100 * p[k] / total:>3.0f}%)" for k in keys)
                print(f"{r['alignlit']['workload']:<11} {side:<8} {cells}  total {total:.1f}")


if __name__ == "__main__":
    main()
