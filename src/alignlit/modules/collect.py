"""Prompts to a :class:`~alignlit.modules.trajectory.Trajectory`, once for every online stage.

:class:`TrajectoryBuilder` holds the methods :class:`~alignlit.modules.online.OnlineModule` takes
from this base: :meth:`~TrajectoryBuilder.collect` (the rollout side: sync, generate and score through
the :class:`~alignlit.rollout.RolloutLoop`, DAPO's overlong penalty and dynamic sampling) and
:meth:`~TrajectoryBuilder.make_trajectory` (the trainer side: the old and reference log-probs, the
per-token KL, the rollout/trainer mismatch and its importance weights, the loss mask). The log-probs
of sampled tokens are computed by :meth:`~TrajectoryBuilder.logprobs` and nowhere else.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, ClassVar

import torch

from alignlit.data.sampler import ResumableSampler
from alignlit.models.forward import response_logprobs
from alignlit.models.modes import eval_mode
from alignlit.modules.trajectory import Trajectory
from alignlit.ops import (
    informative_groups,
    kl_estimate,
    length_reward_correlation,
    logprob_mismatch,
    masked_mean,
    overlong_mask,
    overlong_penalty,
)
from alignlit.ops.rollout_correction import correction_metrics
from alignlit.rollout.base import Experience, Rollout, select_groups


def sample_metrics(rollout: Rollout, scores: torch.Tensor) -> dict[str, float]:
    """Rewards and lengths of a rollout's samples: mean and spread of the reward, token and character
    lengths, empty and truncated responses, and with ``n >= 2`` samples per prompt the per-prompt
    reward-length correlation (:func:`~alignlit.ops.length_reward_correlation`)."""
    tokens = rollout.response_lengths.float()  # (N,)
    metrics = {
        "reward/raw": float(scores.mean()),
        "reward/std": float(scores.std(unbiased=False)),
        "response/length": float(tokens.mean()),
        "response/chars": sum(map(len, rollout.texts)) / len(rollout),
        "response/empty": float((tokens == 0).sum()),
        "response/truncated": float(sum(r == "length" for r in rollout.finish_reasons)),
    }
    if rollout.n >= 2:
        corr, used, excluded = length_reward_correlation(
            scores.view(-1, rollout.n), tokens.view(-1, rollout.n)
        )
        metrics.update({"length/corr_prompts": float(used), "length/corr_excluded": float(excluded)})
        if used:
            metrics["length/reward_corr"] = corr
    return metrics


def experience_state(result: tuple[Experience | None, dict[str, float]]) -> dict[str, Any]:
    """A pipeline result ``(experience, metrics)`` as plain tensors, lists and numbers (checkpoints)."""
    experience, metrics = result
    if experience is None:
        return {"experience": None, "metrics": dict(metrics)}
    rollout = {f.name: getattr(experience.rollout, f.name) for f in dataclasses.fields(experience.rollout)}
    return {
        "experience": {"rollout": rollout, "rewards": experience.rewards, "versions": experience.versions},
        "metrics": dict(metrics),
    }


def load_experience(state: dict[str, Any]) -> tuple[Experience | None, dict[str, float]]:
    """The inverse of :func:`experience_state`."""
    saved = state["experience"]
    if saved is None:
        return None, dict(state["metrics"])
    return Experience(Rollout(**saved["rollout"]), saved["rewards"], saved["versions"]), dict(
        state["metrics"]
    )


class TrajectoryBuilder:
    """Collection and trajectory building of :class:`~alignlit.modules.online.OnlineModule` (a
    LightningModule with ``rollout``, ``reward``, ``policy``, ``reference``, ``kl``/``kl_ctl``,
    ``correction``, ``overlong``, ``dynamic_sampling``, ``policy_version`` and ``refill_generator``)."""

    needs_logprobs: ClassVar[bool] = True
    """Whether the stage trains on the sampled tokens' old and reference log-probs (online DPO and RRHF
    re-read the texts; DPO computes none)."""

    @torch.no_grad()
    def logprobs(
        self, model: torch.nn.Module, ids: tuple[torch.Tensor, ...], *, temperature: float | None = None
    ) -> torch.Tensor:
        """(N, T) teacher-forced log-probs of the response tokens ``ids = (prompt_ids, prompt_mask,
        response_ids, response_mask)`` under ``model`` in eval mode (default temperature: the rollout's)."""
        if temperature is None:
            temperature = self.rollout.sampling.temperature
        with eval_mode(model):
            return response_logprobs(model, *(t.to(self.device) for t in ids), temperature=temperature)

    # ------------------------------------------------------------------ the prompts
    def check_positions(self, prompts: list[str], what: str) -> None:
        """Refuse, before anything is generated, prompts that leave too few of the policy's positions for
        ``max_new_tokens`` (``rollout.max_episode_tokens`` with an environment: an episode's response side;
        transformers would only warn, then index past its position table), naming the field that sets the
        length and only advice that can be followed (no limit below 1)."""
        limit = getattr(self.policy.config, "max_position_embeddings", None)
        if limit is None or not prompts:
            return
        samplings = {"rollout.sampling": self.rollout.sampling, "val_sampling": self.val_sampling}
        name, new = max(
            ((f"{k}.max_new_tokens", s.max_new_tokens) for k, s in samplings.items() if s is not None),
            key=lambda item: item[1],
        )
        if getattr(self.rollout, "environment", None) is not None:  # an episode's response side
            name, new = "rollout.max_episode_tokens", self.rollout.max_episode_tokens
        lengths = [len(ids) for ids in self.tokenizer(list(prompts))["input_ids"]]
        row = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[row] + new <= limit:
            return
        short = name.rsplit(".", 1)[-1]
        head = (
            f"{what} prompt {row} ({prompts[row][:40]!r}...) has {lengths[row]} tokens: with {short} {new} "
            f"({name}) a sample needs {lengths[row] + new} positions, but the policy has {limit} "
            "(max_position_embeddings). "
        )
        fixes = []
        if new < limit:
            fixes.append(
                f"set the DataModule's max_prompt_length to at most {limit - new} (longer prompts are then "
                "truncated from the left and counted)"
            )
        if lengths[row] < limit:
            fixes.append(f"lower {name} to at most {limit - lengths[row]}")
        if new >= limit:
            head += f"{name} {new} alone needs every position the policy has. "
        advice = " or ".join(fixes) or "shorten the prompts"
        raise ValueError(head + advice[0].upper() + advice[1:])

    def prepare_prompts(self, dm) -> None:
        """At the start of fit: check the DataModule's prompts against the policy's positions
        (:meth:`check_positions`) and apply the prompt filter, or restore what it kept from the checkpoint."""
        prompts = getattr(dm, "train_prompts", None)
        self.check_positions(prompts or [], "training")
        self.check_positions(getattr(dm, "val_prompts", None) or [], "validation")
        if self.prompt_filter is None:
            return
        if prompts is None:
            raise ValueError("prompt_filter needs a DataModule with `train_prompts` (e.g. PromptDataModule)")
        if self.kept_prompts is not None:  # restored from the checkpoint: the same prompts, not a re-run
            missing = set(self.kept_prompts) - set(prompts)
            if missing:
                raise ValueError(
                    f"the checkpoint's prompt filter kept {len(missing)} prompt(s) the training data does not "
                    f"hold, e.g. {next(iter(missing))!r}: resume with the data the run started with"
                )
            dm.train_prompts = list(self.kept_prompts)
            print(
                f"alignlit: prompt filter: the {len(prompts)} training prompts kept at the start, from the checkpoint"
            )
            return

        def generate(batch, n, sampling):
            return self.rollout.generate(batch, version=self.policy_version, n=n, sampling=sampling)

        kept, report = self.prompt_filter(
            generate, self.reward, prompts, default_sampling=self.rollout.sampling
        )
        if not kept:
            raise ValueError(f"prompt_filter dropped every training prompt ({report}); lower epsilon")
        dm.train_prompts = self.kept_prompts = kept
        print(f"alignlit: prompt filter kept {int(report['kept'])} of {int(report['prompts'])} prompts")

    # ------------------------------------------------------------------ the rollout side
    def task_rewards(self, rollout: Rollout, scores: torch.Tensor) -> torch.Tensor:
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

    def collect(self, prompts: list[str]) -> tuple[Experience | None, dict[str, float]]:
        """This training step's rollout of ``prompts``, scored and :meth:`accept`-ed: generated now by the
        current policy (``rollout.max_staleness`` 0), or taken from the pipeline that generated it ahead
        (:meth:`collect_ahead`)."""
        if self.rollout.max_staleness:
            return self.collect_ahead(prompts)
        return self.accept(self.rollout.collect(prompts, self.reward, version=self.policy_version))

    def produce(
        self, index: int, prompts: list[str], version: int
    ) -> tuple[Experience | None, dict[str, float]]:
        """Step ``index``'s rollout on the pipeline's engine (which holds ``version``), seeded as the
        synchronous rollout ``index`` is, scored and accepted; runs in the producer thread."""
        loop = self.rollout
        sampling = dataclasses.replace(loop.sampling, seed=loop.seed + index)
        engine = loop.async_engine
        experience = loop.collect(prompts, self.reward, version=version, sampling=sampling, engine=engine)
        return self.accept(experience, engine=engine)

    def prompt_schedule(self, index: int) -> list[str]:
        """The prompts the training loader hands step ``index`` (epoch ``index // batches per epoch``): the
        pipeline generates them ahead, and each step checks that the loader agrees."""
        loader = self.trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, ResumableSampler) or sampler.yield_epoch:
            raise ValueError(
                "rollout.max_staleness >= 1 generates the prompts of later steps ahead, from the training "
                f"loader's sampler; it needs alignlit's resumable prompt loader (PromptDataModule), got {loader!r}"
            )
        epoch, batch = divmod(index, int(self.trainer.num_training_batches))
        rows = sampler.order(epoch)[batch * loader.batch_size : (batch + 1) * loader.batch_size]
        return loader.collate_fn([loader.dataset[i] for i in rows])

    def collect_ahead(self, prompts: list[str]) -> tuple[Experience | None, dict[str, float]]:
        """Take step ``index``'s rollout from the pipeline (``rollout.max_staleness = k``), after submitting
        the steps up to ``index + k`` from the current weights; assert the staleness bound on every sample
        and log ``async/staleness_mean``, ``async/staleness_max``, ``async/wait_s``."""
        loop, k = self.rollout, self.rollout.max_staleness
        index = loop.rollouts
        pipeline = loop.pipeline
        if pipeline is None:
            pipeline = loop.start_pipeline(self.produce)
            pipeline.restore(*self.restored_batches)
        scheduled = self.prompt_schedule(index)
        if list(prompts) != list(scheduled):
            raise RuntimeError(
                f"step {index}: the training loader gave prompts {list(prompts)[:2]}... but the rollout pipeline "
                f"generated {list(scheduled)[:2]}... for it: the loader's order is not the sampler's"
            )
        last = self._planned_rollouts - 1
        ahead = [j for j in range(index, min(index + k, max(last, index)) + 1) if j not in pipeline.submitted]
        if ahead:
            pipeline.publish(loop.snapshot(self.policy_version))
            for j in ahead:
                pipeline.submit(j, self.prompt_schedule(j), self.policy_version)
        waited = pipeline.waited_s
        experience, metrics = pipeline.take(index)
        loop.rollouts = index + 1
        metrics = {**metrics, "async/wait_s": pipeline.waited_s - waited}
        if experience is not None:
            staleness = self.policy_version - experience.versions  # (N,)
            if int(staleness.max()) > k or int(staleness.min()) < 0:
                raise AssertionError(
                    f"step {index}: samples of versions {sorted(set(experience.versions.tolist()))} trained by "
                    f"version {self.policy_version}: staleness outside [0, max_staleness={k}]"
                )
            metrics["async/staleness_mean"] = float(staleness.float().mean())
            metrics["async/staleness_max"] = float(staleness.max())
        return experience, metrics

    def accept(self, experience: Experience, *, engine=None) -> tuple[Experience | None, dict[str, float]]:
        """The samples of a scored rollout to train on: all of them, or with dynamic sampling its
        informative groups, refilled from further prompts (at most ``max_tries`` rounds) and cut to the
        batch's number of groups (None when no group is informative). The metrics describe the rollout's
        samples (:func:`sample_metrics`) and its generation."""
        loop = self.rollout
        rollout, n = experience.rollout, experience.rollout.n
        metrics = {**loop.metrics, **sample_metrics(rollout, experience.rewards)}
        rewards = self.task_rewards(rollout, experience.rewards)
        if self.overlong is not None and self.overlong.mode == "penalty":
            metrics["reward/overlong_penalty"] = float((rewards - experience.rewards).mean())
        ds, groups = self.dynamic_sampling, len(rollout) // n
        grouped = [rewards.view(groups, n)]  # (B, n) rewards per part
        keep = [informative_groups(grouped[0], atol=ds.atol if ds else 0.0).nonzero().flatten()]
        if n >= 2:  # the groups whose rewards differ (every other one has advantages 0)
            metrics["dynamic/informative_frac"] = len(keep[0]) / groups
        if ds is None:
            return experience, metrics
        parts = [experience]
        tries = extra = 0
        while sum(len(k) for k in keep) < groups and tries < ds.max_tries:
            seed = int(torch.randint(2**31 - 1, (1,), generator=self.refill_generator))
            more = loop.collect(
                self._refill_prompts(groups - sum(len(k) for k in keep)), self.reward,
                version=int(experience.versions[0]), sampling=dataclasses.replace(loop.sampling, seed=seed),
                engine=engine,
            )  # fmt: skip
            parts.append(more)
            grouped.append(self.task_rewards(more.rollout, more.rewards).view(-1, n))
            keep.append(informative_groups(grouped[-1], atol=ds.atol).nonzero().flatten())
            tries, extra = tries + 1, extra + len(more.rollout) // n
        room, cut = groups, []
        for k in keep:  # the first `groups` informative groups
            cut.append(k[:room])
            room -= len(cut[-1])
        metrics.update(
            {"dynamic/tries": float(tries), "dynamic/extra_prompts": float(extra)}
            | {"dynamic/groups": float(groups - room), "dynamic/full": float(room == 0)}
        )
        if room == groups:
            return None, metrics
        if tries == 0 and room == 0:  # every group informative
            return experience, metrics
        rows = [(c[:, None] * n + torch.arange(n)).flatten() for c in cut]  # (g_k * n,)
        kept = Experience(
            select_groups([p.rollout for p in parts], cut, self.tokenizer.pad_token_id),
            torch.cat([p.rewards[r] for p, r in zip(parts, rows)]),
            torch.cat([p.versions[r] for p, r in zip(parts, rows)]),
        )
        return kept, metrics

    # ------------------------------------------------------------------ the trainer side
    @torch.no_grad()
    def make_trajectory(self, experience: Experience) -> tuple[Trajectory, dict[str, float]]:
        """The :class:`Trajectory` of a scored rollout and its metrics: the loss mask (without the
        responses cut at the limit under overlong filtering), the task rewards, and when the stage
        ``needs_logprobs`` the old and reference log-probs (``time/old_logp_s``, ``time/ref_logp_s``),
        the rollout/trainer mismatch (``mismatch/*``) and the rollout correction's weights (``tis_cap`` /
        ``rollout_correction``: ``rollout_correction/*``), ``kl/ref``
        (``k1`` summed over each response, averaged) and, with a ``kl`` penalty, the per-token estimate
        ``kl`` (``kl/coef``, ``kl/token``, ``kl/penalty``)."""
        rollout, device = experience.rollout, self.device
        attention = rollout.response_mask.to(device)  # (N, T)
        action = attention if rollout.action_mask is None else rollout.action_mask.to(device)  # (N, T)
        loss_mask = action
        metrics: dict[str, float] = {}
        if self.overlong is not None and self.overlong.mode == "filter":
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
            traj.old_logprobs = old = self.logprobs(self.policy, traj.ids)  # (N, T)
            metrics["time/old_logp_s"] = time.perf_counter() - start
        start = time.perf_counter()
        traj.ref_logprobs = ref = self.logprobs(self.reference, traj.ids)  # (N, T)
        metrics["time/ref_logp_s"] = time.perf_counter() - start
        traj.rewards, behaviour = traj.rewards.to(old.dtype), behaviour.to(old.dtype)
        if action.any():
            metrics["response/ppl"] = float(torch.exp(-masked_mean(old, action)))
        if action.any() and self.old_logprobs == "recompute":
            mismatch = logprob_mismatch(old, behaviour, action)
            metrics.update({f"mismatch/{k.removeprefix('mismatch_')}": float(v) for k, v in mismatch.items()})
            staleness = self.policy_version - traj.version  # (N,)
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
        metrics["kl/ref"] = float(((old - ref) * action).sum(-1).mean())  # k1 per response
        if self.kl is not None:
            traj.kl = kl_estimate(old, ref, self.kl.estimator) * action  # (N, T)
            beta = self.kl_ctl.value
            metrics.update(
                {"kl/coef": beta, "kl/penalty": float((beta * traj.kl).sum(-1).mean())}
                | ({"kl/token": float(masked_mean(traj.kl, action))} if action.any() else {})
            )
        return traj, metrics
