"""Every stage for a few steps under one strategy, run by tests/distributed/test_strategies.py and
tests/distributed/test_multinode.py: as a script with 2 processes (Lightning's launcher starts the second process by
running this file again, or ``torchrun`` starts both), and in-process with one device.

``python tests/distributed/multiproc_fit.py WORK STRATEGY OUT STAGE [STAGE ...]`` with ``STRATEGY`` one of
``single`` (1 process), ``ddp`` (2-process DDP), ``tp`` (``ModelParallelStrategy``, 2-way tensor
parallel), ``fsdp`` (``ModelParallelStrategy``, FSDP2 over 2 data-parallel ranks), or ``cuda``
(``ModelParallelStrategy`` over the GPUs, at most 2, FSDP2 when there are 2, ``bf16-mixed``; run by
tests/distributed/test_gpu.py). ``WORK`` holds what :func:`write_inputs` writes. Every stage trains on the same
*global* batch whatever the strategy (``GLOBAL_BATCH`` split over the data-parallel ranks) and writes,
from rank 0, the full weights of the models it trains to ``OUT/<stage>/weights.pt`` and, from every
rank, ``OUT/<stage>/rank-<r>.json`` (PPO: the KL coefficient and the running reward moments that rank
holds; REINFORCE++ with an adaptive KL: the KL coefficient; the offline stages: the training losses).
Under ``cuda`` each stage also exports its result to ``OUT/<stage>/export``.

``grpo_served`` samples on served vLLM engines (``ALIGNLIT_TEST_ENDPOINTS``, comma-separated ``http://host:port``;
run by tests/rollout/test_served.py) and records every rollout's samples. ``ALIGNLIT_TEST_CKPT=DIR`` saves a
checkpoint after every step, ``ALIGNLIT_TEST_RESUME=CKPT`` resumes from one, and ``ALIGNLIT_TEST_KILL=PGID:STEP``
has rank 0 kill that process group (an engine) when step ``STEP`` starts. ``ALIGNLIT_TEST_STALENESS=K`` sets its
``rollout.max_staleness`` and ``ALIGNLIT_TEST_EPOCHS=E`` runs the online stages for ``E`` epochs of ``ROLLOUTS`` steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

STAGES = (
    "reward", "pairpref", "dpo", "rrhf", "ppo", "ppo_sharded", "grpo", "reinforce_pp_kl", "dpo_lora", "ppo_lora",
)  # fmt: skip
ONLINE = ("ppo", "grpo", "reinforce_pp_kl", "ppo_vllm", "grpo_served")
"""Stages whose run length is counted in rollouts (``ROLLOUTS``) rather than optimizer steps."""
GLOBAL_BATCH = 4
STEPS = 3
ROLLOUTS = 2
OPS = ("sort", "reverse", "copy", "dedupe")


def _prompt(i: int) -> str:
    return f"\n\nHuman: {OPS[i % 4]} {' '.join('abcdefgh'[(i * 3 + j) % 8] for j in range(2 + i % 3))}\n\nAssistant:"


def write_inputs(work: Path, tokenizer, make_policy) -> None:
    """The data every stage reads, a tiny policy, a second one as a reference and a reward model with a
    random head on the policy's backbone (``make_policy(seed)`` returns a model), under ``work``."""
    from alignlit.models import export_pretrained, load_scalar_model

    work.mkdir(parents=True, exist_ok=True)
    export_pretrained(make_policy(0), tokenizer, work / "policy", stage="init")
    export_pretrained(make_policy(1), tokenizer, work / "reference", stage="init")
    torch.manual_seed(2)
    reward_model, _ = load_scalar_model(work / "policy", head="fresh")
    export_pretrained(reward_model, tokenizer, work / "rm", stage="reward")
    with open(work / "pairs.jsonl", "w") as f:
        for i in range(GLOBAL_BATCH * STEPS):
            words = _prompt(i).split("Human: ")[1].split("\n")[0].split()[1:]
            chosen, rejected = " " + " ".join(sorted(words)), " " + " ".join(words) + " ok done"
            f.write(json.dumps({"prompt": _prompt(i), "chosen": chosen, "rejected": rejected}) + "\n")
    with open(work / "ranked.jsonl", "w") as f:
        for i in range(GLOBAL_BATCH * STEPS):
            responses = [" a b", " a", " b c d e", " c"]
            f.write(
                json.dumps({"prompt": _prompt(i), "responses": responses, "scores": [1.0, 0.5, -1.0, 0.0]})
                + "\n"
            )
    with open(work / "sft.jsonl", "w") as f:
        for i in range(GLOBAL_BATCH * STEPS):
            words = _prompt(i).split("Human: ")[1].split("\n")[0].split()[1:]
            f.write(json.dumps({"prompt": _prompt(i), "response": " " + " ".join(sorted(words))}) + "\n")
    with open(work / "prompts.jsonl", "w") as f:
        for i in range(GLOBAL_BATCH * ROLLOUTS):
            f.write(json.dumps({"prompt": _prompt(i)}) + "\n")


def length_reward(prompts, responses):
    """A deterministic reward with spread: characters 'a' minus a tenth of the length."""
    return [r.count("a") - 0.1 * len(r) for r in responses]


def _strategy(name: str, stage: str) -> tuple[dict, int]:
    """The Trainer arguments of strategy ``name`` for ``stage`` and its number of data-parallel ranks."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    cpu = {"accelerator": "cpu"}
    if name == "single":
        return {**cpu, "strategy": "auto", "devices": 1}, 1
    if name == "ddp":  # PPO's critic and actor updates each leave the other model's parameters unused
        strategy = "ddp_find_unused_parameters_true" if stage.startswith("ppo") else "ddp"
        return {**cpu, "strategy": strategy, "devices": 2}, 2
    if name == "tp":
        return {
            **cpu,
            "strategy": ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
            "devices": 2,
        }, 1
    if name == "fsdp":
        return {
            **cpu,
            "strategy": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            "devices": 2,
        }, 2
    if name == "cuda":  # one GPU: a 1 x 1 mesh, nothing to shard; two: FSDP2 over 2 data-parallel ranks
        gpus = min(2, torch.cuda.device_count())
        strategy = ModelParallelStrategy(data_parallel_size=gpus, tensor_parallel_size=1)
        return {"accelerator": "gpu", "devices": gpus, "precision": "bf16-mixed", "strategy": strategy}, gpus
    raise ValueError(f"unknown strategy {name!r}")


def _module_and_data(stage: str, work: Path, per_rank: int):
    from alignlit.data import PreferenceDataModule, PromptDataModule, RankingDataModule
    from alignlit.models.lora import LoRA
    from alignlit.modules import (
        DPOModule,
        KLPenalty,
        Minibatches,
        Optim,
        PairwisePrefModule,
        PolicyGradientModule,
        PPOModule,
        RewardModule,
        RRHFModule,
    )
    from alignlit.rollout import RolloutLoop, SamplingParams

    policy = str(work / "policy")
    optim = Optim(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0)
    pairs = dict(val_fraction=0.0, max_length=32, max_prompt_length=16, batch_size=per_rank, seed=0)
    if stage == "sft":
        from alignlit.data import SFTDataModule
        from alignlit.modules import SFTModule

        data = SFTDataModule(str(work / "sft.jsonl"), val_fraction=0.0, max_length=32, max_prompt_length=16,
                             batch_size=per_rank, seed=0)  # fmt: skip
        return SFTModule(policy, optim=optim), data
    if stage == "reward":
        return RewardModule(policy, optim=optim, histogram=False), PreferenceDataModule(
            str(work / "pairs.jsonl"), **pairs
        )
    if stage == "pairpref":
        from alignlit.models import ABFormat

        module = PairwisePrefModule(policy, ab_format=ABFormat(max_length=96), optim=optim)
        return module, PreferenceDataModule(str(work / "pairs.jsonl"), **pairs)
    if stage == "dpo":
        module = DPOModule(
            policy, beta=0.5, sft_weight=0.5, optim=optim, reference_cache_dir=str(work / "cache")
        )
        return module, PreferenceDataModule(str(work / "pairs.jsonl"), **pairs)
    if stage == "dpo_lora":  # the reference is the base with the adapter disabled, every step
        module = DPOModule(policy, beta=0.5, optim=optim, lora=LoRA(rank=4), precompute_reference=False)
        return module, PreferenceDataModule(str(work / "pairs.jsonl"), **pairs)
    if stage == "rrhf":
        data = RankingDataModule(str(work / "ranked.jsonl"), val_fraction=0.0, max_length=32, max_prompt_length=16,
                                 batch_size=per_rank, seed=0)  # fmt: skip
        return RRHFModule(policy, optim=optim), data
    prompts = PromptDataModule(train_file=str(work / "prompts.jsonl"), val_fraction=0.0, batch_size=per_rank)
    # greedy: each sample depends on its prompt only, not on the other prompts of the (local) batch
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    if stage in ("ppo", "ppo_sharded"):
        sharded = stage == "ppo_sharded"  # frozen reference and reward model sharded like the trained models
        module = PPOModule(
            policy, reward=str(work / "rm") if sharded else length_reward, optim=optim, critic_optim=optim,
            kl=KLPenalty(coef=0.2, target=0.01, horizon=4), reference=str(work / "reference"),
            rollout=RolloutLoop(sampling=greedy), minibatches=Minibatches(size=64, epochs=2), shard_frozen=sharded,
        )  # fmt: skip
        return module, prompts
    if stage == "ppo_vllm":  # one vLLM engine on rank 0 serves every rank; parity checked on every share
        module = PPOModule(
            policy, reward=length_reward, optim=optim, critic_optim=optim,
            kl=KLPenalty(coef=0.2, target=0.01, horizon=4), reference=str(work / "reference"),
            rollout=RolloutLoop(
                engine="vllm", sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
                parity_every=1, parity_tol=1e-3, vllm_args={"max_model_len": 128},
            ),
            minibatches=Minibatches(size=64, epochs=2),
        )  # fmt: skip
        return module, prompts
    if stage == "ppo_lora":  # adapters on the policy and the critic; the reference is the policy's base
        module = PPOModule(
            policy, reward=length_reward, optim=optim, critic_optim=optim, lora=LoRA(rank=4),
            rollout=RolloutLoop(sampling=greedy), minibatches=Minibatches(size=64, epochs=2),
        )  # fmt: skip
        return module, prompts
    if stage == "grpo":
        module = PolicyGradientModule(
            policy, reward=length_reward, advantage="grpo", optim=optim, kl_loss_coef=0.5,
            reference=str(work / "reference"),
            rollout=RolloutLoop(sampling=greedy, samples_per_prompt=2), minibatches=Minibatches(size=64),
        )  # fmt: skip
        return module, prompts
    if stage == "grpo_served":  # every rank's prompts spread over the served engines; parity every sync
        module = PolicyGradientModule(
            policy, reward=length_reward, advantage="grpo", optim=optim, kl_loss_coef=0.5,
            reference=str(work / "reference"),
            rollout=RolloutLoop(
                engine="vllm_server", endpoints=os.environ["ALIGNLIT_TEST_ENDPOINTS"].split(","),
                sampling=SamplingParams(temperature=1.0, max_new_tokens=4), samples_per_prompt=2,
                parity_every=1, parity_tol=1e-3, vllm_args={"timeout_s": 120.0},
                max_staleness=int(os.environ.get("ALIGNLIT_TEST_STALENESS", "0")),
            ),
            minibatches=Minibatches(size=64),
        )  # fmt: skip
        return module, prompts
    if stage == "reinforce_pp_kl":  # whitening over the global batch, KL coefficient over its responses
        module = PolicyGradientModule(
            policy, reward=length_reward, advantage="reinforce_pp", optim=optim, reference=str(work / "reference"),
            kl=KLPenalty(coef=0.2, target=0.01, horizon=4), aggregation="seq_mean_token_sum_norm",
            rollout=RolloutLoop(sampling=greedy, samples_per_prompt=1), minibatches=Minibatches(size=64, epochs=2),
        )  # fmt: skip
        return module, prompts
    raise ValueError(f"unknown stage {stage!r}")


class _KillAt(L.Callback):
    """Rank 0 kills a process group (an engine) when step ``step`` starts."""

    def __init__(self, pgid: int, step: int) -> None:
        self.pgid, self.step = pgid, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import signal

        if trainer.global_rank == 0 and batch_idx == self.step:
            os.killpg(self.pgid, signal.SIGKILL)


def _record_samples(module) -> list[dict]:
    """Every training rollout's prompts, texts, log-probs and versions, as this rank collected them."""
    samples: list[dict] = []
    collect = module.rollout.collect

    def recording(prompts, reward, **kwargs):
        experience = collect(prompts, reward, **kwargs)
        r = experience.rollout
        samples.append({"prompts": list(r.prompts), "texts": list(r.texts), "versions": experience.versions.tolist(),
                        "logprobs": [row[m].tolist() for row, m in zip(r.logprobs, r.response_mask)]})  # fmt: skip
        return experience

    module.rollout.collect = recording
    return samples


class _Losses(L.Callback):
    """The training loss of every step (offline stages)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:  # an online stage's step (a rollout) returns nothing
            self.losses.append(float(loss))


def _trained(module) -> dict[str, torch.nn.Module]:
    if hasattr(module, "trained_models"):
        return {t.name: t.module for t in module.trained_models()}
    return {"model": module.export_model()}


def fit(work: str, strategy_name: str, out: str, stages: list[str]) -> None:
    from alignlit.models.state_dict import full_state_dict

    work, out = Path(work), Path(out)
    for stage in stages:
        hardware, data_parallel = _strategy(strategy_name, stage)
        L.seed_everything(0)
        module, data = _module_and_data(stage, work, GLOBAL_BATCH // data_parallel)
        if strategy_name == "cuda":
            module.export_dir = str(out / stage / "export")
        (out / stage).mkdir(parents=True, exist_ok=True)
        if strategy_name == "single":  # the starting weights, to tell how far training moved them
            torch.save({f"{name}.{k}": v.clone() for name, model in _trained(module).items()
                        for k, v in getattr(model, "hf_model", model).state_dict().items()}, out / stage / "init.pt")  # fmt: skip
        online = stage in ONLINE
        losses = _Losses()
        callbacks: list = [] if online else [losses]
        ckpt_dir, resume, kill = (
            os.environ.get(k) for k in ("ALIGNLIT_TEST_CKPT", "ALIGNLIT_TEST_RESUME", "ALIGNLIT_TEST_KILL")
        )
        if ckpt_dir:
            from lightning.pytorch.callbacks import ModelCheckpoint

            callbacks.append(
                ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last=True, save_top_k=-1)
            )
        if kill:
            callbacks.append(_KillAt(*map(int, kill.split(":"))))
        samples = _record_samples(module) if stage == "grpo_served" else []
        epochs = int(os.environ.get("ALIGNLIT_TEST_EPOCHS", "1"))  # online stages: ROLLOUTS steps an epoch
        trainer = L.Trainer(
            **hardware, logger=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
            use_distributed_sampler=False, default_root_dir=str(out / stage),
            **({"max_epochs": epochs, "limit_train_batches": ROLLOUTS} if online else {"max_steps": STEPS}),
        )  # fmt: skip
        trainer.fit(module, data, ckpt_path=resume or None)
        weights = {
            f"{name}.{key}": value
            for name, model in _trained(module).items()
            for key, value in full_state_dict(getattr(model, "hf_model", model)).items()
        }  # a collective when sharded
        if trainer.global_rank == 0:
            torch.save(weights, out / stage / "weights.pt")
        state: dict = {} if online else {"losses": losses.losses}
        if stage == "reinforce_pp_kl":
            state = {"kl_coef": module.kl_ctl.value}
        if stage in ("ppo", "ppo_vllm"):
            state = {"kl_coef": module.kl_ctl.value, "moments": module.reward_moments.state_dict()}
            state["weight_pushes"] = getattr(module.rollout.engine, "weight_pushes", None)
            state["engine_here"] = getattr(module.rollout.engine, "llm", None) is not None
            state["history"] = [{k: v for k, v in h.items() if not k.startswith(("time/", "rollout/"))}
                                for h in module.progress.history]  # fmt: skip
        if stage == "grpo_served":
            engine = module.rollout.engine
            state = {"samples": samples, "weight_pushes": engine.weight_pushes, "version": engine.version,
                     "label": engine.label, "requests": engine.requests_per_engine,
                     "parity": [h["rollout/parity_max_abs_diff"] for h in module.progress.history
                                if "rollout/parity_max_abs_diff" in h]}  # fmt: skip
        if stage == "ppo_sharded":
            state = {"sharded": [any(type(p).__name__ == "DTensor" for p in m.parameters())
                                 for m in (module.reference, module.reward_model)]}  # fmt: skip
        (out / stage / f"rank-{trainer.global_rank}.json").write_text(json.dumps(state))
        trainer.strategy.barrier("multiproc-fit")


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a rank waits
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    fit(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
