"""Generation throughput of the rollout engines on one tiny model and one prompt set.

Builds a local tokenizer and a tiny random Llama (``--size``: ``quickstart``, hidden 128, 4 layers,
2 heads of 64; ``bench``, the model of ``bench_vs_trl.py``, hidden 256, 4 layers, 4 heads), exports
it, and times ``generate`` for each engine on the same prompts and sampling parameters: response
tokens per second (median over ``--repeats`` timed calls after one warm-up call, every engine once per
repeat, in turn), engine start-up time (with a compiled variant: the first call, which compiles),
process CPU time and the engine's log-prob parity with the model (max |Δ log p|, the quantity the
engine parity tests bound). The HF engine runs in each of its variants (:class:`~alignlit.rollout.HFEngine`'s
``kv_cache``, ``compile`` and ``share_prompt``); vLLM (CPU build, eager) on the same exported model.
``--prompt-words`` lengthens the prompts (a long shared prefix, where ``share_prompt`` can pay).
Prints a table and writes ``benchmarks/results/generation.json``.

    python benchmarks/bench_generation.py                   # hf variants and vllm (hf only without vllm)
    python benchmarks/bench_generation.py --engines hf,hf-static --prompts 8 --n 4 --max-new-tokens 32
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see bench_vs_trl.py)

import argparse
import functools
import importlib.util
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from alignlit.models import export_pretrained, make_tiny_llama, train_bpe_tokenizer
from alignlit.rollout import HFEngine, SamplingParams, VLLMEngine, logprob_parity
from harness import (  # benchmarks/ is on sys.path when a script runs
    code_stamp,
    measurement_cells,
    write_results,
)

ENGINES = {  # name: HFEngine options (None: vLLM)
    "hf": {},
    "hf-static": {"kv_cache": "static"},
    "hf-static-compile": {"kv_cache": "static", "compile": True},
    "hf-share-prompt": {"share_prompt": True},
    "hf-static-share-prompt": {"kv_cache": "static", "share_prompt": True},
    "vllm": None,
}
SIZES = {
    "quickstart": dict(hidden_size=128, num_layers=4, num_heads=2, head_dim=64, intermediate_size=512),
    "bench": dict(hidden_size=256, num_layers=4, num_heads=4, head_dim=64, intermediate_size=640),
}
OPS = ("sort", "reverse", "copy", "dedupe")
SYMBOLS = "abcdefghijkl"


def make_prompts(count: int, words: int = 0) -> list[str]:
    """Deterministic HH-style prompts over short symbol sequences (3 to 8 symbols), after ``words``
    symbols of context."""
    out = []
    for i in range(count):
        seq = " ".join(SYMBOLS[(i * 5 + j * 7) % len(SYMBOLS)] for j in range(3 + i % 6))
        context = " ".join(SYMBOLS[(i + j * 3) % len(SYMBOLS)] for j in range(words))
        out.append(f"{context}\n\nHuman: {OPS[i % len(OPS)]} {seq}\n\nAssistant:")
    return out


def corpus(count: int = 2000) -> list[str]:
    return [p + " " + p.split(": ")[1].split("\n")[0] for p in make_prompts(count)]


def build_engine(name: str, model, tokenizer, model_dir: Path, args):
    if ENGINES[name] is None:
        return VLLMEngine(model_dir, tokenizer, max_model_len=args.max_model_len)
    return HFEngine(tokenizer, model, micro_batch_size=args.micro_batch_size, **ENGINES[name])


def sample_and_time(engine, model, prompts: list[str], args, seed: int) -> dict:
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=seed)
    start, cpu_start = time.perf_counter(), time.process_time()
    rollout = engine.generate(prompts, args.n, sampling)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    parity = logprob_parity(model, rollout, temperature=args.temperature, max_samples=8)["max_abs_diff"]
    return {
        "tokens": int(rollout.response_lengths.sum()),
        "seconds": seconds,
        "cpu_seconds": cpu,
        "parity": parity,
    }


def measure(model, tokenizer, prompts, engines: list[str], args) -> list[dict]:
    """One cell: every engine built, warmed up and timed, the calls alternating between them."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = export_pretrained(model, tokenizer, Path(tmp) / "policy", stage="bench")
        built = {}
        for name in engines:
            start = time.perf_counter()
            engine = build_engine(name, model, tokenizer, model_dir, args)
            sample_and_time(engine, model, prompts, args, seed=0)  # warm-up: compilation, caches
            built[name] = (engine, time.perf_counter() - start)
        calls = {name: [] for name in engines}
        for r in range(args.repeats):
            order = engines if r % 2 == 0 else engines[::-1]
            for name in order:
                calls[name].append(sample_and_time(built[name][0], model, prompts, args, seed=r + 1))
        for name in engines:
            c = calls[name]
            tokens_per_s = statistics.median(x["tokens"] / x["seconds"] for x in c)
            results.append({
                "engine": name, "options": ENGINES[name], "startup_s": round(built[name][1], 2), "calls": len(c),
                "samples_per_call": len(prompts) * args.n, "tokens": sum(x["tokens"] for x in c),
                "seconds": round(sum(x["seconds"] for x in c), 3),
                "cpu_seconds": round(sum(x["cpu_seconds"] for x in c), 3),
                "tokens_per_s": round(tokens_per_s, 1), "parity_max_abs_diff": max(x["parity"] for x in c),
            })  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated subset of {list(ENGINES)}"
    )
    parser.add_argument("--size", default="bench", choices=list(SIZES), help="the tiny Llama's size")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-words", type=int, default=0, help="symbols of context before each prompt")
    parser.add_argument("--max-model-len", type=int, default=256, help="positions of the model (and vLLM)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="HFEngine prompts per call")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--work", default=None, help="measured cells (default out/bench/generation)")
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
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    tokenizer = train_bpe_tokenizer(corpus(), vocab_size=512)
    model = make_tiny_llama(tokenizer, seed=0, max_position_embeddings=args.max_model_len, **SIZES[args.size])
    model = model.eval().to(args.device)
    num_params = sum(p.numel() for p in model.parameters())
    prompts = make_prompts(args.prompts, args.prompt_words)
    prompt_tokens = statistics.fmean(len(tokenizer(p)["input_ids"]) for p in prompts)
    cells, spec = measurement_cells("generation", args.work), {"config": vars(args), "code": code_stamp()}
    compute = functools.partial(measure, model, tokenizer, prompts, engines, args)
    results = cells.run("engines", compute, spec)  # the engines' calls alternate: one cell
    base = next((r["tokens_per_s"] for r in results if r["engine"] == "hf"), None)
    for r in results:
        r["vs_hf"] = round(r["tokens_per_s"] / base, 3) if base else None

    header = (
        f"{'engine':<18} {'startup s':>9} {'tokens':>7} {'seconds':>8} {'cpu s':>7} {'tokens/s':>9} {'vs hf':>6} "
        f"{'parity max|Δ|':>14}"
    )
    print(
        f"\nmodel: tiny Llama ({args.size}), {num_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}; "
        f"{args.prompts} prompts of {prompt_tokens:.0f} tokens x n={args.n}, max_new_tokens={args.max_new_tokens}, "
        f"T={args.temperature}, median of {args.repeats} calls; torch threads {torch.get_num_threads()}"
    )
    print(header)
    for r in results:
        print(
            f"{r['engine']:<18} {r['startup_s']:>9.1f} {r['tokens']:>7d} {r['seconds']:>8.2f} "
            f"{r['cpu_seconds']:>7.2f} {r['tokens_per_s']:>9.1f} {r['vs_hf'] or 0:>6.2f} {r['parity_max_abs_diff']:>14.2e}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "generation",
        "config": {
            **vars(args),
            "engines": engines,
            "model_parameters": num_params,
            "prompt_tokens": prompt_tokens,
        },
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
    write_results(out.stem, payload, results_dir=out.parent)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
