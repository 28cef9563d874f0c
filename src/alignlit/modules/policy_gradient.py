"""Critic-free policy gradients on the online base: GRPO, Dr. GRPO, RLOO, REINFORCE++(-baseline), DAPO.

One ``training_step`` is one rollout (algorithms.md §10): ``n`` responses per prompt are sampled and
scored (with DAPO's dynamic sampling and overlong handling, options of the online base), advantages
come from a pure estimator (:func:`~alignlit.ops.group_advantages` or
:func:`~alignlit.ops.reinforce_pp_returns`), then ``minibatches.epochs`` passes of minibatch updates of
:func:`~alignlit.losses.policy_gradient_loss`. No critic is built: the policy is the only trained model.

Under several data-parallel ranks each rank samples the groups of its own prompts and the rollout is
their union, the global batch: statistics over the whole batch (REINFORCE++'s whitening,
REINFORCE++-baseline's standard deviation) and the adaptive KL controller are taken over it, whether
a rollout is skipped is decided over every rank, and responses without a loss token stay in (masked),
so every rank runs as many updates as the others.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch

from alignlit.checks import resolve_registered
from alignlit.hub import Pretrained
from alignlit.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregation_share,
    generalized_jsd_loss,
    policy_gradient_loss,
)
from alignlit.models.forward import response_logits, response_token_logprobs, scored_from_logits
from alignlit.models.loading import load_policy
from alignlit.models.scoring import check_temperature
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import frozen
from alignlit.modules.online import OnlineModule
from alignlit.modules.online_parts import mean_metrics
from alignlit.modules.trajectory import Trajectory
from alignlit.ops import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_ADVANTAGE_ESTIMATORS,
    group_advantages,
    kl_penalized_rewards,
    masked_mean,
    token_advantages,
)
from alignlit.ops.kl import KLKind
from alignlit.rollout.reward_protocol import Reward

__all__ = ["PolicyGradientModule"]


class PolicyGradientModule(OnlineModule):
    """Critic-free policy gradients on the online base (algorithms.md §10), every variant a config key.

    The arguments shared by every online stage (policy, reward, reference, rollout, minibatches, kl,
    optim, ptx, prompt filter, TIS, DAPO's dynamic sampling and overlong handling, validation) are those
    of :class:`~alignlit.modules.online.OnlineModule`; ``rollout.samples_per_prompt`` is the group size
    ``n`` (at least 2, except for a per-token estimator). With a ``kl`` penalty, ``β·kl_t`` is in the token
    rewards of a per-token estimator, and ``β·Σ_t kl_t`` is subtracted from the sequence reward of a
    group estimator.

    Args:
        policy: see :class:`~alignlit.modules.online.OnlineModule`.
        reward: see :class:`~alignlit.modules.online.OnlineModule`.
        advantage: a group estimator, one advantage per response from its group's rewards (``"grpo"``,
            ``"dr_grpo"``, ``"rloo"``, ``"reinforce_pp_baseline"``: :data:`alignlit.ops.ADVANTAGE_ESTIMATORS`),
            or a per-token estimator without a critic (``"reinforce_pp"``: REINFORCE++ returns whitened
            over the batch; ``"returns"``: :data:`alignlit.ops.TOKEN_ADVANTAGE_ESTIMATORS`), or the dotted
            path of a registered function.
        eps: ``ε`` added to standard deviations by the estimators.
        gamma: discount ``γ`` of a per-token estimator's returns.
        clip_low: ``ε_low``, the ratio's lower clip ``1 - ε_low``.
        clip_high: ``ε_high``, the ratio's upper clip ``1 + ε_high`` (DAPO's clip-higher: 0.28).
        aggregation: token-loss reduction, a name in :data:`alignlit.losses.LOSS_AGGREGATIONS`
            (``"token_mean"``, ``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``,
            ``"seq_mean_token_sum_norm"``) or a dotted function path.
        policy_loss: the per-token policy term, a name in :data:`alignlit.losses.POLICY_LOSSES`
            (``"ppo_clip"``, ``"dual_clip"``, ``"gspo"``, ``"cispo"``) or a dotted function path.
        policy_loss_args: its options (``dual_clip``: ``{clip_ratio_c: 3.0}``).
        max_length: ``L_max`` of ``"seq_mean_token_sum_norm"`` (default: ``rollout.sampling.max_new_tokens``).
        kl_loss_coef: ``c_KL`` of the KL-to-reference loss term (GRPO); 0: off.
        kl_loss_estimator: its per-token estimator (GRPO: ``"k3"``).
        entropy_coef: entropy bonus ``c_H``.
        teacher: on-policy distillation: a frozen teacher (directory or hub id, same tokenizer as the policy)
            scores each sampled token, and ``teacher_coef · (log π_T(y_t) - log π_θold(y_t))`` (the negative
            per-token reverse KL to the teacher) is added to every token's advantage, on top of
            ``task_coef`` times the task advantage (``task_coef: 0``: pure distillation, any group size).
            Logged: ``distill/reverse_kl`` (per token) and ``distill/reverse_kl_seq`` (per response).
        teacher_coef: the weight of the teacher's per-token signal.
        task_coef: the weight of the task advantage (from ``reward``) when distilling.
        teacher_dtype: the teacher's dtype (default: ``frozen_dtype``, else ``dtype``).
        jsd_coef: weight of GKD's generalised JSD between the teacher's and the student's full next-token
            distributions at every sampled response position (:func:`~alignlit.losses.generalized_jsd_loss`,
            reduced by ``aggregation``), added to the loss of every minibatch; 0: off. The student's and the
            teacher's (B, T, V) logits of a minibatch are held, not the fused head's chunks. Logged:
            ``policy/jsd``.
        jsd_beta: GKD's ``β``: 0 the forward KL ``KL(π_T ‖ π_θ)``, 1 the reverse KL, 0.5 the symmetric JSD.
        **kwargs: the arguments of :class:`~alignlit.modules.online.OnlineModule`.
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
        ("distill/reverse_kl", "reverse KL to the teacher (per token)"),
        ("val/gold", "held-out gold reward"),
        ("time/rollout_s", "rollout time (s)"),
        ("time/train_s", "train time (s)"),
    )

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        reward: str | Reward,
        advantage: str = "grpo",
        eps: float = 1e-6,
        gamma: float = 1.0,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        aggregation: str = "token_mean",
        policy_loss: str = "ppo_clip",
        policy_loss_args: dict[str, Any] | None = None,
        max_length: int | None = None,
        kl_loss_coef: float = 0.0,
        kl_loss_estimator: KLKind = "k3",
        entropy_coef: float = 0.0,
        teacher: str | None = None,
        teacher_coef: float = 1.0,
        task_coef: float = 1.0,
        teacher_dtype: str | None = None,
        jsd_coef: float = 0.0,
        jsd_beta: float = 0.5,
        **kwargs,
    ):
        self.estimator = resolve_registered(
            advantage, {**ADVANTAGE_ESTIMATORS, **TOKEN_ADVANTAGE_ESTIMATORS}, "advantage estimator"
        )
        self.per_token = self.estimator in TOKEN_ADVANTAGE_ESTIMATORS or (
            callable(self.estimator) and self.estimator in TOKEN_ADVANTAGE_ESTIMATORS.values()
        )
        if self.estimator == "gae":
            raise ValueError("advantage 'gae' needs a critic's values: train it with PPOModule")
        self.aggregate = resolve_registered(aggregation, LOSS_AGGREGATIONS, "loss aggregation")
        self.policy_loss_fn = resolve_registered(policy_loss, POLICY_LOSSES, "policy loss")
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
        if teacher is None and (
            teacher_coef != 1.0 or task_coef != 1.0 or teacher_dtype is not None or jsd_coef != 0.0
        ):
            raise ValueError(
                "teacher_coef, task_coef, teacher_dtype and jsd_coef weigh on-policy distillation: set a teacher"
            )
        if not (jsd_coef >= 0 and 0 <= jsd_beta <= 1):
            raise ValueError(f"jsd_coef must be >= 0 and jsd_beta in [0, 1], got {jsd_coef}, {jsd_beta}")
        if not (teacher_coef >= 0 and task_coef >= 0):
            raise ValueError(f"teacher_coef and task_coef must be >= 0, got {teacher_coef}, {task_coef}")
        super().__init__(policy, reward, **kwargs)
        self.teacher_coef, self.task_coef = float(teacher_coef), float(task_coef)
        self.teacher = self.load_teacher(teacher, teacher_dtype) if teacher is not None else None
        distill_only = self.teacher is not None and self.task_coef == 0
        if self.rollout.samples_per_prompt < 2 and not self.per_token and not distill_only:
            raise ValueError(
                f"rollout.samples_per_prompt is {self.rollout.samples_per_prompt}, but advantage {advantage!r} "
                "compares the n >= 2 responses of a prompt (a per-token estimator such as 'reinforce_pp' "
                "works with n = 1)"
            )
        self.min_loss_tokens = 2 if self.per_token else 1  # REINFORCE++'s whitening needs two values
        self.max_length = max_length or self.rollout.sampling.max_new_tokens
        if self.updates.plan.token_budget is not None:  # the aggregation's unit shares its micro-batches
            one = torch.ones(1, 1, dtype=torch.bool)
            try:
                aggregation_share(self.aggregate, one, one)
            except ValueError as err:
                raise ValueError(
                    f"minibatches.token_budget with aggregation {aggregation!r}: {err}"
                ) from None

    @torch.no_grad()
    def advantages(self, trajectory: Trajectory) -> dict[str, float]:
        """The advantages of ``trajectory``'s samples: per token (``reinforce_pp``: the KL penalty in the
        token rewards, returns whitened over the global batch) or one per sample from its group's rewards
        minus ``β·Σ_t kl_t``; returns their statistics over the loss tokens."""
        mask, kl = trajectory.loss_mask, trajectory.kl
        beta = self.kl_ctl.value if self.kl_ctl is not None else 0.0
        kl = kl if kl is not None else torch.zeros_like(trajectory.old_logprobs)
        all_reduce = self.batch_all_reduce()  # None in one process
        if self.per_token:
            token_rewards = kl_penalized_rewards(
                trajectory.rewards, kl, mask, kl_coef=beta, turn_rewards=trajectory.turn_rewards
            )  # (N, T): an environment's turn rewards where they were given
            advantages, _ = token_advantages(
                token_rewards, mask, estimator=self.estimator, gamma=self.hparams.gamma, all_reduce=all_reduce
            )  # (N, T)
        else:
            shaped = trajectory.rewards - beta * kl.sum(-1)  # (N,)
            advantages = group_advantages(
                shaped.view(-1, trajectory.n), estimator=self.estimator, eps=self.hparams.eps,
                all_reduce=all_reduce,
            ).flatten()  # fmt: skip
        distill = self.distill_advantages(trajectory) if self.teacher is not None else {}
        if self.teacher is not None:
            task = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
            signal = (trajectory.teacher_logprobs - trajectory.old_logprobs) * mask  # (N, T)
            advantages = (self.task_coef * task + self.teacher_coef * signal) * mask
        trajectory.advantages = advantages
        keep = mask.any(-1)  # (N,)
        if not keep.any():
            return {}
        tokens = advantages[:, None].expand_as(mask) if advantages.dim() == 1 else advantages  # (N, T)
        return distill | {
            "advantage/mean": float(masked_mean(tokens, mask)),
            "advantage/std": float(tokens[mask].std(unbiased=False)),
            "advantage/abs_max": float(tokens[mask].abs().max()),
            "advantage/zero_frac": float(((tokens == 0) | ~mask).all(-1)[keep].float().mean()),
        }

    # ------------------------------------------------------------------ on-policy distillation
    def load_teacher(self, teacher: str, dtype: str | None) -> torch.nn.Module:
        """The frozen teacher (its own dtype, default the frozen models'); its tokenizer must be the policy's."""
        model, tokenizer = load_policy(
            teacher, dtype=dtype or self.hparams.get("frozen_dtype") or self.hparams.dtype
        )
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(
                f"teacher {teacher!r} has another tokenizer than the policy {self.hparams.policy!r} ({len(tokenizer)} vs "
                f"{len(self.tokenizer)} tokens, or the same size with other ids): on-policy distillation scores the "
                "student's tokens under the teacher, so both must share one vocabulary"
            )
        return frozen(model)

    @torch.no_grad()
    def distill_advantages(self, trajectory: Trajectory) -> dict[str, float]:
        """The teacher's per-token signal ``log π_T(y_t) - log π_θold(y_t)`` (the negative per-token reverse KL
        on the student's samples): the teacher's log-probs go to ``trajectory.teacher_logprobs``; returns the
        reverse-KL metrics."""
        start = time.perf_counter()
        teacher = self.logprobs(self.teacher, trajectory.ids)  # (N, T)
        elapsed = time.perf_counter() - start
        mask = trajectory.loss_mask
        signal = (teacher - trajectory.old_logprobs) * mask  # (N, T)
        trajectory.teacher_logprobs = teacher
        if not mask.any():
            return {"time/teacher_logp_s": elapsed}
        return {
            "distill/reverse_kl": float(masked_mean(-signal, mask)),  # per token, k1 on the student's samples
            "distill/reverse_kl_seq": float((-signal).sum(-1)[mask.any(-1)].mean()),
            "time/teacher_logp_s": elapsed,
        }

    def frozen_prefixes(self) -> list[str]:
        return super().frozen_prefixes() + (["teacher."] if self.teacher is not None else [])

    def policy_loss(
        self, mb: Trajectory, *, ptx: bool = True
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`~alignlit.losses.policy_gradient_loss` of the policy on a minibatch, plus ptx (``ptx``).

        A minibatch without a loss token (with several ranks, whose masked rows stay in) gives a zero
        policy term that still runs the policy's forward and reaches every weight with a zero gradient,
        so the rank takes part in the collectives of the update like the others."""
        hp = self.hparams
        temperature = self.rollout.sampling.temperature
        logits = response_logits(self.policy, *mb.ids) if hp.jsd_coef > 0 else None  # (B, T, V)
        if logits is not None:  # GKD: one forward gives the full distributions and the token log-probs
            scored = scored_from_logits(
                logits, mb.ids[2], mb.ids[3], temperature=temperature, with_entropy=True,
                entropy_grad=hp.entropy_coef > 0,
            )  # fmt: skip
        else:
            scored = response_token_logprobs(
                self.policy,
                *mb.ids,
                temperature=temperature,
                with_entropy=True,
                entropy_grad=hp.entropy_coef > 0,
            )
        if not mb.loss_mask.any():
            zero = torch.where(mb.loss_mask, scored.logprobs, torch.zeros_like(scored.logprobs)).sum()
            metrics: dict[str, torch.Tensor] = {}
            return (self.add_ptx(zero, metrics, what="policy-gradient loss") if ptx else zero), metrics
        loss, metrics = policy_gradient_loss(
            scored.logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask,
            clip_low=hp.clip_low, clip_high=hp.clip_high, aggregation=self.aggregate, max_length=self.max_length,
            policy_loss=self.policy_loss_fn, policy_loss_args=hp.policy_loss_args,
            ref_logprobs=mb.ref_logprobs, kl_coef=hp.kl_loss_coef, kl_estimator=hp.kl_loss_estimator,
            entropy=scored.entropy, entropy_coef=hp.entropy_coef, is_weights=mb.is_weights,
        )  # fmt: skip
        if logits is not None:
            loss = loss + hp.jsd_coef * self.jsd_term(logits, mb, metrics)
        return (self.add_ptx(loss, metrics, what="policy-gradient loss") if ptx else loss), metrics

    def jsd_term(
        self, logits: torch.Tensor, mb: Trajectory, metrics: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """GKD's generalised JSD of the minibatch (the teacher's logits computed here, not kept in the
        trajectory: ``N·T·V`` floats), reduced by the stage's aggregation; its token mean goes to ``metrics``."""
        with torch.no_grad():
            teacher = response_logits(self.teacher, *mb.ids)  # (B, T, V)
        if teacher.shape != logits.shape:
            raise ValueError(
                f"teacher logits {tuple(teacher.shape)} and student logits {tuple(logits.shape)} differ: the "
                "generalised JSD compares the full vocabularies, so both models must have the same output size"
            )
        jsd, jsd_metrics = generalized_jsd_loss(
            logits, teacher, mb.loss_mask, beta=self.hparams.jsd_beta,
            temperature=check_temperature(self.rollout.sampling.temperature),
            aggregation=self.aggregate, max_length=self.max_length,
        )  # fmt: skip
        metrics.update(jsd_metrics)
        return jsd

    def train_on(self, trajectory: Trajectory) -> dict[str, float]:
        metrics = self.advantages(trajectory)
        batch, records = self.trainable(trajectory), []
        loss_fn, what = partial(self.policy_loss, ptx=False), "policy-gradient loss"
        for rows in self.minibatches(len(batch)):
            mb = batch.select(rows)
            records.append(
                self.update_on("policy", mb, loss_fn, aggregation=self.aggregate, what=what, ptx=True)
            )
        metrics.update({f"policy/{k}": v for k, v in mean_metrics(records).items()})
        return metrics
