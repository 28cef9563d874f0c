"""The base of every online stage: rollouts of the current policy interleaved with gradient steps.

Lightning 2.x has no loop-replacement API, so an online stage uses manual optimisation and one
``training_step`` is one *rollout*: :class:`OnlineModule` collects the samples of the prompt batch
(:meth:`~alignlit.modules.collect.TrajectoryBuilder.collect`: sync, generate, score), builds their
:class:`~alignlit.modules.trajectory.Trajectory` once (old and reference log-probs, KL, importance
weights, loss mask), decides on every rank whether there is anything to learn from, and hands the
trajectory to the stage's :meth:`OnlineModule.train_on`, which computes its advantages or targets and
runs its own minibatch loop (:meth:`OnlineModule.minibatches`, :meth:`OnlineModule.update`).

Everything else lives here, once: the policy, the frozen reference ``π_0`` and the reward; the KL
controller; the policy's version (its optimiser steps, recorded on every sample); the prompt filter
(ChatGLM §3.4); the ptx (SFT-loss) mixer and ``val/sft_nll``; validation sampling (``val/reward``,
``val/gold``, ``val/kl``, ``val/length``); per-rollout warmup + cosine LR schedules; gradient-norm
clipping; the phase in the progress bar; the curves PNG/JSON; checkpoints that leave the frozen models
out and keep every piece of online state for an exact resume.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from alignlit.data.sampler import data_parallel_rank
from alignlit.hub import Pretrained, is_repo_id, resolve_model
from alignlit.models.loading import check_dtype, model_source
from alignlit.models.lora import AdapterDisabled, LoRA
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite, load_policy_and_reference
from alignlit.modules.collect import TrajectoryBuilder
from alignlit.modules.online_parts import (
    DataParallelStats,
    KLPenalty,
    PhaseDisplay,
    PtxMix,
    PtxMixer,
    TrainedModel,
    ValidationSampling,
)
from alignlit.modules.online_state import OnlineCheckpoints
from alignlit.modules.trajectory import Minibatches, Trajectory
from alignlit.ops import DynamicSampling, Overlong
from alignlit.ops.rollout_correction import resolve_rollout_correction
from alignlit.rollout.base import SamplingParams
from alignlit.rollout.loop import RolloutLoop
from alignlit.rollout.prompt_filter import PromptFilter
from alignlit.rollout.reward import Reward, RewardFn, resolve_reward

__all__ = ["KLPenalty", "OnlineModule", "PtxMix", "TrainedModel"]


class OnlineModule(TrajectoryBuilder, OnlineCheckpoints, ValidationSampling, DataParallelStats, AlignModule):
    """Base of the online stages; a subclass implements :meth:`train_on` (and, for state of its own,
    :meth:`online_state_dict` / :meth:`load_online_state_dict`).

    ``trainer.global_step`` counts optimizer steps (Lightning's manual-optimisation convention): set
    the run length in rollouts with ``trainer.max_epochs`` and ``trainer.limit_train_batches``; LR
    schedules count rollouts (warmup and cosine decay over the planned number of rollouts).

    Args:
        policy: causal-LM directory (e.g. the SFT export), or a :class:`~alignlit.models.TinyLlama` spec.
        reward: a reward-model directory (frozen; scores response texts encoded as in its training),
            the dotted path of a reward function, or any reward object/callable
            (see :mod:`alignlit.rollout.reward`; e.g. :class:`~alignlit.sim.SimGoldReward`).
        reference: frozen reference policy ``π_0`` directory (default: the policy's starting weights; with
            ``lora``, the policy's base with the adapter disabled, no second copy).
        rollout: how samples are collected (engine, sampling, samples per prompt, parity checks, seed);
            default ``RolloutLoop()``.
        minibatches: how the stage cuts a rollout into optimiser steps (size, epochs or steps, shuffle).
        kl: the KL(π‖π_0) penalty in the reward, fixed or adaptive ``β`` (None: off; PPO's default is on).
        optim: the policy's AdamW + warmup/cosine settings; steps are rollouts.
        max_grad_norm: global gradient-norm clipping of each trained model (None: off).
        tis_cap: truncated importance sampling of the rollout/trainer mismatch (algorithms.md §11):
            each token's policy loss is weighted by ``min(π_old(y_t)/μ(y_t), C)``, ``μ`` the engine's
            sampling distribution, ``C = tis_cap`` (None: off). The mismatch itself is logged every
            rollout either way (``mismatch/*``). With asynchronous rollouts (``rollout.max_staleness``) the
            recomputed ``π_old`` is the proximal policy and the weight corrects the staleness too: AReaL's
            decoupled PPO.
        rollout_correction: a registered rollout correction (:data:`alignlit.ops.ROLLOUT_CORRECTIONS`:
            ``"tis"``, ``"seq_tis"``, ``"geo_mask"``, ``"icepop"``) weighting each token's policy loss for
            the rollout/trainer mismatch, with ``rollout_correction_args`` (``{cap: 2.0}``; IcePop's ``{low,
            high}``); ``tis_cap: C`` is ``"tis"`` with ``{cap: C}``. Logged: ``rollout_correction/*`` (shares of
            tokens and sequences masked or capped, the mean weight). None: off.
        rollout_correction_args: the keyword arguments of ``rollout_correction``.
        old_logprobs: ``π_old``, the denominator of the policy ratio: ``"recompute"``d by the trainer (the
            default; mismatch metrics and ``tis_cap`` apply), or the engine's ``"behaviour"`` log-probs ``μ``
            (no recompute forward; verl's and prime-rl's asynchronous anchor; ``tis_cap`` does not apply).
        dynamic_sampling: DAPO dynamic sampling (keep the groups whose rewards differ, refill from more
            prompts; needs ``samples_per_prompt >= 2``; single process); None: off.
        overlong: DAPO's filtering of, or penalty on, responses cut at the token limit; None: off.
        ptx: SFT data mixed into policy updates and scored as ``val/sft_nll`` (None: off).
        prompt_filter: drop training prompts with low reward variance under the initial policy
            (ChatGLM §3.4), applied to the DataModule's ``train_prompts`` at the start of fit; the kept
            prompts are saved in checkpoints, so a resume trains on the same ones.
        gold: a reward scored on validation samples as ``val/gold`` (e.g. the simulated task's gold
            reward); None: not logged.
        val_sampling: sampling of validation responses (default: the rollout's); validation batch
            ``i`` is sampled with seed ``rollout.seed + i``.
        reward_batch_size: samples per reward-model forward pass.
        dtype: dtype of the loaded models.
        curves_file: PNG of the monitoring curves written at the end of fit (default:
            ``<log dir>/<stage>_curves.png``); the history goes next to it as JSON.
        export_dir: where the trained policy is exported at the end of fit.
        lora: LoRA adapters on the policy instead of full fine-tuning
            (:class:`~alignlit.models.lora.LoRA`; None: full).
        gradient_checkpointing: recompute the trained models' activations in the backward pass (HF
            activation checkpointing): same gradients, less memory, about one more forward per update.
        frozen_dtype: dtype of the frozen models, the reference (when it is a model of its own) and a
            reward-model directory (default: ``dtype``), e.g. ``bfloat16`` next to a float32 policy.
        shard_frozen: under ``ModelParallelStrategy``, shard the frozen reference and reward model like
            the trained models (FSDP2 + tensor parallel; decoders only) instead of a full replica per rank.
    """

    stage = "online"
    curve_panels: ClassVar[tuple[tuple[str, str], ...]] = (
        ("reward/raw", "reward (raw)"),
        ("kl/ref", "KL(π‖π0) per response"),
        ("response/length", "response length (tokens)"),
        ("val/gold", "held-out gold reward"),
        ("val/reward", "held-out reward"),
        ("val/sft_nll", "NLL on SFT validation data"),
        ("time/rollout_s", "rollout time (s)"),
        ("time/train_s", "train time (s)"),
    )
    """``(history key, panel title)`` of the curves PNG."""
    hparams_ignore: ClassVar[tuple[str, ...]] = ("reward", "rollout", "prompt_filter", "gold", "val_sampling")
    """Arguments left out of the checkpoint's hyperparameters (objects; the CLI records the config)."""
    min_loss_tokens: int = 1
    """A rollout with fewer loss tokens (over every rank) is skipped and counted."""

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        reward: str | Reward,
        reference: str | Pretrained | None = None,
        rollout: RolloutLoop | None = None,
        minibatches: Minibatches = Minibatches(),
        kl: KLPenalty | None = None,
        optim: Optim = Optim(lr=1e-5, min_lr_ratio=1.0),
        max_grad_norm: float | None = 1.0,
        tis_cap: float | None = None,
        rollout_correction: str | None = None,
        rollout_correction_args: dict[str, Any] | None = None,
        old_logprobs: Literal["recompute", "behaviour"] = "recompute",
        dynamic_sampling: DynamicSampling | None = None,
        overlong: Overlong | None = None,
        ptx: PtxMix | None = None,
        prompt_filter: PromptFilter | None = None,
        gold: RewardFn | None = None,
        val_sampling: SamplingParams | None = None,
        reward_batch_size: int = 64,
        dtype: str = "float32",
        curves_file: str | None = None,
        export_dir: str | None = None,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        frozen_dtype: str | None = None,
        shard_frozen: bool = False,
    ):
        super().__init__(export_dir=export_dir, optim=optim, lora=lora)
        self.save_hyperparameters(ignore=list(self.hparams_ignore))  # the stage's arguments too
        frozen_dtype = check_dtype(frozen_dtype or dtype, "frozen_dtype")
        self.rollout = rollout if rollout is not None else RolloutLoop()
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if tis_cap is not None and tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1 or None, got {tis_cap}")
        if tis_cap is not None and rollout_correction is not None:
            raise ValueError(
                f"give tis_cap ({tis_cap}) or rollout_correction ({rollout_correction!r}), not both: tis_cap C is "
                "rollout_correction 'tis' with rollout_correction_args {cap: C}"
            )
        if rollout_correction_args is not None and rollout_correction is None:
            raise ValueError("rollout_correction_args given without rollout_correction (a registered name)")
        if tis_cap is not None:
            rollout_correction, rollout_correction_args = "tis", {"cap": tis_cap}
        self.correction = (
            resolve_rollout_correction(rollout_correction, rollout_correction_args)
            if rollout_correction
            else None
        )
        if old_logprobs not in ("recompute", "behaviour") or (
            old_logprobs == "behaviour" and self.correction is not None
        ):
            raise ValueError(
                f"old_logprobs must be 'recompute' or 'behaviour' (then without tis_cap or rollout_correction: "
                f"π_old is μ), got {old_logprobs!r} with rollout correction {rollout_correction!r}"
            )
        if reward_batch_size < 1:
            raise ValueError(f"reward_batch_size must be >= 1, got {reward_batch_size}")
        if dynamic_sampling is not None and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                f"dynamic_sampling compares the rewards of a prompt's samples: rollout.samples_per_prompt must be "
                f">= 2, got {self.rollout.samples_per_prompt}"
            )
        if (
            overlong is not None
            and overlong.mode == "penalty"
            and overlong.buffer > self.rollout.sampling.max_new_tokens
        ):
            raise ValueError(
                f"overlong.buffer ({overlong.buffer}) must be <= rollout.sampling.max_new_tokens "
                f"({self.rollout.sampling.max_new_tokens})"
            )
        self.automatic_optimization = False
        self.gradient_checkpointing, self.shard_frozen = gradient_checkpointing, shard_frozen
        self.max_grad_norm, self.tis_cap, self.old_logprobs = max_grad_norm, tis_cap, old_logprobs
        self.minibatch_plan = minibatches
        self.kl, self.kl_ctl = kl, (kl.controller() if kl is not None else None)
        self.dynamic_sampling, self.overlong = dynamic_sampling, overlong
        self.ptx_mixer = PtxMixer(ptx)
        self.prompt_filter, self.gold, self.val_sampling = prompt_filter, gold, val_sampling
        self.curves_file = curves_file

        self.policy, self.tokenizer, self.reference = load_policy_and_reference(
            self, policy, reference, copy_policy=True, dtype=dtype, frozen_dtype=frozen_dtype,
            gradient_checkpointing=gradient_checkpointing,
        )  # fmt: skip
        limit = getattr(self.policy.config, "max_position_embeddings", None)
        if limit is not None and self.rollout.sampling.max_new_tokens >= limit:
            raise ValueError(
                f"rollout.sampling.max_new_tokens ({self.rollout.sampling.max_new_tokens}) leaves no room for a "
                f"prompt in the policy's {limit} positions (max_position_embeddings)"
            )
        # the local directory the policy was loaded from (a hub id's snapshot, not the id): what the vLLM
        # engine is built from (RolloutLoop.setup), and where the ptx data's tokenizer is read
        source = model_source(self.policy)
        self._policy_dir = source["dir"] if source is not None else None
        self._tokenizer_dir = policy.tokenizer if isinstance(policy, TinyLlama) else self._policy_dir
        if isinstance(reward, str) and is_repo_id(reward) and not Path(reward).exists():
            reward = str(resolve_model(reward, what="reward model"))  # a reward model by hub id
        self.reward = resolve_reward(reward, batch_size=reward_batch_size, dtype=frozen_dtype)
        model = getattr(self.reward, "model", None)
        # registered as a submodule so it follows the module's device; left out of checkpoints
        self.reward_model = model.requires_grad_(False).eval() if isinstance(model, torch.nn.Module) else None

        self.policy_version = 0
        """The version of the policy's weights: the training steps (rollouts) that updated it so far, each
        with all its minibatch steps; recorded on every sample, and the unit of ``rollout.max_staleness``."""
        self.minibatch_generator = torch.Generator().manual_seed(self.rollout.seed)
        self.refill_generator = torch.Generator().manual_seed(self.rollout.seed)
        self.restored_batches: tuple[dict, dict] = ({}, {})
        """Rollouts generated ahead but not trained on at the checkpoint (``max_staleness >= 1``)."""
        self.kept_prompts: list[str] | None = None
        """The training prompts the prompt filter kept (None: no filter, or not run yet)."""
        self.history: list[dict[str, float]] = []
        self.skipped_rollouts = self.trained_rollouts = 0
        self._phase = PhaseDisplay()
        self._stepped: set[int] = set()
        self._planned_rollouts = 1
        self._val_records: list[dict[str, torch.Tensor]] = []

    # ------------------------------------------------------------------ what a stage implements
    def train_on(self, trajectory: Trajectory) -> dict[str, float]:
        """Compute the stage's advantages or targets from ``trajectory`` and update the trained models
        on them (:meth:`minibatches`, :meth:`update`); returns metrics."""
        raise NotImplementedError

    def trained_models(self) -> list[TrainedModel]:
        """The models this stage updates, one optimizer each, the policy first."""
        return [TrainedModel("policy", self.policy, self.optim)]

    def online_state_dict(self) -> dict[str, Any]:
        """A stage's own online state for checkpoints (counters, caches, controllers)."""
        return {}

    def load_online_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`online_state_dict`."""

    # ------------------------------------------------------------------ setup
    def export_model(self):
        return self.policy

    def parallel_models(self) -> list[torch.nn.Module]:
        return [trained.module for trained in self.trained_models()]

    def frozen_parallel_models(self) -> list[torch.nn.Module]:
        """With ``shard_frozen``: the frozen reference and reward model (a LoRA reference is the policy)."""
        if not self.shard_frozen:
            return []
        frozen = [self.reference, self.reward_model]
        return [m for m in frozen if m is not None and not isinstance(m, AdapterDisabled)]

    def frozen_prefixes(self) -> list[str]:
        """State-dict prefixes of the frozen models, left out of checkpoints (they reload from disk); a
        LoRA stage's reference is the policy's base and has no weights of its own."""
        prefixes = [] if isinstance(self.reference, AdapterDisabled) else ["reference."]
        return prefixes + (["reward_model."] if self.reward_model is not None else [])

    def configure_callbacks(self):
        return [*super().configure_callbacks(), self._phase]

    def setup(self, stage: str) -> None:
        world = self.trainer.world_size if self._trainer is not None else 1
        if self.dynamic_sampling is not None and world > 1:
            raise ValueError(
                f"dynamic_sampling keeps a different number of groups on each rank, so the {world} ranks "
                "would take different numbers of optimizer steps: run it in a single process"
            )
        self.rollout.setup(
            self.policy, self.tokenizer, policy_dir=self._policy_dir, world_size=world,
            data_parallel=data_parallel_rank(self._trainer) if world > 1 else None,
        )  # fmt: skip
        self.setup_ptx()

    def setup_ptx(self) -> None:
        """Read and encode the ptx data (once), as :class:`~alignlit.data.SFTDataModule` does."""
        self.ptx_mixer.setup(self._tokenizer_dir, self._trainer)

    def on_fit_start(self) -> None:
        self.prepare_prompts(self.trainer.datamodule)

    def on_train_start(self) -> None:
        planned = self.trainer.estimated_stepping_batches
        self._planned_rollouts = int(planned) if planned != float("inf") else 1_000_000

    def configure_optimizers(self):
        # the schedule's length is read once warmup is over (known from on_train_start): asking for it
        # here would load the prompt loader before a checkpoint restores its position
        return [
            t.optim.build(
                [p for p in t.module.parameters() if p.requires_grad],
                total_steps=lambda t=t: max(1, self._planned_rollouts - t.first_rollout),
            )
            for t in self.trained_models()
        ]

    # ------------------------------------------------------------------ one rollout
    def _listed(self, value) -> list:
        return value if isinstance(value, list) else [value]

    def minibatches(self, num_rows: int) -> Iterator[torch.Tensor]:
        """The row indices of each optimiser step over ``num_rows`` rows (``minibatches``, drawn with the
        stage's seeded generator, saved in checkpoints)."""
        return self.minibatch_plan.plan(num_rows, self.minibatch_generator)

    def trainable(self, trajectory: Trajectory) -> Trajectory:
        """The samples to update on: those with a loss token; with several ranks all of them (masked),
        so that every rank takes as many optimiser steps."""
        if self._trainer is not None and self.trainer.world_size > 1:
            return trajectory
        return trajectory.with_loss_tokens()

    def update(self, name: str, loss: torch.Tensor) -> torch.Tensor:
        """Backward ``loss``, clip the gradient norm of the trained model ``name`` and step its optimizer;
        returns the norm before clipping."""
        names = [t.name for t in self.trained_models()]
        if name not in names:
            raise KeyError(f"{type(self).__name__} trains {names}, not {name!r}")
        index = names.index(name)
        model = self.trained_models()[index].module
        optimizer = self._listed(self.optimizers())[index]
        optimizer.zero_grad()
        self.manual_backward(loss)
        norm = self.clip_grad_norm(model.parameters(), self.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # not held through the next rollout's forwards
        self._stepped.add(index)
        return norm

    def training_step(self, prompts: list[str], batch_idx: int) -> None:
        self._phase.show(self.trainer, "rollout")
        start = time.perf_counter()
        experience, metrics = self.collect(prompts)
        metrics["time/rollout_s"] = time.perf_counter() - start

        self._phase.show(self.trainer, "train")
        start = time.perf_counter()
        self._stepped = set()
        metrics.update(self._train(experience) if experience is not None else self.skip(
            "every group's rewards are equal (no informative group)"
        ))  # fmt: skip
        schedulers = self._listed(self.lr_schedulers())
        for index in sorted(self._stepped):  # a schedule counts the rollouts its model was updated in
            schedulers[index].step()
        self.trained_rollouts += bool(self._stepped)
        self.policy_version += 0 in self._stepped  # the policy (trained model 0) took this step's updates
        metrics["time/train_s"] = time.perf_counter() - start
        for trained, scheduler in zip(self.trained_models(), schedulers):
            metrics[f"lr/{trained.name}"] = scheduler.get_last_lr()[0]
        metrics["rollout"] = float(self.rollout.rollouts)
        metrics["rollout/skipped_total"] = float(self.skipped_rollouts)
        metrics["policy/version"] = float(self.policy_version)
        self.history.append(dict(metrics))
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(prompts))
        shown = {name: metrics[k] for name, k in (("reward", "reward/raw"), ("kl", "kl/ref")) if k in metrics}
        self.log_dict(shown, prog_bar=True, logger=False, batch_size=len(prompts))

    def _train(self, experience) -> dict[str, float]:
        trajectory, metrics = self.make_trajectory(experience)
        tokens = int(self.all_reduce_sum(trajectory.loss_mask.sum()))  # decided over every rank
        if tokens < self.min_loss_tokens:
            return {
                **metrics,
                **self.skip(f"{tokens} loss token(s), {self.stage} needs {self.min_loss_tokens}"),
            }
        metrics.update(self.train_on(trajectory))
        if self.kl_ctl is not None and 0 in self._stepped:  # the mean KL over the global batch's responses
            self.update_kl_controller(self.kl_ctl, metrics["kl/ref"] * len(trajectory), len(trajectory))
        return metrics

    def skip(self, reason: str) -> dict[str, float]:
        """Count a rollout the stage cannot learn from (e.g. no response token) and say why."""
        self.skipped_rollouts += 1
        print(f"alignlit: rollout {self.rollout.rollouts} skipped: {reason}")
        return {"rollout/skipped": 1.0}

    def add_ptx(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], *, what: str) -> torch.Tensor:
        """``loss + ptx.coef · NLL`` on the next ptx batch (metric ``ptx_nll``), checked finite."""
        loss = self.ptx_mixer.add(loss, metrics, self.policy, self.device)
        check_finite(loss, what=what, step=self.global_step, metrics=metrics)
        return loss

    def teardown(self, stage: str) -> None:
        self.rollout.stop_pipeline()

    def on_fit_end(self) -> None:
        self.rollout.stop_pipeline()
        self.write_curves()
        if self.global_rank == 0:
            print(
                f"alignlit: {self.stage}: {self.trained_rollouts} rollout(s) trained, {self.skipped_rollouts} "
                f"skipped, policy version {self.policy_version}"
            )
            if self.trained_rollouts == 0:
                warnings.warn(
                    f"{self.stage}: no rollout was trained (all {self.skipped_rollouts} skipped): the export "
                    "is the starting policy",
                    stacklevel=1,
                )
        super().on_fit_end()
