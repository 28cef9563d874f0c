"""The workers of ``bench_vs_trl.py`` (and ``bench_memory.py``): alignlit and TRL on the same step.

The offline workloads (SFT, reward, DPO) are timed by :func:`alignlit_worker` / :func:`trl_worker`; the online
ones, GRPO (and RLOO) steps, alignlit vs TRL, part by part:

Both sides train the same random Llama (:data:`MODEL`) on the same prompts of the simulated
task, in the same order, scored by the same Python function (:func:`reward_fn`, the task's gold reward,
which both sides call on the decoded completions), with the same group size, sampling (temperature 1,
no top-k/top-p, ``--max-new-tokens``), one rollout of ``--rollout-prompts`` prompts x ``--group``
samples per generation, minibatches of ``--minibatch`` samples (one optimizer step each, one pass),
the old log-probs recomputed by the trainer, fused AdamW (constant lr, no weight decay), gradient
clipping at 1.0, float32, and Hugging Face ``generate`` on both sides:

- ``grpo``: TRL's ``GRPOTrainer`` with ``loss_type="grpo"`` (sequence mean of token means), ``beta``
  (the k3 KL to the reference in the loss; ``use_bias_correction_kl=False``, so the KL term is the
  plain k3 on both sides), ``scale_rewards="group"`` (advantages ``(r - mean) / (std + 1e-4)`` with
  the sample standard deviation); alignlit's ``PolicyGradientModule`` with ``aggregation=
  "seq_mean_token_mean"``, ``kl_loss_coef=beta``, ``kl_loss_estimator="k3"`` and the advantage
  estimator :func:`trl_grpo_advantages` (alignlit's own ``"grpo"`` divides by the population standard
  deviation plus 1e-6; the benchmark registers TRL's definition so the two objectives are the same).
- ``rloo``: TRL's ``RLOOTrainer`` (leave-one-out baseline, ``beta`` times the summed k1 KL subtracted
  from the reward, one importance ratio per sequence ``exp(Σ_t log π/π_old)`` clipped PPO-style,
  mean over sequences); alignlit's ``PolicyGradientModule`` with ``advantage="rloo"``,
  ``kl=KLPenalty(coef=beta, estimator="k1")`` and the registered policy loss :func:`sequence_ratio_loss`.

Per rollout, each side's wall time is split into ``generate`` (sampling, ``generate`` and the engine's
work around it), ``score`` (the reward function), ``logprobs`` (the no-grad forwards: old and
reference log-probs), ``update`` (the minibatch losses' forward and backward and the optimizer steps)
and ``other`` (the rest: tokenisation, padding, advantages, metrics, the trainer's loop). Rollouts
are timed from the end of one to the end of the next; the first ``--online-warmup`` are left out.

The losses are checked separately (``check`` mode, not timed): both sides get the same completions
(generated once by the driver) for the same prompts, compute their own old and reference log-probs,
rewards and advantages, and train on the first two minibatches in the same order (shuffling off): the
first minibatch's loss and gradient norm, and the second's loss (after one AdamW step, where the
ratio and the KL are no longer trivial) must agree to ``--loss-tol``.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path

from harness import allocation_peak

ONLINE_WORKLOADS = ("grpo", "rloo")
PARTS = ("generate", "score", "logprobs", "update", "other")
TRL_BETA = {"grpo": 0.04, "rloo": 0.05}  # TRL's defaults: GRPOConfig's beta is 0.0 now; 0.04 was its default

_TASK = None
TASK_START = "\n\nHuman:"
CONTEXT = "abcdefghijkl"


def with_context(prompt: str, words: int, index: int) -> str:
    """``prompt`` after ``words`` symbols of context (``--prompt-words``: long prompts)."""
    if not words:
        return prompt
    return " ".join(CONTEXT[(index + 3 * j) % len(CONTEXT)] for j in range(words)) + prompt


class MemoryWindow:
    """Peak memory of one window (a training step): the bytes of every CPU tensor alive at its start
    ("resident": parameters of every model, gradients, optimizer states, caches; found by the garbage
    collector, so no model is missed) plus the most bytes allocated at once above that level during
    the window (torch.profiler allocation events of the CPU allocator, so neither the allocator's
    caching nor the process's RSS enters: "transient"), and the window's wall time."""

    def __init__(self):
        self.profiler = None
        self.result: dict | None = None

    def start(self) -> None:
        import gc

        from torch.profiler import ProfilerActivity, profile

        gc.collect()
        self.resident = live_tensor_bytes()
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.start()
        self.started = time.perf_counter()

    def stop(self) -> None:
        wall = time.perf_counter() - self.started
        self.profiler.stop()
        peak = allocation_peak(self.profiler)
        self.result = {
            "resident_mb": self.resident / 2**20,
            "transient_peak_mb": peak / 2**20,
            "peak_mb": (self.resident + peak) / 2**20,
            "step_s": wall,
        }
        self.profiler = None


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every CPU tensor the garbage collector knows of."""
    import gc

    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, sparse)
                continue
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def reward_fn(prompts: list[str], completions: list[str]) -> list[float]:
    """The reward both sides call: the simulated task's gold reward of each completion."""
    global _TASK
    if _TASK is None:
        from alignlit.sim.data import load_sim

        _TASK, _ = load_sim(os.environ["BENCH_SIM_DIR"])
    task_prompts = [
        p[p.index(TASK_START) :] if TASK_START in p else p for p in prompts
    ]  # without --prompt-words
    return [float(r) for r in _TASK.gold_rewards(task_prompts, list(completions))]


def trl_grpo_advantages(rewards, *, eps: float):
    """TRL's GRPO advantages: ``(r - mean) / (std + eps)`` over each group, ``std`` the sample
    (Bessel-corrected) standard deviation."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return centred / (std + eps)


def sequence_ratio_loss(logprobs, old_logprobs, advantages, mask, *, clip_low: float, clip_high: float):
    """TRL RLOO's policy term: one ratio per sequence, ``ρ = exp(Σ_t (log π - log π_old))``, and
    ``-min(ρ·A, clip(ρ, 1-ε_low, 1+ε_high)·A)`` on every token of the sequence (so the sequence mean of
    token means is the mean over sequences of the sequence loss)."""
    import torch

    ratio = torch.exp(((logprobs - old_logprobs) * mask).sum(-1, keepdim=True))  # (N, 1)
    adv = advantages[:, :1] if advantages.dim() == 2 else advantages[:, None]  # (N, 1)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_sequence = -torch.minimum(ratio * adv, clipped * adv)  # (N, 1)
    token = per_sequence.expand_as(logprobs) * mask
    high = ((ratio > 1 + clip_high) & (adv > 0)).float().mean()
    low = ((ratio < 1 - clip_low) & (adv < 0)).float().mean()
    return token, {"clip_frac_high": high, "clip_frac_low": low}


# ------------------------------------------------------------------------------ shared assets


def build_online_assets(root: Path, args) -> dict:
    """Prompts for every rollout, and the check batch: completions sampled once for the first
    rollout's prompts, which both sides train on in ``check`` mode."""
    import torch

    from alignlit.models.loading import load_policy
    from alignlit.rollout import HFEngine, SamplingParams

    sim = root / "sim"
    prompts = [json.loads(line)["prompt"] for line in (sim / "prompts_train.jsonl").read_text().splitlines()]
    needed = args.rollout_prompts * (args.online_warmup + args.rollouts)
    if len(prompts) < needed:
        raise SystemExit(f"the simulated data has {len(prompts)} training prompts, {needed} needed")
    prompts = [with_context(p, args.prompt_words, i) for i, p in enumerate(prompts[:needed])]
    (root / "prompts.json").write_text(json.dumps(prompts))
    model, tokenizer = load_policy(str(root / "policy"))
    engine = HFEngine(tokenizer, model.eval())
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=123)
    with torch.no_grad():
        rollout = engine.generate(prompts[: args.rollout_prompts], args.group, sampling)
    completions = [
        row[mask].tolist() for row, mask in zip(rollout.response_ids, rollout.response_mask.bool())
    ]
    (root / "check_batch.json").write_text(json.dumps({"completion_ids": completions}))
    prompt_tokens = [len(tokenizer(p)["input_ids"]) for p in prompts]
    return {
        "prompts": len(prompts),
        "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "check_tokens": sum(map(len, completions)),
    }


# ------------------------------------------------------------------------------------ alignlit


def _register_alignlit_extensions() -> None:
    from alignlit.losses.policy_losses import POLICY_LOSSES, register_policy_loss
    from alignlit.ops.advantages import ADVANTAGE_ESTIMATORS, register_advantage

    if "bench_trl_grpo" not in ADVANTAGE_ESTIMATORS:
        register_advantage("bench_trl_grpo")(trl_grpo_advantages)
    if "bench_sequence_ratio" not in POLICY_LOSSES:
        register_policy_loss("bench_sequence_ratio")(sequence_ratio_loss)


def alignlit_online_worker(workload: str, root: Path, args, mode: str = "timed") -> dict:
    """``mode``: ``"timed"`` (sampled rollouts, timed), ``"check"`` (one rollout on the driver's completions,
    the losses and gradient norms of its minibatches) or ``"memory"`` (two rollouts on the driver's
    completions, the second one's peak memory)."""
    import lightning as L
    import torch

    from alignlit.models.forward_settings import use_forward_settings
    from alignlit.modules import KLPenalty, Minibatches, Optim, PolicyGradientModule
    from alignlit.rollout import HFEngine, HFEngineOptions, RolloutLoop, SamplingParams
    from alignlit.rollout.postprocess import RawSample

    _register_alignlit_extensions()
    prompts = json.loads((root / "prompts.json").read_text())
    optim = Optim(lr=args.online_lr, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens)
    hf = HFEngineOptions()
    if getattr(args, "hf_generate", "dynamic") == "static-shared":
        hf = HFEngineOptions(kv_cache="static", share_prompt=True)
    rollout = RolloutLoop(engine="hf", sampling=sampling, samples_per_prompt=args.group, seed=0, hf=hf)
    beta = TRL_BETA[workload]
    if workload == "grpo":
        algorithm = dict(
            advantage="bench_trl_grpo", eps=1e-4, aggregation="seq_mean_token_mean", kl_loss_coef=beta,
            kl_loss_estimator="k3",
        )  # fmt: skip
    else:
        algorithm = dict(
            advantage="rloo", aggregation="seq_mean_token_mean", policy_loss="bench_sequence_ratio",
            kl=KLPenalty(coef=beta, estimator="k1"),
        )  # fmt: skip
    fixed = mode != "timed"
    module = PolicyGradientModule(
        policy=str(root / "policy"), reward=reward_fn, rollout=rollout, optim=optim, max_grad_norm=1.0,
        minibatches=Minibatches(
            size=args.minibatch, shuffle=not fixed, token_budget=getattr(args, "token_budget", None)
        ), clip_low=0.2, clip_high=0.2,
        gradient_checkpointing=getattr(args, "gradient_checkpointing", False), **algorithm,
    )  # fmt: skip

    losses: list[float] = []
    norms: list[float] = []
    policy_loss, step = module.policy_loss, module.updates.step

    def recorded_loss(mb, **kwargs):
        loss, metrics = policy_loss(mb, **kwargs)
        losses.append(float(loss.detach()))
        return loss, metrics

    def recorded_step(name, loss):
        norm = step(name, loss)
        norms.append(float(norm))
        return norm

    module.policy_loss, module.updates.step = recorded_loss, recorded_step
    if fixed:  # the driver's completions instead of sampling
        batch = json.loads((root / "check_batch.json").read_text())["completion_ids"]

        def fixed_chunk(self, prompt_ids, prompt_mask, n, sampling, eos_ids, device):
            return [
                RawSample(ids, [0.0] * len(ids), ended_early=bool(ids) and ids[-1] in eos_ids)
                for ids in batch
            ]

        HFEngine._generate_chunk = fixed_chunk

    ends: list[float] = []
    window = MemoryWindow()

    class Clock(L.Callback):
        def on_train_start(self, trainer, pl_module):
            ends.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())
            if mode == "memory" and batch_idx == 0:
                window.start()
            elif mode == "memory" and batch_idx == 1:
                window.stop()

    rollouts = {"timed": args.online_warmup + args.rollouts, "check": 1, "memory": 2}[mode]
    loader = torch.utils.data.DataLoader(
        prompts[: rollouts * args.rollout_prompts], batch_size=args.rollout_prompts, collate_fn=list
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, default_root_dir=str(root / f"pl-{os.getpid()}"), max_epochs=1,
        limit_train_batches=rollouts, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
    )  # fmt: skip
    with use_forward_settings(fused_head=not getattr(args, "no_fused_head", False)):
        trainer.fit(module, train_dataloaders=loader)
    if mode == "check":
        return {"losses": losses, "grad_norms": norms}
    if mode == "memory":
        return {**window.result, "losses": losses, "peak_rss_mb": _peak_rss_mb()}
    parts = []
    for k, h in enumerate(module.progress.history):
        p = {
            "generate": h["rollout/generate_s"],
            "score": h["rollout/score_s"],
            "logprobs": h.get("time/old_logp_s", 0.0) + h.get("time/ref_logp_s", 0.0),
        }
        p["update"] = h["time/train_s"] - p["logprobs"]
        p["other"] = (ends[k + 1] - ends[k]) - sum(p.values())
        parts.append(p)
    return _timing(ends, parts, args)


def _timing(ends: list[float], parts: list[dict], args) -> dict:
    warm = args.online_warmup
    samples = args.rollout_prompts * args.group * args.rollouts
    seconds = ends[warm + args.rollouts] - ends[warm]
    timed = parts[warm : warm + args.rollouts]
    return {
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "parts_s": {p: statistics.fmean(r[p] for r in timed) for p in PARTS},
        "per_rollout": timed,
        "peak_rss_mb": _peak_rss_mb(),
    }


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------------ TRL


def trl_online_worker(workload: str, root: Path, args, mode: str = "timed") -> dict:
    """See :func:`alignlit_online_worker`."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from alignlit.data.tokenizer import load_tokenizer

    prompts = json.loads((root / "prompts.json").read_text())
    rollouts = {"timed": args.online_warmup + args.rollouts, "check": 1, "memory": 2}[mode]
    per_rollout = args.rollout_prompts * args.group
    if per_rollout % args.minibatch:
        raise SystemExit(f"--minibatch {args.minibatch} must divide a rollout's {per_rollout} samples")
    steps_per_generation = per_rollout // args.minibatch
    tokenizer = load_tokenizer(root / "policy")
    common = dict(
        output_dir=str(root / f"trl-{os.getpid()}"),
        per_device_train_batch_size=args.minibatch,
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_generation,
        num_generations=args.group,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,
        beta=TRL_BETA[workload],
        epsilon=0.2,
        max_steps=(2 if mode == "check" else rollouts * steps_per_generation),
        gradient_checkpointing=getattr(args, "gradient_checkpointing", False),
        learning_rate=args.online_lr, adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        optim="adamw_torch_fused",
        bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=False, seed=0, logging_steps=10**6,
    )  # fmt: skip
    if workload == "grpo":
        config = trl.GRPOConfig(
            loss_type="grpo", scale_rewards="group", use_bias_correction_kl=False, **common
        )
        cls = trl.GRPOTrainer
    else:
        config = trl.RLOOConfig(**common)
        cls = trl.RLOOTrainer

    def trl_reward(prompts, completions, **kwargs):
        return reward_fn(prompts, completions)

    trl_reward.__name__ = "gold"
    ends: list[float] = []
    window = MemoryWindow()

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            if state.global_step % steps_per_generation == 0:
                ends.append(time.perf_counter())
            if mode == "memory" and state.global_step == 1:
                window.start()
            elif mode == "memory" and state.global_step == 2:
                window.stop()

    trainer = cls(
        model=str(root / "policy"), reward_funcs=[trl_reward], args=config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts[: rollouts * args.rollout_prompts]]),
        processing_class=tokenizer, callbacks=[Clock()],
    )  # fmt: skip
    clock = {k: 0.0 for k in ("generate", "score", "logprobs", "experience")}
    current: list[dict] = []

    def timed(name, fn, when=None):
        def wrapper(*a, **kw):
            if when is not None and not when():
                return fn(*a, **kw)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[name] += time.perf_counter() - start

        return wrapper

    if mode != "timed":
        batch = json.loads((root / "check_batch.json").read_text())["completion_ids"]
        fixed = [list(ids) for ids in batch]  # GRPOTrainer's returns (ids, logprobs), RLOOTrainer's the ids
        trainer._generate_single_turn = (
            (lambda *a, **kw: (fixed, None)) if workload == "grpo" else (lambda *a, **kw: fixed)
        )
        module = __import__(type(trainer).__module__, fromlist=["shuffle_sequence_dict"])
        module.shuffle_sequence_dict = lambda d: d  # minibatches in sample order, as alignlit's check
    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("score", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "logprobs", trainer._get_per_token_logps_and_entropies, when=lambda: not torch.is_grad_enabled()
    )
    trainer._generate_and_score_completions = timed("experience", trainer._generate_and_score_completions)

    losses: list[float] = []
    norms: list[float] = []
    compute_loss = trainer.compute_loss

    def recorded_loss(*a, **kw):
        loss = compute_loss(*a, **kw)
        losses.append(float(loss.detach()))
        return loss

    trainer.compute_loss = recorded_loss
    clip = trainer.accelerator.clip_grad_norm_

    def recorded_clip(*a, **kw):
        norm = clip(*a, **kw)
        norms.append(float(norm))
        return norm

    trainer.accelerator.clip_grad_norm_ = recorded_clip

    class Parts(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step % steps_per_generation == 0:
                current.append(dict(clock))
                for k in clock:
                    clock[k] = 0.0

    trainer.add_callback(Parts())
    trainer.train()
    if mode == "check":
        return {"losses": losses, "grad_norms": norms}
    if mode == "memory":
        return {**window.result, "losses": losses, "peak_rss_mb": _peak_rss_mb()}
    parts = []
    for k, c in enumerate(current):
        wall = ends[k + 1] - ends[k]
        p = {"generate": c["generate"], "score": c["score"], "logprobs": c["logprobs"]}
        p["update"] = wall - c["experience"]  # the steps' loss forward, backward and optimizer, and the loop
        p["other"] = c["experience"] - sum(p[k] for k in ("generate", "score", "logprobs"))
        parts.append(p)
    return _timing(ends, parts, args)


# ------------------------------------------------------------------------------------- summary


def summarise_online(workload: str, runs: dict[str, list[dict]], checks: dict[str, dict], args) -> dict:
    out = {"workload": workload}
    for side, side_runs in runs.items():
        seconds = statistics.median(r["seconds"] for r in side_runs)
        best = min(side_runs, key=lambda r: abs(r["seconds"] - seconds))  # the median run's breakdown
        out[side] = {
            "runs": side_runs,
            "seconds": seconds,
            "samples_per_s": args.rollout_prompts * args.group * args.rollouts / seconds,
            "parts_s": best["parts_s"],
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in side_runs),
            "check": checks.get(side),
        }
    out["ratio"] = out["alignlit"]["samples_per_s"] / out["trl"]["samples_per_s"]
    a, t = checks.get("alignlit"), checks.get("trl")
    if a and t:
        out["check_diffs"] = {
            "first_loss": abs(a["losses"][0] - t["losses"][0]),
            "first_grad_norm": abs(a["grad_norms"][0] - t["grad_norms"][0]),
            "second_loss": abs(a["losses"][1] - t["losses"][1]),
        }
    return out


def print_online(results: list[dict], args) -> None:
    print(
        f"\nonline step: {args.rollout_prompts} prompts x {args.group} samples per rollout, up to "
        f"{args.max_new_tokens} new tokens, minibatch {args.minibatch}; {args.rollouts} timed rollouts after "
        f"{args.online_warmup}; seconds per rollout of the median run; alignlit's HF generate: "
        f"{getattr(args, 'hf_generate', 'dynamic')}"
    )
    print(
        f"{'workload':<8} {'side':<8} {'samples/s':>9} "
        + " ".join(f"{p:>14}" for p in PARTS)
        + f" {'total':>6} {'ratio':>6}"
    )
    for r in results:
        for side in ("alignlit", "trl"):
            s = r[side]
            total = sum(s["parts_s"].values())
            cells = " ".join(
                f"{s['parts_s'][p]:>7.3f} ({100 * s['parts_s'][p] / total:>3.0f}%)" for p in PARTS
            )
            tail = f" {r['ratio']:>6.2f}" if side == "alignlit" else ""
            print(f"{r['workload']:<8} {side:<8} {s['samples_per_s']:>9.1f} {cells} {total:>6.2f}{tail}")
    print("\nloss check (same completions, own old/ref log-probs, first two minibatches in order):")
    for r in results:
        a, t = r["alignlit"]["check"], r["trl"]["check"]
        if a and t:
            print(
                f"{r['workload']:<8} first loss {a['losses'][0]:.8f} vs {t['losses'][0]:.8f}, grad norm "
                f"{a['grad_norms'][0]:.7f} vs {t['grad_norms'][0]:.7f}, second loss {a['losses'][1]:.8f} vs "
                f"{t['losses'][1]:.8f}"
            )


# --- the offline workloads ---------------------------------------------------------------------------

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
