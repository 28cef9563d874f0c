"""An accepted experience to a :class:`~alignlit.modules.trajectory.Trajectory`: the trainer side of every
online stage.

A :class:`TrajectoryMaker` holds the policy, the frozen reference ``π_0`` and the settings that turn the
samples into what a stage's loss reads: the loss mask (DAPO's overlong filter), the task rewards, and
when the stage ``needs_logprobs`` the old log-probs (recomputed, or the engine's ``μ``), the reference's,
the per-token KL with its controller's ``β``, the rollout/trainer mismatch and the rollout correction's
importance weights::

    trajectory, metrics = maker.make(experience, version=v, device=device)

The log-probs of sampled tokens are computed by :meth:`TrajectoryMaker.logprobs` and nowhere else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch

from alignlit.models.forward import response_logprobs
from alignlit.models.modes import eval_mode
from alignlit.modules.micro_batches import forward_in_budget
from alignlit.modules.trajectory import Trajectory
from alignlit.ops import kl_estimate, logprob_mismatch, masked_mean, overlong_mask
from alignlit.ops.kl import AdaptiveKLController, FixedKLController, KLKind
from alignlit.ops.rollout_correction import correction_metrics, resolve_rollout_correction
from alignlit.rollout.base import Experience, Rollout


def resolve_correction(
    tis_cap: float | None,
    name: str | None,
    args: dict[str, Any] | None,
    old_logprobs: str,
) -> Callable[..., torch.Tensor] | None:
    """The rollout correction an online stage's arguments ask for (``tis_cap: C`` is ``"tis"`` with ``{cap:
    C}``; None: off), checked against ``old_logprobs`` (``"behaviour"`` takes ``μ`` as ``π_old``: nothing to
    correct)."""
    if tis_cap is not None and tis_cap < 1:
        raise ValueError(f"tis_cap must be >= 1 or None, got {tis_cap}")
    if tis_cap is not None and name is not None:
        raise ValueError(
            f"give tis_cap ({tis_cap}) or rollout_correction ({name!r}), not both: tis_cap C is "
            "rollout_correction 'tis' with rollout_correction_args {cap: C}"
        )
    if args is not None and name is None:
        raise ValueError("rollout_correction_args given without rollout_correction (a registered name)")
    if tis_cap is not None:
        name, args = "tis", {"cap": tis_cap}
    correction = resolve_rollout_correction(name, args) if name else None
    if old_logprobs not in ("recompute", "behaviour") or (
        old_logprobs == "behaviour" and correction is not None
    ):
        raise ValueError(
            f"old_logprobs must be 'recompute' or 'behaviour' (then without tis_cap or rollout_correction: "
            f"π_old is μ), got {old_logprobs!r} with rollout correction {name!r}"
        )
    return correction


class TrajectoryMaker:
    """Builds the :class:`Trajectory` of an accepted experience (module docstring).

    Args:
        policy: the trained policy (``π_old`` when recomputed).
        reference: the frozen reference ``π_0`` (None: a stage that reads no log-probs).
        temperature: the rollout's sampling temperature (log-probs are of the tempered distribution).
        task_rewards: ``task_rewards(rollout, scores)``, the rewards the stage trains on
            (:meth:`~alignlit.rollout.collector.Collector.task_rewards`).
        needs_logprobs: whether the stage trains on the sampled tokens' old and reference log-probs.
        old_logprobs: ``"recompute"`` ``π_old`` with the policy, or take the engine's ``"behaviour"`` ``μ``.
        overlong_filter: leave the responses cut at the token limit out of the loss mask (DAPO).
        kl_estimator: the per-token KL estimator of the reward penalty (None: no penalty).
        kl_ctl: the penalty's ``β`` controller (the stage's; read, never updated here).
        correction: the rollout correction weighting each token's policy loss, as
            :func:`~alignlit.ops.rollout_correction.resolve_rollout_correction` binds it (None: off).
        token_budget: the no-grad passes (:meth:`forward`) run over micro-batches of rows holding at most this
            many padded tokens (``minibatches.token_budget``; None: one pass over every row).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        reference: torch.nn.Module | None,
        *,
        temperature: float,
        task_rewards: Callable[[Rollout, torch.Tensor], torch.Tensor],
        needs_logprobs: bool = True,
        old_logprobs: Literal["recompute", "behaviour"] = "recompute",
        overlong_filter: bool = False,
        kl_estimator: KLKind | None = None,
        kl_ctl: FixedKLController | AdaptiveKLController | None = None,
        correction: Callable[..., torch.Tensor] | None = None,
        token_budget: int | None = None,
    ):
        self.policy, self.reference, self.temperature = policy, reference, temperature
        self.task_rewards, self.needs_logprobs, self.old_logprobs = task_rewards, needs_logprobs, old_logprobs
        self.overlong_filter, self.kl_estimator, self.kl_ctl = overlong_filter, kl_estimator, kl_ctl
        self.correction, self.token_budget = correction, token_budget

    @torch.no_grad()
    def forward(
        self, fn: Callable[..., torch.Tensor], ids: tuple[torch.Tensor, ...], *, device: torch.device
    ) -> torch.Tensor:
        """(N, T) ``fn(prompt_ids, prompt_mask, response_ids, response_mask)`` (0 on padding) of the rows
        ``ids`` on ``device``, over token-budget micro-batches with ``token_budget``
        (:func:`~alignlit.modules.micro_batches.forward_in_budget`)."""
        return forward_in_budget(fn, tuple(t.to(device) for t in ids), self.token_budget)

    @torch.no_grad()
    def logprobs(
        self,
        model: torch.nn.Module,
        ids: tuple[torch.Tensor, ...],
        *,
        device: torch.device,
        temperature: float | None = None,
    ) -> torch.Tensor:
        """(N, T) teacher-forced log-probs of the response tokens ``ids = (prompt_ids, prompt_mask,
        response_ids, response_mask)`` under ``model`` in eval mode (default temperature: the rollout's)."""
        temperature = self.temperature if temperature is None else temperature
        with eval_mode(model):
            return self.forward(
                partial(response_logprobs, model, temperature=temperature), ids, device=device
            )

    @torch.no_grad()
    def make(
        self, experience: Experience, *, version: int, device: torch.device
    ) -> tuple[Trajectory, dict[str, float]]:
        """The :class:`Trajectory` of an accepted experience, trained by the policy at ``version``, and its
        metrics: the loss mask (without the responses cut at the limit under overlong filtering), the task
        rewards, and when the stage ``needs_logprobs`` the old and reference log-probs (``time/old_logp_s``,
        ``time/ref_logp_s``), the rollout/trainer mismatch (``mismatch/*``, by staleness ``async/mismatch_kl_s*``)
        and the rollout correction's weights (``rollout_correction/*``), ``kl/ref`` (``k1`` summed over each
        response, averaged) and, with a KL penalty, the per-token estimate ``kl`` (``kl/coef``, ``kl/token``,
        ``kl/penalty``)."""
        rollout = experience.rollout
        attention = rollout.response_mask.to(device)  # (N, T)
        action = attention if rollout.action_mask is None else rollout.action_mask.to(device)  # (N, T)
        loss_mask = action
        metrics: dict[str, float] = {}
        if self.overlong_filter:
            finished = overlong_mask(rollout.finish_reasons).to(device)  # (N,)
            loss_mask = action & finished[:, None]
            metrics["response/overlong_filtered"] = float((~finished).sum())
        traj = Trajectory(
            prompts=list(rollout.prompts), texts=list(rollout.texts),
            finish_reasons=list(rollout.finish_reasons), n=rollout.n,
            group=rollout.prompt_index.to(device), version=experience.versions.to(device),
            prompt_ids=rollout.prompt_ids.to(device), prompt_mask=rollout.prompt_mask.to(device),
            response_ids=rollout.response_ids.to(device), attention_mask=attention, action_mask=action,
            loss_mask=loss_mask, behaviour_logprobs=rollout.logprobs.to(device),
            scores=experience.rewards.to(device),
            rewards=self.task_rewards(rollout, experience.rewards).to(device),
            turn_rewards=None if rollout.turn_rewards is None else rollout.turn_rewards.to(device),
        )  # fmt: skip
        if not self.needs_logprobs:
            return traj, metrics
        behaviour = traj.behaviour_logprobs.to(torch.get_default_dtype())
        if self.old_logprobs == "behaviour":  # the engine's μ is π_old: no recompute (verl, prime-rl)
            traj.old_logprobs = old = behaviour * action
        else:  # the trainer recomputes π_old (the proximal policy of decoupled PPO with tis_cap; AReaL)
            start = time.perf_counter()
            traj.old_logprobs = old = self.logprobs(self.policy, traj.ids, device=device)  # (N, T)
            metrics["time/old_logp_s"] = time.perf_counter() - start
        start = time.perf_counter()
        traj.ref_logprobs = ref = self.logprobs(self.reference, traj.ids, device=device)  # (N, T)
        metrics["time/ref_logp_s"] = time.perf_counter() - start
        traj.rewards, behaviour = traj.rewards.to(old.dtype), behaviour.to(old.dtype)
        if action.any():
            metrics["response/ppl"] = float(torch.exp(-masked_mean(old, action)))
        if action.any() and self.old_logprobs == "recompute":
            metrics.update(self.mismatch(traj, behaviour, version))
        metrics["kl/ref"] = float(((old - ref) * action).sum(-1).mean())  # k1 per response
        if self.kl_estimator is not None:
            traj.kl = kl_estimate(old, ref, self.kl_estimator) * action  # (N, T)
            beta = self.kl_ctl.value
            metrics.update(
                {"kl/coef": beta, "kl/penalty": float((beta * traj.kl).sum(-1).mean())}
                | ({"kl/token": float(masked_mean(traj.kl, action))} if action.any() else {})
            )
        return traj, metrics

    def mismatch(self, traj: Trajectory, behaviour: torch.Tensor, version: int) -> dict[str, float]:
        """The rollout/trainer mismatch of the recomputed ``π_old`` against the engine's ``μ`` (overall and by
        staleness against ``version``), and the rollout correction's weights (set on ``traj``)."""
        old, action = traj.old_logprobs, traj.action_mask
        mismatch = logprob_mismatch(old, behaviour, action)
        metrics = {f"mismatch/{k.removeprefix('mismatch_')}": float(v) for k, v in mismatch.items()}
        staleness = version - traj.version  # (N,)
        if int(staleness.max()) > 0:  # the mismatch of each staleness: weights drift plus numerics
            for lag in sorted(set(staleness.tolist())):
                rows = action & (staleness == lag)[:, None]
                if rows.any():
                    metrics[f"async/mismatch_kl_s{lag}"] = float(
                        logprob_mismatch(old, behaviour, rows)["mismatch_kl"]
                    )
        if self.correction is not None:  # tis_cap is the "tis" entry
            traj.is_weights = self.correction(old, behaviour, action)  # (N, T), detached
            metrics["mismatch/is_weight_mean"] = float(traj.is_weights[action].mean())
            cap = self.correction.args.get("cap") if self.correction.name in ("tis", "seq_tis") else None
            stats = correction_metrics(traj.is_weights, action, cap=cap)
            metrics.update({f"rollout_correction/{k}": v for k, v in stats.items()})
        return metrics
