"""PPO with a critic on the online base: PPO-max (Zheng et al. 2023) plus ChatGLM-RLHF additions.

One ``training_step`` is one PPO iteration (algorithms.md §4): a rollout of the prompt batch, the PPO
experience built from it (:meth:`PPOModule.make_experience`: old/reference log-probs, values,
KL-penalised token rewards, GAE), then ``rollout.epochs`` passes of minibatch updates of the critic
and the policy, each with its own optimizer, LR schedule and gradient-norm clipping.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any, Literal

import torch

from alignlit.checks import resolve_registered
from alignlit.eval.plots import PPO_PANELS
from alignlit.hub import Pretrained
from alignlit.losses.ppo import entropy_bonus, ppo_policy_loss, ppo_value_loss
from alignlit.models.forward import response_token_logprobs, response_values
from alignlit.models.loading import load_scalar_model, model_source
from alignlit.models.modes import disable_dropout, eval_mode
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import Optim, check_finite
from alignlit.modules.online import OnlineModule
from alignlit.modules.online_parts import KLPenalty, TrainedModel, mean_metrics
from alignlit.modules.trajectory import Trajectory
from alignlit.ops import (
    TOKEN_ADVANTAGE_ESTIMATORS,
    RewardNorm,
    RunningMoments,
    explained_variance,
    kl_penalized_rewards,
    masked_mean,
    normalize_scores,
    token_advantages,
    whiten,
)
from alignlit.rollout.reward_protocol import Reward, score_rollout

AdvantageNorm = Literal["none", "batch", "minibatch"]
BASELINE_SEED_OFFSET = 1_000_003
"""Reference responses of rollout ``i`` are sampled with seed ``rollout.seed + BASELINE_SEED_OFFSET + i``."""


class PPOModule(OnlineModule):
    """PPO with a critic (PPO-max) on the online base; every PPO-max / ChatGLM switch is an argument.

    One training step is one rollout of the prompt batch followed by ``minibatches.epochs`` passes of
    ``minibatches.size`` updates of the critic, then the policy. The arguments shared by every
    online stage (policy, reward, reference, rollout, minibatches, kl, optim, ptx, prompt filter,
    validation) are those of :class:`~alignlit.modules.online.OnlineModule`.

    Args:
        policy: see :class:`~alignlit.modules.online.OnlineModule`.
        reward: see :class:`~alignlit.modules.online.OnlineModule`.
        critic: scalar-model directory the critic starts from (default: ``reward`` when it is a
            directory, else ``policy`` with a fresh head). Must share the policy's tokenizer.
        critic_optim: the critic's AdamW + warmup/cosine settings (steps are rollouts).
        clip_eps: policy ratio clip ``ε``.
        value_clip_eps: value clip ``ε_v`` (None: unclipped value loss).
        advantage: the per-token estimator of the advantages and value targets from the token rewards and
            the critic's values: ``"gae"`` (generalised advantage estimation) or another entry of
            :data:`alignlit.ops.TOKEN_ADVANTAGE_ESTIMATORS` that uses a critic (or its dotted path).
        gamma: discount ``γ``.
        lam: GAE ``λ``.
        reward_norm: ``"normalize"`` ``(R - μ)/σ``, ``"scale"`` ``R/σ`` or ``"none"``, with running ``μ, σ``
            over every rollout so far (all ranks).
        reward_clip: clip the (normalised) reward to ``±δ`` (None: off).
        reference_baseline: subtract the reward of a reference response ``y_ref ~ π_0``, sampled once
            per prompt and cached (ChatGLM eq. 5).
        kl: the token-level KL penalty ``r_t = -β·kl_t`` in the reward (fixed or adaptive ``β``).
        advantage_norm: whiten advantages over the rollout (``"batch"``), per minibatch, or not.
        advantage_clip: clip advantages to ``±c`` after whitening (None: off).
        entropy_coef: entropy bonus ``c_H``.
        critic_pretrain_rollouts: first rollouts that train only the critic (PPO-max §5.3.3).
        critic_adapter: with ``lora``, the critic trains a LoRA adapter of its own on its frozen
            backbone (its value head in full); False: the critic is fully fine-tuned.
        **kwargs: the arguments of :class:`~alignlit.modules.online.OnlineModule` (reference,
            rollout, minibatches, optim, max_grad_norm, tis_cap, dynamic_sampling, overlong, ptx,
            prompt_filter, gold, val_sampling, reward_batch_size, dtype, curves_file, export_dir, lora,
            gradient_checkpointing, frozen_dtype, shard_frozen).
    """

    stage = "ppo"
    curve_panels = PPO_PANELS
    min_loss_tokens = 2  # whitening the advantages needs two values

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        reward: str | Reward,
        critic: str | Pretrained | None = None,
        critic_optim: Optim = Optim(lr=5e-5, min_lr_ratio=1.0),
        clip_eps: float = 0.2,
        value_clip_eps: float | None = 0.2,
        advantage: str = "gae",
        gamma: float = 1.0,
        lam: float = 0.95,
        reward_norm: RewardNorm = "normalize",
        reward_clip: float | None = 5.0,
        reference_baseline: bool = False,
        kl: KLPenalty = KLPenalty(),
        advantage_norm: AdvantageNorm = "batch",
        advantage_clip: float | None = None,
        entropy_coef: float = 0.0,
        critic_pretrain_rollouts: int = 0,
        critic_adapter: bool = True,
        **kwargs,
    ):
        if advantage_norm not in ("none", "batch", "minibatch"):
            raise ValueError(f"advantage_norm must be 'none', 'batch' or 'minibatch', got {advantage_norm!r}")
        if reward_norm not in ("none", "normalize", "scale"):
            raise ValueError(f"reward_norm must be 'none', 'normalize' or 'scale', got {reward_norm!r}")
        if critic_pretrain_rollouts < 0:
            raise ValueError(f"critic_pretrain_rollouts must be >= 0, got {critic_pretrain_rollouts}")
        self.estimator = resolve_registered(advantage, TOKEN_ADVANTAGE_ESTIMATORS, "advantage estimator")
        super().__init__(policy, reward, kl=kl, **kwargs)
        self.critic_optim = critic_optim
        # a reward model given by directory or hub id (not a dotted path, not package:): its directory
        given = isinstance(reward, str) and not reward.startswith("package:")
        reward_source = model_source(self.reward_model) if given else None
        reward_dir = reward_source["dir"] if reward_source is not None else None
        critic_dir = critic or reward_dir or self._policy_dir
        if critic_dir is None:
            raise ValueError(
                "critic: give a scalar-model directory (the policy is a TinyLlama spec, not a directory)"
            )
        self.critic, critic_tokenizer = load_scalar_model(
            critic_dir, head="fresh", dtype=kwargs.get("dtype", "float32")
        )
        self.prepare_trained(
            self.critic, gradient_checkpointing=self.gradient_checkpointing, lora=critic_adapter
        )
        disable_dropout(self.critic).train()
        if critic_tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(
                f"critic {critic_dir!r} has a different tokenizer from the policy; per-token values need the "
                "policy's tokens: set `critic` to a directory with the policy's tokenizer (e.g. the policy)"
            )
        self.reward_moments = RunningMoments()
        self.baseline_cache: dict[str, float] = {}

    def trained_models(self) -> list[TrainedModel]:
        return [
            TrainedModel("actor", self.policy, self.optim, self.hparams.critic_pretrain_rollouts),
            TrainedModel("critic", self.critic, self.critic_optim),
        ]

    # ------------------------------------------------------------------ advantages
    def _sequence_rewards(self, trajectory: Trajectory) -> tuple[torch.Tensor, dict[str, float]]:
        """``R = r(x, y)``, minus ``r(x, y_ref)`` with the reference baseline (ChatGLM eq. 5)."""
        scores = trajectory.rewards.cpu()
        if not self.hparams.reference_baseline:
            return scores, {}
        missing = list(dict.fromkeys(p for p in trajectory.prompts if p not in self.baseline_cache))
        if missing:
            seed = self.rollout.seed + BASELINE_SEED_OFFSET + self.rollout.rollouts
            sampling = dataclasses.replace(self.rollout.sampling, seed=seed)
            ref_rollout = self.rollout.generate(
                missing, version=self.progress.policy_version, n=1, sampling=sampling, model=self.reference
            )
            for prompt, value in zip(missing, score_rollout(self.reward, ref_rollout).tolist()):
                self.baseline_cache[prompt] = value
        baseline = torch.tensor([self.baseline_cache[p] for p in trajectory.prompts], dtype=scores.dtype)
        return scores - baseline, {
            "reward/baseline": float(baseline.mean()),
            "reward/baseline_new": float(len(missing)),
        }

    def _update_moments(self, values: torch.Tensor) -> None:
        """Fold this rollout's rewards into the running moments, merged over the data-parallel ranks in
        rank order (tensor-parallel peers hold the same rewards and are counted once)."""
        local = RunningMoments()
        local.update(values)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            self.reward_moments.merge(local)
            return
        group = self.data_parallel_group()
        parts: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(parts, local.state_dict(), group=group)
        for part in parts:
            moments = RunningMoments()
            moments.load_state_dict(part)
            self.reward_moments.merge(moments)

    @torch.no_grad()
    def advantages(self, trajectory: Trajectory) -> dict[str, float]:
        """PPO's targets on ``trajectory`` (PPO-max §5.2): the critic's values, the normalised sequence
        reward with the token KL penalty (``token_rewards``), GAE ``advantages`` and ``returns``; returns
        the monitoring metrics. With several ranks the running reward moments, the batch whitening of the
        advantages and the adaptive KL controller are taken over the global batch, as one process would.
        """
        hp, mask = self.hparams, trajectory.loss_mask
        start = time.perf_counter()
        with eval_mode(self.critic):
            trajectory.values = self.trajectories.forward(
                partial(response_values, self.critic), trajectory.ids, device=self.device
            )  # (N, T)
        metrics = {"time/values_s": time.perf_counter() - start}
        shaped, shaping_metrics = self._sequence_rewards(trajectory)
        metrics.update(shaping_metrics)
        self._update_moments(shaped)
        normalized = normalize_scores(shaped, self.reward_moments, mode=hp.reward_norm, clip=hp.reward_clip)
        turns = trajectory.turn_rewards  # an environment's per-turn rewards, on the scale of the normalised R
        if turns is not None:
            turns = normalize_scores(
                turns, self.reward_moments, mode="none" if hp.reward_norm == "none" else "scale", clip=None
            )
        trajectory.token_rewards = kl_penalized_rewards(
            normalized.to(self.device), trajectory.kl, mask, kl_coef=self.kl_ctl.value, turn_rewards=turns
        )  # (N, T)
        advantages, trajectory.returns = token_advantages(
            trajectory.token_rewards, mask, estimator=self.estimator, values=trajectory.values,
            gamma=hp.gamma, lam=hp.lam,
        )  # fmt: skip
        if hp.advantage_norm == "batch":
            advantages = whiten(advantages, mask, all_reduce=self.batch_all_reduce())
        if hp.advantage_clip is not None:
            advantages = advantages.clamp(-hp.advantage_clip, hp.advantage_clip) * mask
        trajectory.advantages = advantages
        metrics.update(
            {
                "reward/shaped": float(shaped.mean()),
                "reward/normalized": float(normalized.mean()),
                "reward/running_mean": self.reward_moments.mean,
                "reward/running_std": self.reward_moments.std if self.reward_moments.count >= 2 else 0.0,
                "value/explained_var": float(explained_variance(trajectory.values, trajectory.returns, mask)),
                "value/mean": float(masked_mean(trajectory.values, mask)),
                "advantage/mean": float(masked_mean(advantages, mask)),
            }
        )
        return metrics

    # ------------------------------------------------------------------ losses and updates
    def critic_loss(self, mb: Trajectory) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped value loss of the critic on a minibatch (:func:`~alignlit.losses.ppo_value_loss`)."""
        clip = self.hparams.value_clip_eps
        values = response_values(self.critic, *mb.ids)
        loss, metrics = ppo_value_loss(
            values, mb.values, mb.returns, mb.loss_mask, clip_eps=clip if clip is not None else float("inf")
        )
        check_finite(loss, what="PPO value loss", step=self.global_step, metrics=metrics)
        return loss, metrics

    def actor_loss(
        self, mb: Trajectory, *, ptx: bool = True, whiten_minibatch: bool = True
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped surrogate + entropy bonus + ``ptx.coef``·SFT NLL (``ptx``) of the policy on a minibatch,
        its advantages whitened over it with ``advantage_norm: minibatch`` (``whiten_minibatch``)."""
        hp = self.hparams
        scored = response_token_logprobs(
            self.policy, *mb.ids, temperature=self.rollout.sampling.temperature,
            with_entropy=True, entropy_grad=hp.entropy_coef > 0,
        )  # fmt: skip
        mask = mb.loss_mask
        minibatch_norm = hp.advantage_norm == "minibatch" and whiten_minibatch
        advantages = whiten(mb.advantages, mask) if minibatch_norm else mb.advantages
        loss, metrics = ppo_policy_loss(
            scored.logprobs, mb.old_logprobs, advantages, mask, clip_eps=hp.clip_eps, is_weights=mb.is_weights
        )
        entropy_loss, entropy_metrics = entropy_bonus(scored.entropy, mask, coef=hp.entropy_coef)
        metrics.update(entropy_metrics)
        loss = loss + entropy_loss
        return (self.add_ptx(loss, metrics, what="PPO policy loss") if ptx else loss), metrics

    def train_on(self, trajectory: Trajectory) -> dict[str, float]:
        metrics = self.advantages(trajectory)
        batch = self.trainable(trajectory)
        actor_active = self.rollout.rollouts > self.hparams.critic_pretrain_rollouts
        critic_records, actor_records = [], []
        actor_loss = partial(self.actor_loss, ptx=False, whiten_minibatch=False)
        for rows in self.minibatches(len(batch)):  # every loss a mean over the minibatch's loss tokens
            mb = batch.select(rows)
            critic_records.append(
                self.update_on(
                    "critic", mb, self.critic_loss, aggregation="token_mean", what="PPO value loss"
                )
            )
            if actor_active:
                if self.hparams.advantage_norm == "minibatch":  # over the whole minibatch, not a micro-batch
                    mb.advantages = whiten(mb.advantages, mb.loss_mask)
                actor_records.append(
                    self.update_on(
                        "actor", mb, actor_loss, aggregation="token_mean", what="PPO policy loss", ptx=True
                    )
                )
        metrics.update(
            {f"value/{k.removeprefix('value_')}": v for k, v in mean_metrics(critic_records).items()}
        )
        metrics.update({f"policy/{k}": v for k, v in mean_metrics(actor_records).items()})
        return metrics

    # ------------------------------------------------------------------ online state
    def online_state_dict(self) -> dict[str, Any]:
        return {
            "reward_moments": self.reward_moments.state_dict(),
            "baseline_cache": dict(self.baseline_cache),
        }

    def load_online_state_dict(self, state: dict[str, Any]) -> None:
        self.reward_moments.load_state_dict(state["reward_moments"])
        self.baseline_cache = dict(state["baseline_cache"])
