"""Generation throughput of the rollout engines on one tiny model and one prompt set.

Builds a local tokenizer and a tiny random Llama (the quickstart size: hidden 128, 4 layers, 2 heads
of 64), exports it, and times ``generate`` for each engine on the same prompts and sampling
parameters: response tokens per second over ``--repeats`` timed calls after one warm-up call, plus
engine start-up time, process CPU time (less sensitive than wall time to other load on a shared
machine) and the engine's log-prob parity with the model (max |Δ log p|).
Prints a table and writes ``benchmarks/results/generation.json``.

    python benchmarks/bench_generation.py                   # hf and vllm (hf only without vllm)
    python benchmarks/bench_generation.py --engines hf --prompts 128 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from alignlit.models import export_pretrained, make_tiny_llama, train_bpe_tokenizer
from alignlit.rollout import HFEngine, SamplingParams, VLLMEngine, logprob_parity

ENGINES = ("hf", "vllm")
OPS = ("sort", "reverse", "copy", "dedupe")
SYMBOLS = "abcdefghijkl"


def make_prompts(count: int) -> list[str]:
    """Deterministic HH-style prompts over short symbol sequences (3 to 8 symbols)."""
    out = []
    for i in range(count):
        seq = " ".join(SYMBOLS[(i * 5 + j * 7) % len(SYMBOLS)] for j in range(3 + i % 6))
        out.append(f"\n\nHuman: {OPS[i % len(OPS)]} {seq}\n\nAssistant:")
    return out


def corpus(count: int = 2000) -> list[str]:
    return [p + " " + p.split(": ")[1].split("\n")[0] for p in make_prompts(count)]


def build_engine(name: str, model, tokenizer, model_dir: Path, args):
    if name == "hf":
        return HFEngine(tokenizer, model, micro_batch_size=args.micro_batch_size)
    return VLLMEngine(model_dir, tokenizer, max_model_len=256)


def time_engine(name: str, model, tokenizer, model_dir: Path, prompts: list[str], args) -> dict:
    start = time.perf_counter()
    engine = build_engine(name, model, tokenizer, model_dir, args)
    startup = time.perf_counter() - start
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    engine.generate(prompts, args.n, sampling)  # warm-up: first-call compilation and caches
    tokens, seconds, cpu_seconds, parity = 0, 0.0, 0.0, 0.0
    for r in range(args.repeats):
        sampling.seed = r + 1
        start, cpu_start = time.perf_counter(), time.process_time()
        rollout = engine.generate(prompts, args.n, sampling)
        seconds += time.perf_counter() - start
        cpu_seconds += time.process_time() - cpu_start
        tokens += int(rollout.response_lengths.sum())
        metrics = logprob_parity(model, rollout, temperature=args.temperature, max_samples=8)
        parity = max(parity, metrics["max_abs_diff"])
    return {
        "engine": name,
        "startup_s": round(startup, 2),
        "calls": args.repeats,
        "samples_per_call": len(prompts) * args.n,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "parity_max_abs_diff": parity,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated subset of: hf, vllm")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="HFEngine prompts per call")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--out", default="benchmarks/results/generation.json")
    args = parser.parse_args()

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    notes = []
    if "vllm" in engines and importlib.util.find_spec("vllm") is None:
        engines.remove("vllm")
        notes.append("vllm is not installed: HF engine only (install the vllm extra, .ci/install-vllm.sh)")
        print(notes[-1])
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    tokenizer = train_bpe_tokenizer(corpus(), vocab_size=512)
    model = make_tiny_llama(tokenizer, seed=0).eval().to(args.device)
    num_params = sum(p.numel() for p in model.parameters())
    prompts = make_prompts(args.prompts)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = export_pretrained(model, tokenizer, Path(tmp) / "policy", stage="bench")
        for name in engines:
            results.append(time_engine(name, model, tokenizer, model_dir, prompts, args))

    header = (
        f"{'engine':<6} {'startup s':>9} {'tokens':>7} {'seconds':>8} {'cpu s':>7} {'tokens/s':>9} "
        f"{'parity max|Δ|':>14}"
    )
    print(
        f"\nmodel: tiny Llama, {num_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}; "
        f"{args.prompts} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, "
        f"T={args.temperature}, {args.repeats} timed calls; torch threads {torch.get_num_threads()}"
    )
    print(header)
    for r in results:
        print(
            f"{r['engine']:<6} {r['startup_s']:>9.1f} {r['tokens']:>7d} {r['seconds']:>8.2f} "
            f"{r['cpu_seconds']:>7.2f} {r['tokens_per_s']:>9.1f} {r['parity_max_abs_diff']:>14.2e}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "generation",
        "config": {**vars(args), "engines": engines, "model_parameters": num_params},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_1m_at_end": os.getloadavg()[0],
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "notes": notes,
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
