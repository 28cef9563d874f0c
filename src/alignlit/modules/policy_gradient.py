"""Critic-free policy gradients on the online base: GRPO, Dr. GRPO, RLOO, REINFORCE++(-baseline), DAPO.

One ``training_step`` is one rollout (algorithms.md §10): ``n`` responses per prompt are sampled and
scored; with dynamic sampling (DAPO) groups whose rewards are all equal are dropped and, optionally,
more prompts are sampled until the batch is full; advantages come from a pure estimator
(:func:`~alignlit.ops.group_advantages` or :func:`~alignlit.ops.reinforce_pp_returns`); then
``rollout.epochs`` passes of minibatch updates of :func:`~alignlit.losses.policy_gradient_loss`.
No critic is built: the policy is the only trained model.

Under several data-parallel ranks each rank samples the groups of its own prompts and the rollout is
their union, the global batch: statistics over the whole batch (REINFORCE++'s whitening,
REINFORCE++-baseline's standard deviation) and the adaptive KL controller are taken over it, whether
a rollout is skipped is decided over every rank, and responses without a loss token stay in (masked),
so every rank runs as many updates as the others, as PPO does (:class:`~alignlit.modules.ppo.PPOModule`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from alignlit.checks import resolve_registered
from alignlit.losses.policy_gradient import LOSS_AGGREGATIONS, policy_gradient_loss
from alignlit.models.forward import response_logprobs, response_token_logprobs
from alignlit.models.modes import eval_mode
from alignlit.models.tiny import TinyLlama
from alignlit.modules.online import KLPenalty, OnlineModule
from alignlit.modules.online_parts import UpdateBatch, mean_metrics
from alignlit.ops import (
    ADVANTAGE_ESTIMATORS,
    DynamicSampling,
    Overlong,
    group_advantages,
    informative_groups,
    kl_estimate,
    masked_mean,
    overlong_mask,
    overlong_penalty,
    reinforce_pp_returns,
)
from alignlit.ops.kl import KLKind
from alignlit.rollout.base import Rollout, select_groups
from alignlit.rollout.loop import Experience, RolloutLoop
from alignlit.rollout.reward import Reward, score_rollout

__all__ = ["PER_TOKEN", "DynamicSampling", "Overlong", "PGBatch", "PolicyGradientModule", "select_groups"]

PER_TOKEN = "reinforce_pp"
"""The per-token estimator (REINFORCE++: KL in the token rewards, discounted returns, batch whitening)."""


@dataclasses.dataclass
class PGBatch(UpdateBatch):
    """One rollout ready for updates: the :class:`~alignlit.modules.online_parts.UpdateBatch` fields,
    ``old_logprobs``/``ref_logprobs``/``is_weights`` (N, T), ``advantages`` (N,) or (N, T)."""

    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    advantages: torch.Tensor
    is_weights: torch.Tensor | None = None


class PolicyGradientModule(OnlineModule):
    """Critic-free policy gradients on the online base (algorithms.md §10), every variant a config key.

    The arguments shared by every online stage (policy, reward, reference, rollout, optim, ptx,
    prompt filter, TIS, validation) are those of :class:`~alignlit.modules.online.OnlineModule`;
    ``rollout.samples_per_prompt`` is the group size ``n`` (at least 2, except for ``reinforce_pp``).

    Args:
        policy: see :class:`~alignlit.modules.online.OnlineModule`.
        reward: see :class:`~alignlit.modules.online.OnlineModule`.
        advantage: ``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"reinforce_pp_baseline"`` (or another name in
            :data:`alignlit.ops.ADVANTAGE_ESTIMATORS`, or the dotted path of such a function): one
            advantage per response from the group's rewards; or ``"reinforce_pp"``: per-token
            REINFORCE++ returns with the KL in the token rewards, whitened over the batch.
        eps: ``ε`` added to standard deviations by the estimators.
        gamma: discount ``γ`` of the ``reinforce_pp`` returns.
        clip_low: ``ε_low``, the ratio's lower clip ``1 - ε_low``.
        clip_high: ``ε_high``, the ratio's upper clip ``1 + ε_high`` (DAPO's clip-higher: 0.28).
        aggregation: token-loss reduction, a name in :data:`alignlit.losses.LOSS_AGGREGATIONS`
            (``"token_mean"``, ``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``,
            ``"seq_mean_token_sum_norm"``) or a dotted function path.
        max_length: ``L_max`` of ``"seq_mean_token_sum_norm"`` (default: ``rollout.sampling.max_new_tokens``).
        kl_loss_coef: ``c_KL`` of the KL-to-reference loss term (GRPO); 0: off.
        kl_loss_estimator: its per-token estimator (GRPO: ``"k3"``).
        kl: KL penalty in the reward (fixed or adaptive ``β``): per token for ``reinforce_pp``, summed over
            the response and subtracted from its reward for the group estimators; None: off.
        entropy_coef: entropy bonus ``c_H``.
        dynamic_sampling: DAPO dynamic sampling (None: off); single process only.
        overlong: filtering of, or a penalty on, responses cut at the token limit (None: off).
        **kwargs: the arguments of :class:`~alignlit.modules.online.OnlineModule` (reference,
            rollout, optim, max_grad_norm, tis_cap, ptx, prompt_filter, gold, val_sampling,
            reward_batch_size, dtype, curves_file, export_dir, lora, gradient_checkpointing,
            frozen_dtype, shard_frozen).
    """

    stage = "policy_gradient"
    curve_panels = (
        ("reward/raw", "reward (raw)"),
        ("reward/std", "reward std"),
        ("dynamic/informative_frac", "informative groups"),
        ("kl/ref", "KL(π‖π0) per response"),
        ("response/length", "response length (tokens)"),
        ("policy/entropy", "entropy (nats/token)"),
        ("policy/clip_frac_high", "clip fraction (high)"),
        ("policy/clip_frac_low", "clip fraction (low)"),
        ("mismatch/abs_mean", "rollout/trainer |Δ log p|"),
        ("val/gold", "held-out gold reward"),
        ("time/rollout_s", "rollout time (s)"),
        ("time/train_s", "train time (s)"),
    )

    def __init__(
        self,
        policy: str | TinyLlama,
        reward: str | Reward,
        advantage: str = "grpo",
        eps: float = 1e-6,
        gamma: float = 1.0,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        aggregation: str = "token_mean",
        max_length: int | None = None,
        kl_loss_coef: float = 0.0,
        kl_loss_estimator: KLKind = "k3",
        kl: KLPenalty | None = None,
        entropy_coef: float = 0.0,
        dynamic_sampling: DynamicSampling | None = None,
        overlong: Overlong | None = None,
        **kwargs,
    ):
        self.estimator = (
            advantage
            if advantage == PER_TOKEN
            else resolve_registered(advantage, ADVANTAGE_ESTIMATORS, "advantage estimator")
        )
        self.aggregate = resolve_registered(aggregation, LOSS_AGGREGATIONS, "loss aggregation")
        for name, value in (("eps", eps), ("kl_loss_coef", kl_loss_coef), ("entropy_coef", entropy_coef)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        if not (0 < clip_low <= 1 and clip_high > 0):
            raise ValueError(f"clip_low must be in (0, 1] and clip_high > 0, got {clip_low}, {clip_high}")
        if kl_loss_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_loss_estimator must be 'k1', 'k2' or 'k3', got {kl_loss_estimator!r}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
        loop = kwargs["rollout"] if kwargs.get("rollout") is not None else RolloutLoop()
        if loop.samples_per_prompt < 2 and (advantage != PER_TOKEN or dynamic_sampling is not None):
            raise ValueError(
                f"rollout.samples_per_prompt is {loop.samples_per_prompt}, but advantage {advantage!r}"
                + (" with dynamic sampling" if advantage == PER_TOKEN else "")
                + " compares the n >= 2 responses of a prompt (only 'reinforce_pp' works with n = 1)"
            )
        if (
            overlong is not None
            and overlong.mode == "penalty"
            and overlong.buffer > loop.sampling.max_new_tokens
        ):
            raise ValueError(
                f"overlong.buffer ({overlong.buffer}) must be <= rollout.sampling.max_new_tokens "
                f"({loop.sampling.max_new_tokens})"
            )
        super().__init__(policy, reward, **kwargs)
        self.save_hyperparameters(ignore=["reward", "rollout", "prompt_filter", "gold", "val_sampling"])
        self.kl, self.dynamic_sampling, self.overlong = kl, dynamic_sampling, overlong
        self.kl_ctl = kl.controller() if kl is not None else None
        self.max_length = max_length or self.rollout.sampling.max_new_tokens
        self.refill_generator = torch.Generator().manual_seed(self.rollout.seed)

    def setup(self, stage: str) -> None:
        world = self.trainer.world_size if self._trainer is not None else 1
        if self.dynamic_sampling is not None and world > 1:
            raise ValueError(
                f"dynamic_sampling keeps a different number of groups on each rank, so the {world} ranks "
                "would take different numbers of optimizer steps: run it in a single process"
            )
        super().setup(stage)

    # ------------------------------------------------------------------ sampling
    def _task_rewards(self, rollout: Rollout, scores: torch.Tensor) -> torch.Tensor:
        """(N,) the reward's scores plus DAPO's soft overlong penalty when it is on."""
        if self.overlong is None or self.overlong.mode != "penalty":
            return scores
        penalty = overlong_penalty(
            rollout.response_lengths, max_length=self.rollout.sampling.max_new_tokens,
            buffer=self.overlong.buffer, penalty=self.overlong.penalty,
        )  # fmt: skip
        return scores + penalty.to(scores.dtype)

    def _refill_prompts(self, count: int) -> list[str]:
        dm = self.trainer.datamodule if self._trainer is not None else None
        pool = getattr(dm, "train_prompts", None)
        if not pool:
            raise ValueError(
                "dynamic_sampling.max_tries > 0 needs a DataModule with `train_prompts` (e.g. PromptDataModule)"
            )
        picks = torch.randint(len(pool), (count,), generator=self.refill_generator)
        return [pool[i] for i in picks.tolist()]

    def sample_groups(self, experience: Experience) -> tuple[Rollout | None, torch.Tensor, dict[str, float]]:
        """The rollout's groups to train on and their rewards (N',): all of them, or with dynamic
        sampling the informative ones, refilled from further prompts (at most ``max_tries`` rounds)
        and cut to the batch's number of groups; None when no group is informative."""
        rollout, n = experience.rollout, experience.rollout.n
        rewards = self._task_rewards(rollout, experience.rewards)
        lengths = rollout.response_lengths.float()
        metrics = {
            "reward/raw": float(experience.rewards.mean()),
            "reward/std": float(experience.rewards.std(unbiased=False)),
            "response/length": float(lengths.mean()),
            "response/empty": float((lengths == 0).sum()),
            "response/truncated": float(sum(r == "length" for r in rollout.finish_reasons)),
        }
        if self.overlong is not None and self.overlong.mode == "penalty":
            metrics["reward/overlong_penalty"] = float((rewards - experience.rewards).mean())
        ds = self.dynamic_sampling
        groups = len(rollout) // n
        parts, grouped = [rollout], [rewards.view(groups, n)]  # (B, n) rewards per part
        keep = [informative_groups(grouped[0], atol=ds.atol if ds else 0.0).nonzero().flatten()]
        metrics["dynamic/informative_frac"] = len(keep[0]) / groups
        if ds is None:
            return rollout, rewards, metrics
        tries = extra = 0
        while sum(len(k) for k in keep) < groups and tries < ds.max_tries:
            seed = int(torch.randint(2**31 - 1, (1,), generator=self.refill_generator))
            prompts = self._refill_prompts(groups - sum(len(k) for k in keep))
            more = self.rollout.generate(
                prompts, sampling=dataclasses.replace(self.rollout.sampling, seed=seed)
            )
            parts.append(more)
            grouped.append(self._task_rewards(more, score_rollout(self.reward, more)).view(-1, n))
            keep.append(informative_groups(grouped[-1], atol=ds.atol).nonzero().flatten())
            tries, extra = tries + 1, extra + len(prompts)
        room, cut = groups, []
        for k in keep:  # the first `groups` informative groups
            cut.append(k[:room])
            room -= len(cut[-1])
        metrics.update(
            {
                "dynamic/tries": float(tries),
                "dynamic/extra_prompts": float(extra),
                "dynamic/groups": float(groups - room),
                "dynamic/full": float(room == 0),
            }
        )
        if room == groups:
            return None, rewards, metrics
        if tries == 0 and room == 0:  # every group informative
            return rollout, rewards, metrics
        kept_rewards = torch.cat([r[k].flatten() for r, k in zip(grouped, cut)])  # (N',)
        return select_groups(parts, cut, self.tokenizer.pad_token_id), kept_rewards, metrics

    # ------------------------------------------------------------------ experience and updates
    @torch.no_grad()
    def make_batch(self, rollout: Rollout, rewards: torch.Tensor) -> tuple[PGBatch | None, dict[str, float]]:
        """Old/reference log-probs, TIS weights and advantages of the groups to train on (N responses,
        rewards (N,)); responses without a loss token (empty, or cut with overlong filtering) are then
        dropped. None when no loss token is left (or fewer than 2 for ``reinforce_pp``).

        With several ranks these counts are taken over every rank (all of them skip the rollout or
        none), the batch statistics of the advantages are those of the global batch, and responses
        without a loss token stay in, masked out, so that every rank runs as many minibatch updates."""
        ids = tuple(
            t.to(self.device) for t in (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids)
        )
        full_mask = rollout.response_mask.to(self.device)  # (N, T)
        mask = full_mask
        metrics: dict[str, float] = {}
        if self.overlong is not None and self.overlong.mode == "filter":
            finished = overlong_mask(rollout.finish_reasons).to(self.device)  # (N,)
            mask = full_mask & finished[:, None]
            metrics["response/overlong_filtered"] = float((~finished).sum())
        old, is_weights, more = self.old_logprobs(rollout)  # (N, T)
        metrics.update(more)
        start = time.perf_counter()
        with eval_mode(self.reference):
            ref = response_logprobs(
                self.reference, *ids, full_mask, temperature=self.rollout.sampling.temperature
            )
        metrics["time/ref_logp_s"] = time.perf_counter() - start
        metrics["kl/ref"] = float(((old - ref) * full_mask).sum(-1).mean())  # k1 per response
        rewards = rewards.to(device=self.device, dtype=old.dtype)
        beta = self.kl_ctl.value if self.kl_ctl is not None else 0.0
        kl = (
            kl_estimate(old, ref, self.kl.estimator) * full_mask
            if self.kl is not None
            else torch.zeros_like(old)
        )
        if self.kl is not None:
            metrics.update({"kl/coef": beta, "kl/penalty": float((beta * kl).sum(-1).mean())})
        all_reduce = self.batch_all_reduce()  # None in one process
        if self.estimator == PER_TOKEN:
            if int(self.all_reduce_sum(mask.sum())) < 2:  # decided over every rank: all update or none
                return None, metrics
            advantages = reinforce_pp_returns(
                rewards, kl, mask, kl_coef=beta, gamma=self.hparams.gamma, all_reduce=all_reduce
            )  # (N, T)
        else:
            shaped = rewards - beta * kl.sum(-1)  # (N,)
            grouped = group_advantages(
                shaped.view(-1, rollout.n), estimator=self.estimator, eps=self.hparams.eps,
                all_reduce=all_reduce,
            )  # fmt: skip
            advantages = grouped.flatten()  # (N,)
        token_advantages = advantages[:, None].expand_as(old) if advantages.dim() == 1 else advantages
        keep = mask.any(-1)  # (N,)
        if int(self.all_reduce_sum(keep.sum())) == 0:  # no loss token on any rank
            return None, metrics
        if keep.any():
            metrics.update(
                {
                    "advantage/mean": float(masked_mean(token_advantages, mask)),
                    "advantage/std": float(token_advantages[mask].std(unbiased=False)),
                    "advantage/abs_max": float(token_advantages[mask].abs().max()),
                    "advantage/zero_frac": float(
                        ((token_advantages == 0) | ~mask).all(-1)[keep].float().mean()
                    ),
                }
            )
        batch = PGBatch(*ids, mask, old, ref, advantages, is_weights)
        if self._trainer is not None and self.trainer.world_size > 1:  # as many minibatch updates per rank
            return batch, metrics
        rows = keep.nonzero().flatten()
        return (batch.select(rows) if len(rows) < len(batch) else batch), metrics

    def policy_loss(self, mb: PGBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`~alignlit.losses.policy_gradient_loss` of the policy on a minibatch, plus ptx.

        A minibatch without a loss token (with several ranks, whose masked rows stay in) gives a zero
        policy term that still runs the policy's forward and reaches every weight with a zero gradient,
        so the rank takes part in the collectives of the update like the others."""
        hp = self.hparams
        scored = response_token_logprobs(
            self.policy, *mb.ids, temperature=self.rollout.sampling.temperature,
            with_entropy=True, entropy_grad=hp.entropy_coef > 0,
        )  # fmt: skip
        if not mb.mask.any():
            zero = torch.where(mb.mask, scored.logprobs, torch.zeros_like(scored.logprobs)).sum()
            metrics: dict[str, torch.Tensor] = {}
            return self.add_ptx(zero, metrics, what="policy-gradient loss"), metrics
        loss, metrics = policy_gradient_loss(
            scored.logprobs, mb.old_logprobs, mb.advantages, mb.mask,
            clip_low=hp.clip_low, clip_high=hp.clip_high, aggregation=self.aggregate, max_length=self.max_length,
            ref_logprobs=mb.ref_logprobs, kl_coef=hp.kl_loss_coef, kl_estimator=hp.kl_loss_estimator,
            entropy=scored.entropy, entropy_coef=hp.entropy_coef, is_weights=mb.is_weights,
        )  # fmt: skip
        return self.add_ptx(loss, metrics, what="policy-gradient loss"), metrics

    def train_on(self, experience: Experience) -> dict[str, float]:
        rollout, rewards, metrics = self.sample_groups(experience)
        if rollout is None:
            return {**metrics, **self.skip("every group's rewards are equal (no informative group)")}
        batch, more = self.make_batch(rollout, rewards)
        metrics.update(more)
        if batch is None:
            return {**metrics, **self.skip("no response token to learn from")}
        records = []
        for rows in self.rollout.minibatches(len(batch)):
            loss, loss_metrics = self.policy_loss(batch.select(rows))
            loss_metrics["grad_norm"] = self.update("policy", loss)
            records.append(loss_metrics)
        if self.kl_ctl is not None:  # the mean KL over the global batch, counting its responses
            self.update_kl_controller(self.kl_ctl, metrics["kl/ref"] * len(rollout), len(rollout))
        metrics.update({f"policy/{k}": v for k, v in mean_metrics(records).items()})
        return metrics

    # ------------------------------------------------------------------ online state
    def online_state_dict(self) -> dict[str, Any]:
        return {
            "kl_ctl": self.kl_ctl.state_dict() if self.kl_ctl is not None else None,
            "refill_generator": self.refill_generator.get_state(),
        }

    def load_online_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl_ctl is not None:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.refill_generator.set_state(state["refill_generator"])
