"""The rollout loop every online stage collects samples with: sync the engine's weights, generate, score.

It does nothing else: what to train on is the :class:`~alignlit.rollout.collector.Collector`'s decision,
what the stage derives from the samples (old and reference log-probs, KL) the trajectory maker's
(:mod:`alignlit.modules.trajectory_maker`). Switching engines is one config key, ``engine: hf | vllm |
vllm_server``::

    experience = loop.collect(prompts, reward, version=v)   # sync if the engine is not at v -> generate -> score

The policy's *version* is the number of optimiser steps it has taken; the engine is synced whenever
its weights are of another version than the one asked for, and every sample records the version
that generated it.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from alignlit.data.args import resolve_seed
from alignlit.models.state_dict import full_state_dict
from alignlit.rollout.base import Experience, Rollout, RolloutEngine, SamplingParams
from alignlit.rollout.environment import Environment
from alignlit.rollout.episodes import EpisodeReturn, run_episodes
from alignlit.rollout.hf_engine import HFEngine, HFEngineOptions
from alignlit.rollout.parity import check_parity
from alignlit.rollout.partial import check_partial
from alignlit.rollout.pipeline import RolloutPipeline, WeightSnapshot
from alignlit.rollout.reward_protocol import Reward, reward_counters, score_rollout


class RolloutLoop:
    """Sync, generate and score: the rollout side of every online stage.

    :meth:`collect` syncs the engine when its weights are not of the policy version asked for,
    samples ``samples_per_prompt`` responses per prompt, optionally checks the engine's log-probs
    against the policy's after a sync, and scores every response with the reward. Training rollout
    ``i`` is sampled with seed ``seed + i``; the counter is saved by :meth:`state_dict`, so a resumed
    run samples exactly what an uninterrupted one would.

    Args:
        engine: ``"hf"`` (Hugging Face ``generate`` on the training model, the default) or
            ``"vllm"`` (an in-process vLLM engine built from the policy's directory; with several
            training ranks one engine on rank 0 serves them all,
            :class:`~alignlit.rollout.served.RankZeroServedEngine`), or ``"vllm_server"`` (vLLM engines served
            at ``endpoints``, e.g. by ``alignlit serve``; every rank's prompts are spread over them and weights
            are pushed over a collective, :class:`~alignlit.rollout.server.ServedVLLMEngine`).
        sampling: how responses are sampled (``sampling.seed`` must be None: use ``seed``).
        samples_per_prompt: responses sampled per prompt (``n``).
        generation_batch_size: most prompts per HF ``generate`` call (None: all at once).
        parity_every: check the engine's log-probs against the policy's after every k-th sync
            (0: never); a difference above ``parity_tol`` raises
            :class:`~alignlit.rollout.parity.ParityError`.
        parity_tol: largest allowed absolute log-prob difference.
        parity_samples: samples recomputed by the parity check.
        vllm_args: extra keyword arguments of :class:`~alignlit.rollout.VLLMEngine` (e.g. ``sync_every``), or with
            ``vllm_server`` of :class:`~alignlit.rollout.server.ServedVLLMEngine` (e.g. ``weight_sync: file``).
        seed: training rollout ``i`` is sampled with seed ``seed + i`` (the stage's other seeded
            choices, e.g. minibatch shuffling, start from it too). None (the default): the run's
            ``seed_everything`` (:func:`alignlit.data.args.resolve_seed`), so runs with different seeds differ.
        max_staleness: ``k``: 0 (the default) generates each training rollout when the step needs it, with
            the policy's current weights; ``k >= 1`` generates the rollout of step ``j`` in the background
            while the trainer trains on earlier steps, from the weights of version ``j - k`` (at most ``k``
            versions older than the policy that trains on it; :mod:`alignlit.rollout.pipeline`). The HF
            engine then samples in a worker process with its own copy of the weights
            (:class:`~alignlit.rollout.hf_worker.HFWorkerEngine`); the vLLM engine loads each version's
            snapshot.
        worker_threads: torch threads of the HF worker process (``max_staleness >= 1``).
        environment: multi-turn episodes instead of single responses: every generation plays
            ``samples_per_prompt`` episodes per prompt with this environment, token in / token out
            (:func:`~alignlit.rollout.episodes.run_episodes`); the stage's reward must then be an
            :class:`~alignlit.rollout.episodes.EpisodeReturn`. None: one response per sample.
        max_turns: most model turns per episode (with ``environment``).
        max_episode_tokens: most response-side tokens, the model's and the environment's, per episode
            (with ``environment``; default ``max_turns * sampling.max_new_tokens``).
        endpoints: the served engines' ``http://host:port`` (``engine: vllm_server``).
        hf: how the HF engine runs ``generate`` (``engine: hf`` only; the trainer's engine, the asynchronous
            worker's and those sampling from a frozen model): :class:`~alignlit.rollout.HFEngineOptions`, e.g.
            ``{kv_cache: static, share_prompt: true}`` (None: the defaults, a dynamic cache).
        partial: ``L``: with ``max_staleness >= 1``, generate each rollout ahead in segments of ``L`` new tokens,
            each from the weights of one step later, up to its own step's; every token records its version
            (:mod:`alignlit.rollout.partial`; HF engine only). None (the default): one version per rollout.
    """

    def __init__(
        self,
        engine: Literal["hf", "vllm", "vllm_server"] = "hf",
        sampling: SamplingParams | None = None,
        samples_per_prompt: int = 1,
        generation_batch_size: int | None = None,
        parity_every: int = 0,
        parity_tol: float = 1e-3,
        parity_samples: int = 4,
        vllm_args: dict[str, Any] | None = None,
        seed: int | None = None,
        max_staleness: int = 0,
        worker_threads: int = 1,
        environment: Environment | None = None,
        max_turns: int = 2,
        max_episode_tokens: int | None = None,
        endpoints: list[str] | None = None,
        hf: HFEngineOptions | None = None,
        partial: int | None = None,
    ):
        sampling = sampling if sampling is not None else SamplingParams()
        if engine not in ("hf", "vllm", "vllm_server"):
            raise ValueError(f"rollout engine must be 'hf', 'vllm' or 'vllm_server', got {engine!r}")
        if (engine == "vllm_server") != bool(endpoints):
            raise ValueError(
                f"rollout endpoints (the served engines' http://host:port) go with engine 'vllm_server' and it needs "
                f"them; got engine {engine!r} and endpoints {endpoints!r}"
            )
        self.endpoints = list(endpoints or [])
        if hf is not None and engine != "hf":
            raise ValueError(
                f"rollout.hf (kv_cache {hf.kv_cache!r}, compile {hf.compile}, share_prompt {hf.share_prompt}) sets "
                f"options of the HF engine, but rollout.engine is {engine!r}: remove rollout.hf or use engine 'hf'"
            )
        self.hf = hf if hf is not None else HFEngineOptions()
        if sampling.seed is not None:
            raise ValueError(
                f"rollout sampling.seed must be None (got {sampling.seed}): rollout i is sampled with "
                "seed + i; set the loop's `seed` instead"
            )
        for name, value in (("samples_per_prompt", samples_per_prompt), ("parity_samples", parity_samples)):
            if value < 1:
                raise ValueError(f"rollout {name} must be >= 1, got {value}")
        if parity_every < 0:
            raise ValueError(f"rollout parity_every must be >= 0, got {parity_every}")
        if max_staleness < 0 or worker_threads < 1:
            raise ValueError(
                f"rollout max_staleness must be >= 0 and worker_threads >= 1, got {max_staleness}, {worker_threads}"
            )
        if sampling.top_k > 0 or sampling.top_p < 1:
            raise ValueError(
                f"rollout sampling top_k={sampling.top_k}, top_p={sampling.top_p}: training samples must come from "
                "the distribution whose log-probs the loss uses; a truncated one is renormalised over the kept "
                "tokens, so every ratio and KL would be off by the log of the kept mass (TRL #6789). Sample "
                "training rollouts with top_k 0 and top_p 1 (validation may truncate: val_sampling)"
            )
        self.engine_kind = engine
        self.sampling = sampling
        self.samples_per_prompt = samples_per_prompt
        self.generation_batch_size = generation_batch_size
        self.parity_every = parity_every
        self.parity_tol = parity_tol
        self.parity_samples = parity_samples
        self.vllm_args = dict(vllm_args or {})
        self.seed = resolve_seed(seed)
        self.max_staleness, self.worker_threads = max_staleness, worker_threads
        if max_turns < 1 or (max_episode_tokens is not None and max_episode_tokens < 1):
            raise ValueError(
                f"rollout max_turns and max_episode_tokens must be >= 1, got {max_turns}, {max_episode_tokens}"
            )
        self.environment, self.max_turns = environment, max_turns
        self.max_episode_tokens = max_episode_tokens or max_turns * sampling.max_new_tokens
        check_partial(partial, engine=engine, max_staleness=max_staleness, environment=environment)
        self.partial = partial
        self.engine: RolloutEngine | None = None
        self.async_engine = None
        """The engine with weights of its own that generates ahead (``max_staleness >= 1``)."""
        self.pipeline: RolloutPipeline | None = None
        self._unverified: WeightSnapshot | None = None
        self._parity_model: torch.nn.Module | None = None
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self.rollouts = 0
        """Training rollouts generated so far (the next one is sampled with ``seed + rollouts``)."""
        self.syncs = 0
        """Engine syncs so far."""
        self.engine_version: int | None = None
        """The policy version whose weights the engine holds (None: unknown, sync before generating)."""
        self._frozen_engines: dict[int, HFEngine] = {}

    def setup(
        self,
        policy: torch.nn.Module,
        tokenizer,
        *,
        policy_dir: str | Path | None = None,
        world_size: int = 1,
        data_parallel: tuple[int, int] | None = None,
    ) -> None:
        """Build the engine for ``policy`` (once; a second call only rebinds the policy).

        ``policy_dir`` is the Hugging Face directory the policy was loaded from; the vLLM engine
        is built from it and then kept in sync with the live policy. With ``world_size > 1`` (a
        ``torch.distributed`` process group) the vLLM engine lives on rank 0 and serves every rank;
        ``data_parallel`` is this rank's ``(data-parallel rank, data-parallel size)`` (default: the
        global rank and ``world_size``; tensor-parallel peers share a data-parallel rank and get the
        same samples).
        """
        self.policy = policy
        self.tokenizer = tokenizer
        self.engine_version = None
        if self.engine is not None:
            return
        if self.engine_kind == "hf":
            self.engine = self._hf_engine(policy)
            return
        if self.engine_kind == "vllm_server":
            from alignlit.rollout.server import ServedVLLMEngine

            base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
            self.engine = ServedVLLMEngine.for_trainer(
                self.endpoints, tokenizer, model_config=getattr(base, "config", None), world_size=world_size,
                data_parallel=data_parallel, **{"seed": self.seed, **self.vllm_args},
            )  # fmt: skip
            return
        if policy_dir is None or not (Path(policy_dir) / "config.json").exists():
            raise ValueError(
                f"rollout engine 'vllm' is built from the policy's Hugging Face directory, got {policy_dir!r}: "
                "load the policy from an exported directory (not a TinyLlama spec)"
            )
        from alignlit.rollout.served import RankZeroServedEngine
        from alignlit.rollout.vllm_engine import VLLMEngine

        if self.max_staleness:  # the engine core in its own process: generation overlaps training
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        engine = VLLMEngine(policy_dir, tokenizer, **self.vllm_args)
        if world_size == 1:
            self.engine = engine
            return
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError(
                f"rollout engine 'vllm' with world size {world_size} needs the torch.distributed process "
                "group (set up by the trainer's strategy) before setup"
            )
        if data_parallel is None:
            data_parallel = (torch.distributed.get_rank(), world_size)
        self.engine = RankZeroServedEngine(
            engine, data_parallel_rank=data_parallel[0], data_parallel_size=data_parallel[1]
        )

    def start_pipeline(self, produce: Callable[[int, list[str], int], Any], make: Callable | None = None):
        """Start the background producer of ``max_staleness >= 1`` (:mod:`alignlit.rollout.pipeline`):
        ``produce(index, prompts, version)`` generates (with ``engine=self.async_engine``) and scores step
        ``index``'s rollout; the engine holds weights of its own, loaded from published snapshots. ``make(load)``
        builds another producer on the HF worker (partial rollouts, :mod:`alignlit.rollout.partial`)."""
        engine, policy = self._require_setup()
        if self.engine_kind == "hf":
            from alignlit.rollout.hf_worker import HFWorkerEngine

            worker = HFWorkerEngine(
                policy, self.tokenizer, micro_batch_size=self.generation_batch_size, threads=self.worker_threads,
                options=self.hf,
            )  # fmt: skip
            self.async_engine = worker
            build = make or (lambda load: RolloutPipeline(load, produce))
            self.pipeline = build(lambda snap: worker.load_weights(snap.version, snap.state))
            return self.pipeline
        if getattr(engine, "versioned", False):  # served engines take (version, state) and acknowledge it
            self.async_engine = engine
            self.pipeline = RolloutPipeline(lambda s: engine.load_weights(s.version, s.state), produce)
            return self.pipeline
        if not hasattr(engine, "load_state"):
            raise NotImplementedError(
                f"asynchronous rollouts (max_staleness {self.max_staleness}) with {type(engine).__name__}: the vLLM "
                "engine serving several training ranks keeps one weight version; run max_staleness 0"
            )
        self.async_engine = engine
        if self.parity_every and self._parity_model is None:
            from transformers import AutoModelForCausalLM

            # Built here, in the trainer's thread, on a copy of the config: a model sharing the policy's
            # config would, in the producer, run the attention function a packed trainer forward sets on it.
            base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
            config, dtype = copy.deepcopy(base.config), next(base.parameters()).dtype
            self._parity_model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()

        def load(snapshot: WeightSnapshot) -> None:
            engine.load_state(snapshot.state)
            self._unverified = snapshot  # the next batch is checked against exactly these weights

        self.pipeline = RolloutPipeline(load, produce)
        return self.pipeline

    def _verify_snapshot(self, rollout: Rollout, temperature: float) -> dict[str, float]:
        """The parity check of the first batch an engine generated after loading a snapshot (vLLM with
        ``max_staleness >= 1``): a teacher-forced forward of a model holding the snapshot's weights."""
        snapshot, self._unverified = self._unverified, None
        self._parity_model.load_state_dict(snapshot.state, strict=True)
        parity = check_parity(
            self._parity_model,
            rollout,
            temperature=temperature,
            tol=self.parity_tol,
            max_samples=self.parity_samples,
        )
        return {
            "rollout/parity_max_abs_diff": parity["max_abs_diff"],
            "rollout/parity_mean_abs_diff": parity["mean_abs_diff"],
        }

    def snapshot(self, version: int) -> WeightSnapshot:
        """A copy of the policy's current full state dict on the CPU (LoRA merged), as ``version``."""
        state = full_state_dict(self.policy, "cpu", merge_lora=True)
        return WeightSnapshot(version, {k: v.clone() for k, v in state.items()})

    def stop_pipeline(self) -> None:
        """Stop the producer and its worker (idempotent)."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.async_engine is not None and hasattr(self.async_engine, "close"):
            self.async_engine.close()
        self.async_engine = None

    def _hf_engine(self, model: torch.nn.Module) -> HFEngine:
        """An HF engine on ``model`` with this loop's chunk size and ``hf`` options."""
        return HFEngine(self.tokenizer, model, micro_batch_size=self.generation_batch_size, **vars(self.hf))

    def _require_setup(self) -> tuple[RolloutEngine, torch.nn.Module]:
        if self.engine is None or self.policy is None:
            raise RuntimeError("RolloutLoop.setup(policy, tokenizer) must be called before generating")
        return self.engine, self.policy

    def generate(
        self,
        prompts: Sequence[str],
        *,
        version: int = 0,
        n: int | None = None,
        sampling: SamplingParams | None = None,
        model: torch.nn.Module | None = None,
        engine: RolloutEngine | None = None,
    ) -> Rollout:
        """Sample ``n`` (default ``samples_per_prompt``) responses per prompt from the policy at ``version``
        (the engine is synced first when it holds another version: a caller that changes the policy's
        weights passes a new version, as the online stages do with their optimiser steps).

        With the default ``sampling`` this is a training rollout: seeded with ``seed + rollouts``
        and counted. With an explicit ``sampling`` (evaluation, prompt filtering, refills) its own seed
        is used and the rollout counter is untouched. ``model`` samples from another, frozen model
        instead of the policy (e.g. the reference ``π_0``), with Hugging Face ``generate``; ``engine`` samples
        with an engine whose weights the caller manages (the asynchronous producer's). The metrics of the
        sampling come with :meth:`collect`'s experience; nothing is kept on the loop, so the trainer and the
        asynchronous producer sample from one loop.
        """
        return self._sample(prompts, version, n, sampling, model, engine)[0]

    def _sample(self, prompts, version, n, sampling, model, engine) -> tuple[Rollout, dict[str, float]]:
        default, policy = self._require_setup()
        managed = engine is not None or model is not None
        if engine is None and model is not None:
            engine = self._frozen_engines.get(id(model))
            if engine is None:
                engine = self._frozen_engines[id(model)] = self._hf_engine(model)
        engine = engine if engine is not None else default
        if not managed and self.pipeline is not None and self.async_engine is default:
            with self.pipeline.exclusive():  # the producer's engine: wait for it, then load the policy
                self.engine_version = None
                return self._generate(engine, policy, prompts, version, n, sampling, managed)
        return self._generate(engine, policy, prompts, version, n, sampling, managed)

    def _generate(
        self, engine, policy, prompts, version, n, sampling, managed
    ) -> tuple[Rollout, dict[str, float]]:
        metrics: dict[str, float] = {}
        synced = False
        if not managed and self.engine_version != version:
            start = time.perf_counter()
            if getattr(engine, "versioned", False):  # a served engine acknowledges the version it holds
                engine.sync(policy, version=version)
            else:
                engine.sync(policy)
            metrics["rollout/sync_s"] = time.perf_counter() - start
            self.syncs += 1
            self.engine_version = version
            synced = True
        counted = sampling is None and not managed
        if sampling is None:
            sampling = SamplingParams(**{**vars(self.sampling), "seed": self.seed + self.rollouts})
        start = time.perf_counter()
        if self.environment is None:
            rollout = engine.generate(prompts, n or self.samples_per_prompt, sampling)
        else:
            rollout, episodes = run_episodes(
                engine, self.tokenizer, self.environment, prompts, n or self.samples_per_prompt, sampling,
                max_turns=self.max_turns, max_episode_tokens=self.max_episode_tokens,
            )  # fmt: skip
            metrics.update(episodes.metrics())
        elapsed = time.perf_counter() - start
        tokens = int(rollout.response_mask.sum())
        metrics.update(
            {
                "rollout/generate_s": elapsed,
                "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
                "rollout/samples": float(len(rollout)),
            }
        )
        if (
            synced
            and self.parity_every
            and self.syncs % self.parity_every == 0
            and rollout.action_mask is None
        ):
            parity = check_parity(policy, rollout, temperature=sampling.temperature, tol=self.parity_tol,
                                  max_samples=self.parity_samples)  # fmt: skip
            metrics["rollout/parity_max_abs_diff"] = parity["max_abs_diff"]
            metrics["rollout/parity_mean_abs_diff"] = parity["mean_abs_diff"]
        if managed and engine is self.async_engine and self._unverified is not None and self.parity_every:
            metrics.update(self._verify_snapshot(rollout, sampling.temperature))
        if counted:
            self.rollouts += 1
        return rollout, metrics

    def collect(
        self,
        prompts: Sequence[str],
        reward: Reward,
        *,
        version: int = 0,
        sampling: SamplingParams | None = None,
        engine: RolloutEngine | None = None,
    ) -> Experience:
        """One rollout on ``prompts`` from the policy at ``version``, scored by ``reward``
        (see :func:`~alignlit.rollout.reward_protocol.score_rollout`); a training rollout unless ``sampling`` is given.
        ``engine``: see :meth:`generate`. The experience carries the metrics of its making and scoring."""
        if self.environment is not None and not isinstance(reward, EpisodeReturn):
            raise ValueError(
                f"rollout.environment is set, so the reward must be the episodes' return: "
                f"alignlit.rollout.EpisodeReturn (optionally with a reward of the transcript), got {type(reward).__name__}"
            )
        rollout, metrics = self._sample(prompts, version, None, sampling, None, engine)
        start = time.perf_counter()
        rewards = score_rollout(reward, rollout)
        metrics.update({"rollout/score_s": time.perf_counter() - start, **reward_counters(reward)})
        versions = torch.full((len(rollout),), version, dtype=torch.long)
        return Experience(rollout, rewards, versions, metrics)

    def state_dict(self) -> dict[str, Any]:
        """The counters, for checkpoints."""
        return {"rollouts": self.rollouts, "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the engine is synced before the next generation."""
        missing = {"rollouts", "syncs"} - set(state)
        if missing:
            raise KeyError(f"RolloutLoop state is missing {sorted(missing)}")
        self.rollouts = int(state["rollouts"])
        self.syncs = int(state["syncs"])
        self.engine_version = None
