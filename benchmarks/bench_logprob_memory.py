"""Peak memory and time of token log-probs: full logits vs the fused, chunked LM head.

Today's naive path builds the model's full ``(N, T, V)`` logits and gathers log-probs from them;
the fused path (:func:`alignlit.ops.logprobs.linear_logprobs`, the default of
:mod:`alignlit.models.forward`) projects only the scored positions through the LM head, a chunk of
rows at a time, in the forward and again in the backward pass. Measured on a tiny random Llama
(hidden 256, 4 layers) with a 32k vocabulary, on a batch of ``--rows`` sequences of ``--length``
tokens whose second half is scored (a DPO/PPO response):

- the log-prob part of the step: from the final hidden states to the log-probs (and entropies) and
  back to the gradients of the hidden states and the head, the part the vocabulary size drives;
  the fused path must need at most 1/4 of the naive peak (checked; exit status 1 otherwise);
- the whole step: ``token_logprobs`` forward and backward through the model.

Peak memory is the most bytes allocated at once through the CPU allocator during the part, above
what was allocated before it (torch.profiler allocation events, so it does not depend on the
allocator's caching or the process's RSS). Time is the median over ``--repeats`` runs. The same
timings for the quickstart-sized model (vocabulary 512) tell whether the fused head may be the
default (it must not be slower there). Prints a table and writes
``benchmarks/results/logprob_memory.json``.

    python benchmarks/bench_logprob_memory.py
    python benchmarks/bench_logprob_memory.py --vocab 151936 --rows 4 --length 512
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see bench_vs_trl.py)

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from alignlit.models.forward import token_logprobs
from alignlit.models.scoring import logits_scored
from alignlit.ops.logprobs import linear_logprobs
from harness import (  # benchmarks/ is on sys.path when a script runs
    allocation_peak,
    code_stamp,
    measurement_cells,
    write_results,
)


def peak_bytes(fn) -> int:
    """Most bytes allocated at once (CPU allocator) while ``fn`` runs, above the level at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return allocation_peak(prof)


def seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tiny_llama(vocab: int, hidden: int, layers: int, intermediate: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(vocab: int, rows: int, length: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    attention = torch.ones(rows, length, dtype=torch.bool)
    loss = torch.zeros(rows, length, dtype=torch.bool)
    loss[:, length // 2 :] = True
    return ids, attention, loss


def head_part(model, ids, attention, loss, *, fused: bool, entropy: bool):
    """The log-prob part alone: final hidden states -> log-probs (+ entropies) -> gradients."""
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
    hidden = hidden.contiguous().requires_grad_()
    labels, mask = ids[:, 1:], loss[:, 1:]
    head = model.get_output_embeddings()

    def run():
        head.weight.grad = None
        hidden.grad = None
        if fused:
            rows, cols = mask.nonzero(as_tuple=True)
            lp, ent = linear_logprobs(
                hidden[rows, cols], head.weight, labels[rows, cols], with_entropy=entropy
            )
        else:
            lp, ent = logits_scored(
                head(hidden), labels, mask, temperature=1.0, with_entropy=entropy, entropy_grad=True
            )
        total = lp.sum() + (ent.sum() if ent is not None else 0)
        total.backward()

    return run


def whole_step(model, ids, attention, loss, *, fused: bool, entropy: bool):
    def run():
        model.zero_grad(set_to_none=True)
        out = token_logprobs(
            model, ids, attention, loss, with_entropy=entropy, fused_head=fused, packing=False
        )
        total = out.logprobs.sum() + (out.entropy.sum() if out.entropy is not None else 0)
        total.backward()

    return run


def measure(name: str, model, data, args, *, memory: bool, cells, spec: dict) -> list[dict]:
    """One cell (cached in ``cells``: a cut run resumes) per part and entropy setting."""
    rows = []
    for part, make in (("log-prob part", head_part), ("whole step", whole_step)):
        for entropy in (False, True):
            compute = functools.partial(entry, name, part, make, model, data, entropy, args, memory)
            rows.append(cells.run(f"{name}-{part}-entropy={entropy}", compute, spec))
    return rows


def entry(name: str, part: str, make, model, data, entropy: bool, args, memory: bool) -> dict:
    row = {"model": name, "part": part, "entropy": entropy}
    for path, fused in (("full", False), ("fused", True)):
        fn = make(model, *data, fused=fused, entropy=entropy)
        if memory:
            row[f"{path}_peak_mb"] = peak_bytes(fn) / 2**20
        row[f"{path}_ms"] = 1e3 * seconds(fn, args.repeats)
    if memory:
        row["peak_ratio"] = row["fused_peak_mb"] / row["full_peak_mb"]
    row["time_ratio"] = row["fused_ms"] / row["full_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--max-ratio", type=float, default=0.25, help="largest allowed fused/full peak (log-prob part)"
    )
    parser.add_argument("--work", default=None, help="measured cells (default out/bench/logprob_memory)")
    parser.add_argument("--out", default="benchmarks/results/logprob_memory.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cells, spec = measurement_cells("logprob_memory", args.work), {"config": vars(args), "code": code_stamp()}
    large = tiny_llama(args.vocab, hidden=256, layers=4, intermediate=640)
    results = measure(
        f"vocab {args.vocab}",
        large,
        batch(args.vocab, args.rows, args.length),
        args,
        memory=True,
        cells=cells,
        spec=spec,
    )
    small = tiny_llama(512, hidden=128, layers=4, intermediate=512)
    results += measure(
        "quickstart (vocab 512)", small, batch(512, 64, 48), args, memory=False, cells=cells, spec=spec
    )

    print(
        f"\nbatch: {args.rows} x {args.length} tokens (second half scored) for the {args.vocab}-vocabulary model, "
        f"64 x 48 for the quickstart-sized one; {args.threads} threads; median of {args.repeats}"
    )
    print(
        f"{'model':<24} {'part':<14} {'entropy':<7} {'full MB':>8} {'fused MB':>9} {'ratio':>6} "
        f"{'full ms':>8} {'fused ms':>9} {'time x':>7}"
    )
    for r in results:
        mem = (
            f"{r['full_peak_mb']:>8.1f} {r['fused_peak_mb']:>9.1f} {r['peak_ratio']:>6.3f}"
            if "peak_ratio" in r
            else f"{'':>8} {'':>9} {'':>6}"
        )
        print(
            f"{r['model']:<24} {r['part']:<14} {r['entropy']!s:<7} {mem} {r['full_ms']:>8.1f} "
            f"{r['fused_ms']:>9.1f} {r['time_ratio']:>7.2f}"
        )
    failures = [
        f"{r['part']} (entropy {r['entropy']}): fused peak is {r['peak_ratio']:.3f} of the full logits' "
        f"(limit {args.max_ratio})"
        for r in results
        if r["part"] == "log-prob part" and "peak_ratio" in r and r["peak_ratio"] > args.max_ratio
    ]
    out = Path(args.out)
    payload = {
        "benchmark": "logprob_memory",
        "config": vars(args),
        "machine": {"load_average_at_end": os.getloadavg()},
        "results": results,
        "failures": failures,
    }
    write_results(out.stem, payload, results_dir=out.parent)
    print(f"wrote {out}")
    if failures:
        raise SystemExit("; ".join(failures))


if __name__ == "__main__":
    main()
