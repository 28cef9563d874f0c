"""The base of every online stage: rollouts of the current policy interleaved with gradient steps.

Lightning 2.x has no loop-replacement API, so an online stage uses manual optimisation and one
``training_step`` is one *rollout*: :class:`OnlineModule` samples responses to the prompt batch
through the :class:`~alignlit.rollout.RolloutLoop` and scores them with the reward, then the stage's
:meth:`OnlineModule.train_on` turns the scored :class:`~alignlit.rollout.Experience` into updates
(PPO: advantages and minibatch epochs; online DPO: pairs; policy gradients: group advantages).

Everything else lives here, once: loading the policy, the frozen reference ``π_0`` and the reward;
dropout off (log-prob ratios must compare the same function); the prompt filter (ChatGLM §3.4);
the ptx (SFT-loss) mixer and ``val/sft_nll``; validation sampling (``val/reward``, ``val/gold``,
``val/kl``, ``val/length``); per-rollout warmup + cosine LR schedules; gradient-norm clipping; the
phase shown in the progress bar; the curves PNG/JSON; checkpoints that leave the frozen models out
and keep every piece of online state (loop counters and RNGs, ptx loader position, history) for an
exact resume. The parts that are not the loop (the KL and ptx settings, the ptx mixer, the phase
display, the statistics over several ranks) are in :mod:`alignlit.modules.online_parts`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from alignlit.data.sampler import data_parallel_rank
from alignlit.data.sft import SFTDataModule
from alignlit.models.forward import response_logprobs
from alignlit.models.loading import DTYPES, check_dtype, load_policy
from alignlit.models.lora import AdapterDisabled, LoRA
from alignlit.models.modes import disable_dropout, eval_mode
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite
from alignlit.modules.online_parts import (
    DataParallelStats,
    KLPenalty,
    PhaseDisplay,
    PtxMix,
    PtxMixer,
    TrainedModel,
)
from alignlit.ops.mismatch import logprob_mismatch, truncated_is_weights
from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.loop import Experience, RolloutLoop
from alignlit.rollout.prompt_filter import PromptFilter
from alignlit.rollout.reward import Reward, RewardFn, resolve_reward, score_rollout

__all__ = ["KLPenalty", "OnlineModule", "PhaseDisplay", "PtxMix", "TrainedModel"]


class OnlineModule(DataParallelStats, AlignModule):
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
        rollout: the rollout loop (engine, sampling, samples per prompt, epochs, minibatch size, parity
            checks); default ``RolloutLoop()``.
        optim: the policy's AdamW + warmup/cosine settings; steps are rollouts.
        max_grad_norm: global gradient-norm clipping of each trained model (None: off).
        tis_cap: truncated importance sampling of the rollout/trainer mismatch (algorithms.md §11):
            each token's policy loss is weighted by ``min(π_old(y_t)/μ(y_t), C)``, ``μ`` the engine's
            sampling distribution, ``C = tis_cap`` (None: off). The mismatch itself is logged every
            rollout either way (``mismatch/*``).
        ptx: SFT data mixed into policy updates and scored as ``val/sft_nll`` (None: off).
        prompt_filter: drop training prompts with low reward variance under the initial policy
            (ChatGLM §3.4), applied to the DataModule's ``train_prompts`` at the start of fit.
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

    def __init__(
        self,
        policy: str | TinyLlama,
        reward: str | Reward,
        reference: str | None = None,
        rollout: RolloutLoop | None = None,
        optim: Optim = Optim(lr=1e-5, min_lr_ratio=1.0),
        max_grad_norm: float | None = 1.0,
        tis_cap: float | None = None,
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
        frozen_dtype = check_dtype(frozen_dtype or dtype, "frozen_dtype")
        self.gradient_checkpointing = gradient_checkpointing
        self.shard_frozen = shard_frozen
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if tis_cap is not None and tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1 or None, got {tis_cap}")
        self.tis_cap = tis_cap
        if reward_batch_size < 1:
            raise ValueError(f"reward_batch_size must be >= 1, got {reward_batch_size}")
        self.automatic_optimization = False
        self.max_grad_norm = max_grad_norm
        self.rollout = rollout if rollout is not None else RolloutLoop()
        self.ptx_mixer = PtxMixer(ptx)
        self.prompt_filter = prompt_filter
        self.gold = gold
        self.val_sampling = val_sampling
        self.curves_file = curves_file

        self.policy, self.tokenizer = (
            load_policy(policy) if isinstance(policy, TinyLlama) else load_policy(policy, dtype=dtype)
        )
        self._policy_dir = None if isinstance(policy, TinyLlama) else str(policy)
        self._tokenizer_dir = policy.tokenizer if isinstance(policy, TinyLlama) else str(policy)
        if reference is not None:
            reference_model = load_policy(reference, dtype=frozen_dtype)[0]
        elif lora is None:
            reference_model = copy.deepcopy(self.policy).to(DTYPES[frozen_dtype])
        self.prepare_trained(self.policy, gradient_checkpointing=gradient_checkpointing)
        disable_dropout(self.policy).train()
        if reference is None and lora is not None:
            reference_model = AdapterDisabled(self.policy)
        self.reference = disable_dropout(reference_model).requires_grad_(False).eval()

        self.reward = resolve_reward(reward, batch_size=reward_batch_size, dtype=frozen_dtype)
        model = getattr(self.reward, "model", None)
        # registered as a submodule so it follows the module's device; left out of checkpoints
        self.reward_model = model.requires_grad_(False).eval() if isinstance(model, torch.nn.Module) else None

        self.history: list[dict[str, float]] = []
        self.skipped_rollouts = 0
        self._phase = PhaseDisplay()
        self._stepped: set[int] = set()
        self._planned_rollouts = 1
        self._val_records: list[dict[str, torch.Tensor]] = []

    # ------------------------------------------------------------------ what a stage implements
    def train_on(self, experience: Experience) -> dict[str, float]:
        """Update the trained models on one scored rollout (with :meth:`update`); returns metrics."""
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
        self.rollout.setup(
            self.policy, self.tokenizer, policy_dir=self._policy_dir, world_size=world,
            data_parallel=data_parallel_rank(self._trainer) if world > 1 else None,
        )  # fmt: skip
        self.setup_ptx()

    def setup_ptx(self) -> None:
        """Read and encode the ptx data (once), as :class:`~alignlit.data.SFTDataModule` does."""
        self.ptx_mixer.setup(self._tokenizer_dir, self._trainer)

    def on_fit_start(self) -> None:
        if self.prompt_filter is None:
            return
        dm = self.trainer.datamodule
        if dm is None or not hasattr(dm, "train_prompts"):
            raise ValueError("prompt_filter needs a DataModule with `train_prompts` (e.g. PromptDataModule)")
        dm.train_prompts, report = self.prompt_filter(
            self.rollout.synced_engine(),
            self.reward,
            dm.train_prompts,
            default_sampling=self.rollout.sampling,
        )
        if not dm.train_prompts:
            raise ValueError(f"prompt_filter dropped every training prompt ({report}); lower epsilon")
        print(f"alignlit: prompt filter kept {int(report['kept'])} of {int(report['prompts'])} prompts")

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

    def update(self, name: str, loss: torch.Tensor) -> torch.Tensor:
        """Backward ``loss``, clip the gradient norm of the trained model ``name`` and step its optimizer;
        returns the norm before clipping. A policy update marks the rollout engine stale."""
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
        self._stepped.add(index)
        if model is self.policy:
            self.rollout.mark_stale()
        return norm

    def training_step(self, prompts: list[str], batch_idx: int) -> None:
        self._phase.show(self.trainer, "rollout")
        start = time.perf_counter()
        experience = self.rollout.collect(prompts, self.reward)
        metrics = {**self.rollout.metrics, "time/rollout_s": time.perf_counter() - start}

        self._phase.show(self.trainer, "train")
        start = time.perf_counter()
        self._stepped = set()
        metrics.update(self.train_on(experience))
        schedulers = self._listed(self.lr_schedulers())
        for index in sorted(self._stepped):  # a schedule counts the rollouts its model was updated in
            schedulers[index].step()
        metrics["time/train_s"] = time.perf_counter() - start
        for trained, scheduler in zip(self.trained_models(), schedulers):
            metrics[f"lr/{trained.name}"] = scheduler.get_last_lr()[0]
        metrics["rollout"] = float(self.rollout.rollouts)
        metrics["rollout/skipped_total"] = float(self.skipped_rollouts)
        self.history.append(dict(metrics))
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(experience))
        shown = {name: metrics[k] for name, k in (("reward", "reward/raw"), ("kl", "kl/ref")) if k in metrics}
        self.log_dict(shown, prog_bar=True, logger=False, batch_size=len(experience))

    @torch.no_grad()
    def old_logprobs(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """The trainer's ``log π_old`` of the sampled tokens and the rollout/trainer mismatch (§11).

        Returns ``(old_logprobs (N, T), is_weights (N, T) or None, metrics)``: the policy's
        teacher-forced log-probs (eval mode, on this module's device), the truncated importance
        weights ``min(exp(log π_old - log μ), tis_cap)`` when ``tis_cap`` is set, and ``mismatch/*``
        metrics comparing them with the engine's ``log μ`` (``rollout.logprobs``), and ``time/old_logp_s``.
        """
        ids = [
            t.to(self.device)
            for t in (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
        ]
        start = time.perf_counter()
        with eval_mode(self.policy):
            old = response_logprobs(
                self.policy, *ids, temperature=self.rollout.sampling.temperature
            )  # (N, T)
        timing = {"time/old_logp_s": time.perf_counter() - start}
        engine = rollout.logprobs.to(device=self.device, dtype=old.dtype)  # (N, T)
        mask = ids[3]
        if not mask.any():
            return old, None, timing
        metrics = {
            **timing,
            **{
                f"mismatch/{k.removeprefix('mismatch_')}": float(v)
                for k, v in logprob_mismatch(old, engine, mask).items()
            },
        }
        weights = None
        if self.tis_cap is not None:
            weights = truncated_is_weights(old, engine, mask, cap=self.tis_cap)  # (N, T)
            metrics["mismatch/is_weight_mean"] = float(weights[mask].mean())
        return old, weights, metrics

    def skip(self, reason: str) -> dict[str, float]:
        """Count a rollout the stage cannot learn from (e.g. no response token) and say why."""
        self.skipped_rollouts += 1
        print(f"alignlit: rollout {self.rollout.rollouts} skipped: {reason}")
        return {"rollout/skipped": 1.0}

    # ------------------------------------------------------------------ ptx
    @property
    def ptx(self) -> PtxMix | None:
        """The ptx settings (None: off)."""
        return self.ptx_mixer.config

    @property
    def ptx_data(self) -> SFTDataModule | None:
        """The encoded ptx data (after :meth:`setup_ptx`; None without ptx)."""
        return self.ptx_mixer.data

    def ptx_nll(self, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Token-mean NLL of the policy on a batch of human (prompt, response) pairs (ChatGLM eq. 6)."""
        return self.ptx_mixer.nll(self.policy, batch, self.device)

    def add_ptx(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], *, what: str) -> torch.Tensor:
        """``loss + ptx.coef · NLL`` on the next ptx batch (metric ``ptx_nll``), checked finite."""
        loss = self.ptx_mixer.add(loss, metrics, self.policy, self.device)
        check_finite(loss, what=what, step=self.global_step, metrics=metrics)
        return loss

    # ------------------------------------------------------------------ validation
    def validation_step(self, prompts: list[str], batch_idx: int) -> None:
        sampling = self.val_sampling or self.rollout.sampling
        sampling = dataclasses.replace(sampling, seed=self.rollout.seed + batch_idx)
        rollout = self.rollout.generate(prompts, n=1, sampling=sampling)
        mask = rollout.response_mask.to(self.device)
        ids = (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
        ref = response_logprobs(
            self.reference, *(t.to(self.device) for t in ids), temperature=sampling.temperature
        )
        record = {
            "val/reward": score_rollout(self.reward, rollout),
            "val/kl": ((rollout.logprobs.to(self.device) - ref) * mask).sum(-1).cpu(),
            "val/length": rollout.response_lengths.float(),
        }
        if self.gold is not None:
            record["val/gold"] = score_rollout(self.gold, rollout)
        self._val_records.append(record)

    def on_validation_epoch_end(self) -> None:
        records, self._val_records = self._val_records, []
        metrics: dict[str, float] = {}
        if records:
            metrics = {k: float(torch.cat([r[k] for r in records]).mean()) for k in records[0]}
        sft_nll = self.ptx_mixer.val_nll(self.policy, self.device)
        if sft_nll is not None:
            metrics["val/sft_nll"] = sft_nll
        if metrics:
            if not self.trainer.sanity_checking:
                self.log_dict(metrics, sync_dist=True)
            # the sanity check before training (``num_sanity_val_steps: -1`` runs all validation
            # batches) is the curves' starting point
            self.history.append({"rollout": float(self.rollout.rollouts), **metrics})

    # ------------------------------------------------------------------ checkpoints and curves
    @property
    def state_key(self) -> str:
        return f"{self.stage}_state"

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the online state; leave the frozen models out (they reload from disk)."""
        prefixes = tuple(self.frozen_prefixes())
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(prefixes)]:
            del state[key]
        checkpoint[self.state_key] = {
            "rollout": self.rollout.state_dict(),
            "history": list(self.history),
            "skipped_rollouts": self.skipped_rollouts,
            "ptx_loader": self.ptx_mixer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            **self.online_state_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get(self.state_key)
        if state is None:
            raise KeyError(
                f"checkpoint has no {self.state_key!r}: it was not written by {type(self).__name__}"
            )
        for prefix in self.frozen_prefixes():
            module = getattr(self, prefix.rstrip("."))
            checkpoint["state_dict"].update({prefix + k: v for k, v in module.state_dict().items()})
        self.rollout.load_state_dict(state["rollout"])
        self.history = list(state["history"])
        self.skipped_rollouts = int(state["skipped_rollouts"])
        self.ptx_mixer.load_state_dict(state["ptx_loader"])
        torch.set_rng_state(state["torch_rng"])
        self.load_online_state_dict(state)

    def write_curves(self) -> Path | None:
        """Plot the monitoring history (PNG) and write it as JSON next to it, on rank 0; None without
        history and on the other ranks. Every rank calls it (``trainer.log_dir`` is a collective)."""
        out = self.curves_file
        if out is None:
            root = self.trainer.log_dir or self.trainer.default_root_dir
            out = str(Path(root) / f"{self.stage}_curves.png")
        if not self.history or self.global_rank != 0:
            return None
        from alignlit.eval.plots import plot_curves

        path = plot_curves(
            {self.stage: self.history}, out, panels=self.curve_panels, title=f"{self.stage} monitoring"
        )
        path.with_suffix(".json").write_text(json.dumps(self.history, indent=1) + "\n")
        print(f"alignlit: {self.stage} curves written to {path}")
        return path

    def on_fit_end(self) -> None:
        self.write_curves()
        super().on_fit_end()
