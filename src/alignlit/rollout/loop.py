"""The rollout loop every online stage calls from ``training_step``: sync, generate, score, minibatch.

Lightning 2.x has no loop-replacement API, so online stages (PPO, online DPO, online RRHF) use
manual optimisation and drive one :class:`RolloutLoop` per iteration::

    experience = loop.collect(prompts, reward_fn)          # sync if stale -> generate -> score
    ...                                                     # stage-specific: PPO builds advantages
    for idx in loop.minibatches(len(experience)):           # `epochs` shuffled passes
        ...                                                 # gradient step on the rows `idx`
        loop.mark_stale()                                   # the policy changed

What the loop produces is generic (an :class:`Experience`: the rollout and one reward per
sample); whatever a stage derives from it (reference log-probs, values, advantages, pairs) belongs
to the stage. Switching engines is one config key, ``engine: hf | vllm``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from alignlit.rollout.base import Rollout, RolloutEngine, SamplingParams
from alignlit.rollout.hf_engine import HFEngine
from alignlit.rollout.parity import check_parity
from alignlit.rollout.reward import Reward, score_rollout


@dataclass
class Experience:
    """A scored rollout: what every online stage starts from.

    Attributes:
        rollout: ``N = B * n`` samples (prompt ``i`` repeated ``n`` times consecutively), see
            :class:`~alignlit.rollout.base.Rollout`.
        rewards: (N,) float32, the reward function's score of each sample.
    """

    rollout: Rollout
    rewards: torch.Tensor

    def __len__(self) -> int:
        return len(self.rollout)

    def grouped_rewards(self) -> torch.Tensor:
        """(B, n) rewards, one row per prompt (for best-of-n / pairing stages)."""
        return self.rewards.view(-1, self.rollout.n)


class RolloutLoop:
    """Generate-and-score experience for online stages, and minibatches over it.

    Per iteration: :meth:`collect` syncs the engine if the policy changed since the last sync
    (:meth:`mark_stale`), samples ``samples_per_prompt`` responses per prompt, optionally checks
    the engine's log-probs against the policy's after a sync, and scores every response with the
    reward; :meth:`minibatches` then yields ``epochs`` shuffled passes of row indices. Rollout
    ``i`` is sampled with seed ``seed + i`` and the shuffling uses the loop's own generator, both
    saved by :meth:`state_dict`, so a resumed run samples exactly what an uninterrupted one would.

    Args:
        engine: ``"hf"`` (Hugging Face ``generate`` on the training model, the default) or
            ``"vllm"`` (an in-process vLLM engine built from the policy's directory; with several
            training ranks one engine on rank 0 serves them all,
            :class:`~alignlit.rollout.vllm_engine.RankZeroServedEngine`).
        sampling: how responses are sampled (``sampling.seed`` must be None: use ``seed``).
        samples_per_prompt: responses sampled per prompt (``n``).
        epochs: passes over each rollout's experience (PPO's ``ppo_epochs``).
        minibatch_size: rows per minibatch (the last minibatch of a pass may be smaller).
        shuffle: shuffle the rows of every pass.
        generation_batch_size: most prompts per HF ``generate`` call (None: all at once).
        parity_every: check the engine's log-probs against the policy's after every k-th sync
            (0: never); a difference above ``parity_tol`` raises
            :class:`~alignlit.rollout.parity.ParityError`.
        parity_tol: largest allowed absolute log-prob difference.
        parity_samples: samples recomputed by the parity check.
        vllm_args: extra keyword arguments of :class:`~alignlit.rollout.VLLMEngine` (e.g. ``sync_every``).
        seed: rollout ``i`` is sampled with seed ``seed + i``; also seeds the minibatch shuffling.
    """

    def __init__(
        self,
        engine: Literal["hf", "vllm"] = "hf",
        sampling: SamplingParams | None = None,
        samples_per_prompt: int = 1,
        epochs: int = 1,
        minibatch_size: int = 16,
        shuffle: bool = True,
        generation_batch_size: int | None = None,
        parity_every: int = 0,
        parity_tol: float = 1e-3,
        parity_samples: int = 4,
        vllm_args: dict[str, Any] | None = None,
        seed: int = 0,
    ):
        sampling = sampling if sampling is not None else SamplingParams()
        if engine not in ("hf", "vllm"):
            raise ValueError(f"rollout engine must be 'hf' or 'vllm', got {engine!r}")
        if sampling.seed is not None:
            raise ValueError(
                f"rollout sampling.seed must be None (got {sampling.seed}): rollout i is sampled with "
                "seed + i; set the loop's `seed` instead"
            )
        for name, value in (
            ("samples_per_prompt", samples_per_prompt),
            ("epochs", epochs),
            ("minibatch_size", minibatch_size),
            ("parity_samples", parity_samples),
        ):
            if value < 1:
                raise ValueError(f"rollout {name} must be >= 1, got {value}")
        if parity_every < 0:
            raise ValueError(f"rollout parity_every must be >= 0, got {parity_every}")
        self.engine_kind = engine
        self.sampling = sampling
        self.samples_per_prompt = samples_per_prompt
        self.epochs = epochs
        self.minibatch_size = minibatch_size
        self.shuffle = shuffle
        self.generation_batch_size = generation_batch_size
        self.parity_every = parity_every
        self.parity_tol = parity_tol
        self.parity_samples = parity_samples
        self.vllm_args = dict(vllm_args or {})
        self.seed = seed
        self.engine: RolloutEngine | None = None
        self.policy: torch.nn.Module | None = None
        self.rollouts = 0
        """Rollouts generated so far (the next one is sampled with ``seed + rollouts``)."""
        self.syncs = 0
        """Engine syncs so far."""
        self.stale = True
        """The policy changed since the engine's last sync."""
        self.generator = torch.Generator().manual_seed(seed)
        self.metrics: dict[str, float] = {}
        """Timings and throughput of the last :meth:`generate` / :meth:`collect` call."""

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
        self.stale = True
        if self.engine is not None:
            return
        if self.engine_kind == "hf":
            self.engine = HFEngine(tokenizer, policy, micro_batch_size=self.generation_batch_size)
            return
        if policy_dir is None or not (Path(policy_dir) / "config.json").exists():
            raise ValueError(
                f"rollout engine 'vllm' is built from the policy's Hugging Face directory, got {policy_dir!r}: "
                "load the policy from an exported directory (not a TinyLlama spec)"
            )
        from alignlit.rollout.vllm_engine import RankZeroServedEngine, VLLMEngine

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

    def mark_stale(self) -> None:
        """Record that the policy's weights changed (the next generation syncs the engine first)."""
        self.stale = True

    def synced_engine(self) -> RolloutEngine:
        """The engine, synced with the policy's current weights (for sampling outside :meth:`generate`)."""
        engine, policy = self._require_setup()
        if self.stale:
            engine.sync(policy)
            self.syncs += 1
            self.stale = False
        return engine

    def _require_setup(self) -> tuple[RolloutEngine, torch.nn.Module]:
        if self.engine is None or self.policy is None:
            raise RuntimeError("RolloutLoop.setup(policy, tokenizer) must be called before generating")
        return self.engine, self.policy

    def generate(
        self, prompts: Sequence[str], *, n: int | None = None, sampling: SamplingParams | None = None
    ) -> Rollout:
        """Sync the engine if stale, then sample ``n`` (default ``samples_per_prompt``) responses per prompt.

        With the default ``sampling`` this is a training rollout: seeded with ``seed + rollouts``
        and counted. With an explicit ``sampling`` (e.g. evaluation) its own seed is used and the
        rollout counter is untouched. Timings go to :attr:`metrics`.
        """
        engine, policy = self._require_setup()
        metrics: dict[str, float] = {}
        synced = False
        if self.stale:
            start = time.perf_counter()
            engine.sync(policy)
            metrics["rollout/sync_s"] = time.perf_counter() - start
            self.syncs += 1
            self.stale = False
            synced = True
        counted = sampling is None
        if sampling is None:
            sampling = SamplingParams(**{**vars(self.sampling), "seed": self.seed + self.rollouts})
        start = time.perf_counter()
        rollout = engine.generate(prompts, n or self.samples_per_prompt, sampling)
        elapsed = time.perf_counter() - start
        tokens = int(rollout.response_mask.sum())
        metrics.update(
            {
                "rollout/generate_s": elapsed,
                "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
                "rollout/samples": float(len(rollout)),
            }
        )
        if synced and self.parity_every and self.syncs % self.parity_every == 0:
            parity = check_parity(
                policy,
                rollout,
                temperature=sampling.temperature,
                tol=self.parity_tol,
                max_samples=self.parity_samples,
            )
            metrics["rollout/parity_max_abs_diff"] = parity["max_abs_diff"]
            metrics["rollout/parity_mean_abs_diff"] = parity["mean_abs_diff"]
        if counted:
            self.rollouts += 1
        self.metrics = metrics
        return rollout

    def collect(self, prompts: Sequence[str], reward: Reward) -> Experience:
        """One training rollout on ``prompts``, scored by ``reward`` (see :func:`score_rollout`)."""
        rollout = self.generate(prompts)
        start = time.perf_counter()
        rewards = score_rollout(reward, rollout)
        self.metrics["rollout/score_s"] = time.perf_counter() - start
        return Experience(rollout, rewards)

    def num_minibatches(self, num_rows: int) -> int:
        """How many minibatches :meth:`minibatches` yields for ``num_rows`` rows (all epochs)."""
        return self.epochs * -(-num_rows // self.minibatch_size)

    def minibatches(self, num_rows: int) -> Iterator[torch.Tensor]:
        """``epochs`` passes over ``range(num_rows)``, each shuffled and cut into ``minibatch_size`` chunks.

        Yields (m,) long index tensors, ``m <= minibatch_size``.
        """
        if num_rows < 1:
            raise ValueError(f"cannot make minibatches of {num_rows} rows")
        for _ in range(self.epochs):
            order = (
                torch.randperm(num_rows, generator=self.generator) if self.shuffle else torch.arange(num_rows)
            )
            yield from order.split(self.minibatch_size)

    def show_phase(self, trainer, phase: str) -> None:
        """Show the current phase (``"rollout"``, ``"train"``) in the trainer's progress bar (TQDM or Rich)."""
        bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
        if bar is None or not bar.is_enabled:
            return
        description = f"Epoch {trainer.current_epoch} [{phase}]"
        tqdm_bar = getattr(bar, "_train_progress_bar", None)
        if tqdm_bar is not None:
            tqdm_bar.set_description(description, refresh=True)
            return
        progress, task = getattr(bar, "progress", None), getattr(bar, "train_progress_bar_id", None)
        if progress is not None and task is not None:
            progress.update(task, description=description)
            bar.refresh()

    def state_dict(self) -> dict[str, Any]:
        """Counters and the shuffling generator's state, for checkpoints."""
        return {
            "rollouts": self.rollouts,
            "syncs": self.syncs,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the engine is synced before the next generation."""
        missing = {"rollouts", "syncs", "generator"} - set(state)
        if missing:
            raise KeyError(f"RolloutLoop state is missing {sorted(missing)}")
        self.rollouts = int(state["rollouts"])
        self.syncs = int(state["syncs"])
        self.generator.set_state(state["generator"])
        self.stale = True
