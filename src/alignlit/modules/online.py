"""The base of every online stage: rollouts of the current policy interleaved with gradient steps.

Lightning 2.x has no loop-replacement API, so an online stage uses manual optimisation and one
``training_step`` is one *rollout*, three calls on the parts :class:`OnlineModule` composes::

    experience, metrics = self.collect(prompts)   # Collector / AheadCollector: sync, generate, score, accept
    metrics |= self.learn(experience)             # TrajectoryMaker -> Trajectory -> the stage's train_on
    self.record(metrics, len(prompts))            # the policy version, the history, the logs

The parts (:class:`~alignlit.rollout.collector.Collector`, :class:`~alignlit.rollout.ahead.AheadCollector`,
:class:`~alignlit.modules.trajectory_maker.TrajectoryMaker`, :class:`~alignlit.modules.online_prompts.TrainingPrompts`,
:class:`~alignlit.modules.online_parts.PtxMixer`, :class:`~alignlit.modules.online_parts.Validation`,
:class:`~alignlit.modules.online_steps.Updates`) hold their
own settings and state; the module holds the models, the KL controller, the policy's version, the LR schedules,
gradient clipping, the statistics over data-parallel ranks and the curves, and checkpoints
``{part: part.state_dict()}`` (:meth:`OnlineModule.checkpoint_parts`) without the frozen models.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from alignlit.data.sampler import data_parallel_rank, scheduled_batch
from alignlit.hub import Pretrained
from alignlit.lightning_internals import attached_trainer
from alignlit.models.loading import check_dtype
from alignlit.models.lora import AdapterDisabled, LoRA
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite
from alignlit.modules.online_parts import (
    KLPenalty,
    PhaseDisplay,
    PtxMix,
    PtxMixer,
    TrainedModel,
    Validation,
    load_online_models,
    update_kl_controller,
)
from alignlit.modules.online_prompts import TrainingPrompts
from alignlit.modules.online_state import Progress, Stateful, StateOf, load_state, save_state, write_curves
from alignlit.modules.online_steps import LossFn, Updates
from alignlit.modules.trajectory import Minibatches, Trajectory
from alignlit.modules.trajectory_maker import TrajectoryMaker, resolve_correction
from alignlit.ops import DynamicSampling, Overlong
from alignlit.rollout.ahead import AheadCollector
from alignlit.rollout.base import Experience, SamplingParams
from alignlit.rollout.collector import Collector, check_collection
from alignlit.rollout.loop import RolloutLoop
from alignlit.rollout.prompt_filter import PromptFilter
from alignlit.rollout.reward_protocol import Reward, RewardFn

__all__ = ["KLPenalty", "OnlineModule", "PtxMix", "TrainedModel"]


class OnlineModule(AlignModule):
    """Base of the online stages; a subclass implements :meth:`train_on` (and for state of its own
    :meth:`online_state_dict` / :meth:`load_online_state_dict`).

    ``trainer.global_step`` counts optimizer steps (Lightning's manual-optimisation convention): set
    the run length in rollouts with ``trainer.max_epochs`` and ``trainer.limit_train_batches``; LR
    schedules count rollouts (warmup and cosine decay over the planned number of rollouts).

    Args:
        policy: causal-LM directory (e.g. the SFT export), or a :class:`~alignlit.models.TinyLlama` spec.
        reward: a reward-model directory (frozen), the dotted path of a reward function, or any reward
            object/callable (:mod:`alignlit.rollout.reward_protocol`; e.g. :class:`~alignlit.sim.SimGoldReward`).
        reference: frozen reference policy ``π_0`` directory (default: the policy's starting weights; with
            ``lora``, the policy's base with the adapter disabled, no second copy).
        rollout: how samples are collected (engine, sampling, samples per prompt, seed; ``RolloutLoop()``).
        minibatches: how the stage cuts a rollout into optimiser steps (size, epochs or steps, shuffle) and
            the passes of a step into micro-batches (``token_budget``).
        kl: the KL(π‖π_0) penalty in the reward, fixed or adaptive ``β`` (None: off; PPO's default is on).
        optim: the policy's AdamW + warmup/cosine settings; steps are rollouts.
        max_grad_norm: global gradient-norm clipping of each trained model (None: off).
        tis_cap: truncated importance sampling ``min(π_old(y_t)/μ(y_t), C)`` of the rollout/trainer mismatch,
            ``C = tis_cap`` (None: off; :func:`~alignlit.modules.trajectory_maker.resolve_correction`).
        rollout_correction: a registered rollout correction (:data:`alignlit.ops.ROLLOUT_CORRECTIONS`: ``"tis"``,
            ``"seq_tis"``, ``"geo_mask"``, ``"icepop"``; None: off; ``resolve_correction``).
        rollout_correction_args: the keyword arguments of ``rollout_correction`` (``{cap: 2.0}``).
        old_logprobs: ``π_old``: ``"recompute"``d by the trainer, or the engine's ``"behaviour"`` log-probs ``μ``
            (``resolve_correction``).
        dynamic_sampling: DAPO dynamic sampling (:class:`~alignlit.rollout.collector.Collector`; None: off).
        overlong: DAPO's filtering of, or penalty on, responses cut at the token limit; None: off.
        ptx: SFT data mixed into policy updates and scored as ``val/sft_nll`` (None: off).
        prompt_filter: drop training prompts with low reward variance under the initial policy (ChatGLM §3.4;
            :class:`~alignlit.modules.online_prompts.TrainingPrompts`; None: off).
        gold: a reward scored on validation samples as ``val/gold`` (None: not logged).
        val_sampling: sampling of validation responses (default: the rollout's; seeded ``rollout.seed + i``).
        reward_batch_size: samples per reward-model forward pass.
        dtype: dtype of the loaded models.
        curves_file: PNG of the monitoring curves (default ``<log dir>/<stage>_curves.png``; JSON next to it).
        export_dir: where the trained policy is exported at the end of fit.
        lora: LoRA adapters on the policy (:class:`~alignlit.models.lora.LoRA`; None: full fine-tuning).
        gradient_checkpointing: recompute the trained models' activations in the backward pass (same
            gradients, less memory, about one more forward per update).
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
    needs_logprobs: ClassVar[bool] = True
    """Whether the stage trains on the sampled tokens' old and reference log-probs (online DPO and RRHF
    re-read the texts)."""

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
        correction = resolve_correction(tis_cap, rollout_correction, rollout_correction_args, old_logprobs)
        if reward_batch_size < 1:
            raise ValueError(f"reward_batch_size must be >= 1, got {reward_batch_size}")
        check_collection(self.rollout, overlong=overlong, dynamic_sampling=dynamic_sampling)
        self.automatic_optimization = False
        self.gradient_checkpointing, self.shard_frozen = gradient_checkpointing, shard_frozen
        self.kl, self.kl_ctl = kl, (kl.controller() if kl is not None else None)
        self.ptx_mixer = PtxMixer(ptx)
        self.curves_file = curves_file

        models = load_online_models(
            self, policy, reference, reward, dtype=dtype, frozen_dtype=frozen_dtype,
            gradient_checkpointing=gradient_checkpointing, reward_batch_size=reward_batch_size,
        )  # fmt: skip
        self.policy, self.tokenizer, self.reference, self.reward = models[:4]
        self._policy_dir, self._tokenizer_dir = models.policy_dir, models.tokenizer_dir
        model = getattr(self.reward, "model", None)
        # registered as a submodule so it follows the module's device; left out of checkpoints
        self.reward_model = model.requires_grad_(False).eval() if isinstance(model, torch.nn.Module) else None

        # the parts of one online step (module docstring)
        self.collector = Collector(
            self.rollout, self.reward, pad_id=self.tokenizer.pad_token_id, overlong=overlong,
            dynamic_sampling=dynamic_sampling,
        )  # fmt: skip
        self.ahead = AheadCollector(self.collector)
        self.trajectories = TrajectoryMaker(
            self.policy, self.reference, temperature=self.rollout.sampling.temperature,
            task_rewards=self.collector.task_rewards, needs_logprobs=self.needs_logprobs, old_logprobs=old_logprobs,
            overlong_filter=overlong is not None and overlong.mode == "filter",
            kl_estimator=kl.estimator if kl is not None else None, kl_ctl=self.kl_ctl, correction=correction,
            token_budget=minibatches.token_budget,
        )  # fmt: skip
        self.prompts = TrainingPrompts(
            self.rollout, self.tokenizer, position_limit=models.position_limit, val_sampling=val_sampling,
            prompt_filter=prompt_filter,
        )  # fmt: skip
        self.validation = Validation(
            self.rollout, self.reward, self.trajectories, self.ptx_mixer, gold=gold, sampling=val_sampling
        )

        self.progress = Progress(self.rollout.seed)
        self.resume_notice = ""
        """Why a resumed asynchronous run cannot match the uninterrupted one ("" when it can)."""
        self._phase = PhaseDisplay()
        self.updates = Updates(
            self, minibatches, self.progress, max_grad_norm=max_grad_norm, add_ptx=self.add_ptx
        )
        self._planned_rollouts = 1

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
        world = self.trainer.world_size if attached_trainer(self) is not None else 1
        self.collector.check_world(world)
        self.rollout.setup(
            self.policy, self.tokenizer, policy_dir=self._policy_dir, world_size=world,
            data_parallel=data_parallel_rank(attached_trainer(self)) if world > 1 else None,
        )  # fmt: skip
        self.setup_ptx()

    def setup_ptx(self) -> None:
        """Read and encode the ptx data (once), as :class:`~alignlit.data.SFTDataModule` does."""
        self.ptx_mixer.setup(self._tokenizer_dir, attached_trainer(self))

    def on_fit_start(self) -> None:
        dm = self.trainer.datamodule
        self.collector.pool = self.prompts.prepare(dm, self.reward, version=self.progress.policy_version)

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
    def training_step(self, prompts: list[str], batch_idx: int) -> None:
        experience, metrics = self.collect(prompts)
        metrics |= self.learn(experience)
        self.record(metrics, len(prompts))

    def collect(self, prompts: list[str]) -> tuple[Experience | None, dict[str, float]]:
        """This step's experience, generated now by the current policy (the collector) or, with
        ``rollout.max_staleness >= 1``, ahead (:meth:`collect_ahead`); ``time/rollout_s``."""
        self._phase.show(self.trainer, "rollout")
        start = time.perf_counter()
        if self.rollout.max_staleness:
            experience, metrics = self.collect_ahead(prompts)
        else:
            experience, metrics = self.collector.collect(prompts, version=self.progress.policy_version)
        return experience, {**metrics, "time/rollout_s": time.perf_counter() - start}

    def collect_ahead(self, prompts: list[str]) -> tuple[Experience | None, dict[str, float]]:
        """This step's experience from the ahead-collector, given the prompts of every step
        (:func:`~alignlit.data.sampler.scheduled_batch` of the training loader) and the run's last step."""
        loader, batches = self.trainer.train_dataloader, int(self.trainer.num_training_batches)
        return self.ahead.collect(
            prompts, version=self.progress.policy_version, last=self._planned_rollouts - 1,
            schedule=lambda index: scheduled_batch(loader, index, batches),
        )  # fmt: skip

    def learn(self, experience: Experience | None) -> dict[str, float]:
        """Make the experience's trajectory, decide on every rank whether it has enough loss tokens, train the
        stage on it (:meth:`train_on`), adapt the KL controller and step the LR schedules of the models it
        updated; ``time/train_s``, ``lr/*``."""
        self._phase.show(self.trainer, "train")
        start = time.perf_counter()
        self.updates.start_rollout()
        if experience is None:
            metrics = self.skip("every group's rewards are equal (no informative group)")
        else:
            trajectory, metrics = self.make_trajectory(experience)
            tokens = int(self.all_reduce_sum(trajectory.loss_mask.sum()))  # decided over every rank
            if tokens < self.min_loss_tokens:
                metrics |= self.skip(f"{tokens} loss token(s), {self.stage} needs {self.min_loss_tokens}")
            else:
                metrics |= self.train_on(trajectory)
                if self.kl_ctl is not None and 0 in self.updates.stepped:  # the mean KL over the global batch
                    kl_sum, count = metrics["kl/ref"] * len(trajectory), len(trajectory)
                    update_kl_controller(self.kl_ctl, kl_sum, count, self.all_reduce_sum, self.device)
        schedulers = self.lr_schedulers()
        schedulers = schedulers if isinstance(schedulers, list) else [schedulers]
        for index in sorted(self.updates.stepped):  # a schedule counts the rollouts its model was updated in
            schedulers[index].step()
        self.progress.trained_rollouts += bool(self.updates.stepped)
        self.progress.policy_version += (
            0 in self.updates.stepped
        )  # the policy (trained model 0) took the updates
        metrics |= self.updates.stats.metrics()  # perf/*, with minibatches.token_budget
        metrics["time/train_s"] = time.perf_counter() - start
        for trained, scheduler in zip(self.trained_models(), schedulers):
            metrics[f"lr/{trained.name}"] = scheduler.get_last_lr()[0]
        return metrics

    def record(self, metrics: dict[str, float], batch_size: int) -> None:
        """Add the step's counters to ``metrics``, append them to the history and log them."""
        progress = self.progress
        metrics["rollout"] = float(self.rollout.rollouts)
        metrics["rollout/skipped_total"] = float(progress.skipped_rollouts)
        metrics["policy/version"] = float(progress.policy_version)
        progress.history.append(dict(metrics))
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=batch_size)
        shown = {name: metrics[k] for name, k in (("reward", "reward/raw"), ("kl", "kl/ref")) if k in metrics}
        self.log_dict(shown, prog_bar=True, logger=False, batch_size=batch_size)

    def make_trajectory(self, experience: Experience) -> tuple[Trajectory, dict[str, float]]:
        """The :class:`Trajectory` of an accepted experience for the current policy version on this module's
        device (:meth:`~alignlit.modules.trajectory_maker.TrajectoryMaker.make`)."""
        return self.trajectories.make(experience, version=self.progress.policy_version, device=self.device)

    def logprobs(self, model: torch.nn.Module, ids: tuple[torch.Tensor, ...], *, temperature=None):
        """(N, T) log-probs of the response tokens ``ids`` under ``model`` on this module's device
        (:meth:`~alignlit.modules.trajectory_maker.TrajectoryMaker.logprobs`)."""
        return self.trajectories.logprobs(model, ids, device=self.device, temperature=temperature)

    # ------------------------------------------------------------------ what train_on calls
    def minibatches(self, num_rows: int) -> Iterator[torch.Tensor]:
        """The row indices of each optimiser step over ``num_rows`` rows (:meth:`Updates.minibatches
        <alignlit.modules.online_steps.Updates.minibatches>`)."""
        return self.updates.minibatches(num_rows)

    def trainable(self, trajectory: Trajectory) -> Trajectory:
        """The samples to update on: those with a loss token; with several ranks all of them (masked),
        so that every rank takes as many optimiser steps."""
        if attached_trainer(self) is not None and self.trainer.world_size > 1:
            return trajectory
        return trajectory.with_loss_tokens()

    def update(self, name: str, loss: torch.Tensor) -> torch.Tensor:
        """One clipped optimiser step of the trained model ``name`` on ``loss``; the norm before clipping
        (:meth:`Updates.step <alignlit.modules.online_steps.Updates.step>`)."""
        return self.updates.step(name, loss)

    def update_on(self, name: str, mb: Trajectory, loss_fn: LossFn, **kwargs) -> dict[str, torch.Tensor]:
        """One optimiser step on minibatch ``mb`` (:meth:`Updates.step_on
        <alignlit.modules.online_steps.Updates.step_on>`: ``aggregation``, ``what``, ``ptx``)."""
        return self.updates.step_on(name, mb, loss_fn, **kwargs)

    def skip(self, reason: str) -> dict[str, float]:
        """Count a rollout the stage cannot learn from (e.g. no loss token) and say why."""
        self.progress.skipped_rollouts += 1
        print(f"alignlit: rollout {self.rollout.rollouts} skipped: {reason}")
        return {"rollout/skipped": 1.0}

    def add_ptx(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], *, what: str) -> torch.Tensor:
        """``loss + ptx.coef · NLL`` on the next ptx batch (metric ``ptx_nll``), checked finite."""
        loss = self.ptx_mixer.add(loss, metrics, self.policy, self.device)
        check_finite(loss, what=what, step=self.global_step, metrics=metrics)
        return loss

    # ------------------------------------------------------------------ validation
    def validation_step(self, prompts: list[str], batch_idx: int) -> None:
        self.validation.sample(prompts, batch_idx, version=self.progress.policy_version, device=self.device)

    def on_validation_epoch_end(self) -> None:
        metrics = self.validation.metrics(self.policy, self.device)
        if metrics and not self.trainer.sanity_checking:
            self.log_dict(metrics, sync_dist=True)
        if metrics:  # the sanity check before training (num_sanity_val_steps: -1) starts the curves
            self.progress.history.append({"rollout": float(self.rollout.rollouts), **metrics})

    # ------------------------------------------------------------------ checkpoints and the end of fit
    def checkpoint_parts(self) -> dict[str, Stateful]:
        """The parts whose state an online checkpoint holds, by name (:mod:`alignlit.modules.online_state`);
        the ahead-collector first: saving it drains the producer, so the others' state settles."""
        parts: dict[str, Stateful] = {"ahead": self.ahead, "rollout": self.rollout, "collector": self.collector}  # fmt: skip
        parts |= {"prompts": self.prompts, "ptx": self.ptx_mixer, "progress": self.progress}
        parts |= {"kl": self.kl_ctl} if self.kl_ctl is not None else {}  # fmt: skip
        return parts | {"stage": StateOf(self.online_state_dict, self.load_online_state_dict)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save every part's state under ``<stage>_state``, the frozen models left out."""
        save_state(checkpoint, f"{self.stage}_state", self.checkpoint_parts(), self.frozen_prefixes())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        frozen = {prefix: getattr(self, prefix.rstrip(".")) for prefix in self.frozen_prefixes()}
        parts, owner = self.checkpoint_parts(), type(self).__name__
        load_state(checkpoint, f"{self.stage}_state", parts, frozen, owner=owner)
        self.resume_notice = self.ahead.resume_notice()
        if self.resume_notice:
            print(self.resume_notice, flush=True)

    def teardown(self, stage: str) -> None:
        self.rollout.stop_pipeline()

    def on_fit_end(self) -> None:
        self.rollout.stop_pipeline()
        self.write_curves()
        if self.global_rank == 0:
            self.progress.report(self.stage)
        super().on_fit_end()

    def write_curves(self) -> Path | None:
        """Plot the monitoring history (PNG, ``curves_file``, default ``<log dir>/<stage>_curves.png``) and
        write it as JSON next to it, on rank 0. Every rank calls it (``trainer.log_dir`` is a collective)."""
        root = self.trainer.log_dir or self.trainer.default_root_dir
        out = self.curves_file or str(Path(root) / f"{self.stage}_curves.png")
        if self.global_rank != 0:
            return None
        return write_curves(self.progress.history, out, stage=self.stage, panels=self.curve_panels)
