"""Weight sync into served vLLM engines: the collective push (gloo broadcast) against the file path (safetensors
in /dev/shm, loaded by the engine), on a Llama of a few hundred MB with random weights built from its config.

Starts ``--engines`` engines with ``alignlit serve`` (CPU here), pushes the same state ``--repeats`` times each
way (after one warm-up push each), with and without the checksum verification, and checks after every push
that each engine holds the label (and, once per mode, log-prob parity of a short rollout against the model).
Prints a table and writes ``benchmarks/results/weight_sync.json`` (``--out``). Each mode's pushes and the
engines' start-up are cells (``harness.Cells``, under ``--work``, default ``out/bench/weight_sync``) read back
for the same settings and code, so a cut run resumes; the engines start only when a mode is left to measure.

    python benchmarks/bench_weight_sync.py                        # hidden 1024, 12 layers: ~570 MB float32
    python benchmarks/bench_weight_sync.py --engines 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch

from alignlit.models import export_pretrained, train_bpe_tokenizer
from alignlit.rollout import SamplingParams, check_parity
from alignlit.rollout.endpoint import EngineProcess
from alignlit.rollout.engine_auth import new_api_key
from alignlit.rollout.server import ServedVLLMEngine
from harness import code_stamp, measurement_cells, write_results  # benchmarks/ is on sys.path

MODES = ("collective", "file")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(args, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64, head_dim=64,
        intermediate_size=args.intermediate, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def measure(args, work: Path, tokenizer, model, cells, spec: dict, modes: list[str]) -> float:
    """Start the engines and measure each of ``modes``, one cell each (``push-<mode>``); the engines'
    start-up seconds (the cell ``engine-startup``: the first measured is kept)."""
    cores = max(1, os.cpu_count() or 1)
    start = time.perf_counter()
    key = new_api_key()  # the engines' shared secret
    engines = [
        EngineProcess(work / "policy", _free_port(), extra=["--max-model-len", "512"], log=work / f"engine-{k}.log",
                      api_key=key, env={"VLLM_CPU_OMP_THREADS_BIND": str(k % cores), "VLLM_LOGGING_LEVEL": "WARNING"})
        for k in range(args.engines)
    ]  # fmt: skip
    try:
        for e in engines:
            e.wait_ready(1800)
        elapsed = time.perf_counter() - start
        startup = cells.run("engine-startup", lambda: elapsed, spec)
        moved = {k: v + 0.01 for k, v in model.state_dict().items()}
        for mode in modes:
            cells.run(
                f"push-{mode}", lambda m=mode: push(args, engines, key, tokenizer, model, moved, m), spec
            )
    finally:
        for e in engines:
            e.stop()
    return startup


def push(args, engines, key, tokenizer, model, moved: dict, mode: str) -> dict:
    """``--repeats`` pushes of the state into the engines one way (after a warm-up push), timed; the
    log-prob parity of a short rollout against the model after them."""
    verify = True  # the checksum can no longer be turned off (issue 36)
    client = ServedVLLMEngine([e.url for e in engines], tokenizer, model_config=model.config,
                              weight_sync=mode, bucket_mb=args.bucket_mb, api_key=key)  # fmt: skip
    client.load_weights(0, moved)  # warm-up (and, collective: forming the group)
    first = dict(client.last_push)
    totals, parts = [], []
    for r in range(args.repeats):
        state = model.state_dict() if r % 2 == 0 else moved
        t0 = time.perf_counter()
        client.load_weights(r + 1, state)
        totals.append(time.perf_counter() - t0)
        parts.append(dict(client.last_push))
    model_now = model if (args.repeats - 1) % 2 == 0 else None
    parity = None
    if model_now is not None and verify:
        rollout = client.generate(["\n\nHuman: sort a b\n\nAssistant:"], 2,
                                  SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))  # fmt: skip
        parity = check_parity(model, rollout, temperature=1.0, tol=1e-3)["max_abs_diff"]
    row = {
        "mode": mode, "verify": verify, "engines": args.engines, "repeats": args.repeats,
        "median_s": statistics.median(totals), "min_s": min(totals), "max_s": max(totals),
        "first_push_s": first.get("total_s"),
        "parts_median": {k: statistics.median(p[k] for p in parts) for k in parts[0]},
        "parity_max_abs_diff": parity,
    }  # fmt: skip
    print(f"{mode:10s} verify={verify!s:5s}: median {row['median_s']:.2f} s "
          f"(min {row['min_s']:.2f}, max {row['max_s']:.2f}) parts {row['parts_median']}", flush=True)  # fmt: skip
    client.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument(
        "--work", default=None, help="folder for the model and cells (default: out/bench/weight_sync)"
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "weight_sync.json"))
    args = p.parse_args()

    work = Path(args.work or measurement_cells("weight_sync").dir.parent)
    texts = [
        f"\n\nHuman: sort {' '.join('abcdefgh'[(i + j) % 8] for j in range(4))}\n\nAssistant: ok"
        for i in range(400)
    ]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=320, out_dir=work / "tokenizer")
    from alignlit.models import load_tokenizer

    tokenizer = load_tokenizer(work / "tokenizer")
    model = build_model(args, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    export_pretrained(model, tokenizer, work / "policy", stage="init")
    print(f"model: {params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB float32", flush=True)

    cells = measurement_cells("weight_sync", args.work)
    spec = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("work", "out")},
        "code": code_stamp(),
    }
    left = [mode for mode in MODES if cells.get(f"push-{mode}", spec) is None]
    startup = cells.get("engine-startup", spec)
    if left:  # the engines start only for the modes left to measure
        startup = measure(args, work, tokenizer, model, cells, spec, left)
    results = [cells.get(f"push-{mode}", spec) for mode in MODES]
    out = {
        "model": {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate, "vocab": args.vocab,
                  "parameters": params, "bytes": nbytes, "dtype": "float32"},
        "bucket_mb": args.bucket_mb, "engine_startup_s": startup,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "device": "cpu", "backend": "gloo (collective); safetensors in /dev/shm (file)"},
        "results": results,
    }  # fmt: skip
    table = markdown(out)
    write_results(Path(args.out).stem, out, table=table, results_dir=Path(args.out).parent)
    print(table)
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.md')}")


def markdown(out: dict) -> str:
    m = out["model"]
    lines = [
        f"Weight sync into {out['results'][0]['engines']} served vLLM engine(s) (CPU): a Llama of "
        f"{m['parameters'] / 1e6:.0f}M parameters, {m['bytes'] / 2**20:.0f} MiB {m['dtype']}, "
        f"{out['results'][0]['repeats']} pushes per row after a warm-up; buckets of {out['bucket_mb']:g} MB.",
        "",
        "| path | checksum verified | median (s) | min (s) | max (s) | MiB/s | parity max abs diff |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in out["results"]:
        parity = "" if r["parity_max_abs_diff"] is None else f"{r['parity_max_abs_diff']:.1e}"
        lines.append(
            f"| {r['mode']} | {'yes' if r['verify'] else 'no'} | {r['median_s']:.2f} | {r['min_s']:.2f} | "
            f"{r['max_s']:.2f} | {m['bytes'] / 2**20 / r['median_s']:.0f} | {parity} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
