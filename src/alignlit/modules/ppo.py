"""PPO with a critic on the rollout loop: PPO-max (Zheng et al. 2023) plus ChatGLM-RLHF additions.

One ``training_step`` is one PPO iteration (algorithms.md §4): a rollout of the prompt batch
(:class:`~alignlit.rollout.RolloutLoop`), the PPO experience built from it
(:meth:`PPOModule.make_experience`: old/reference log-probs, values, KL-penalised token rewards,
GAE), then ``rollout.epochs`` passes of minibatch updates of the critic and the policy, each with
its own optimizer, LR schedule and gradient-norm clipping (manual optimisation).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_only

from alignlit.data.sft import SFTDataModule
from alignlit.losses.lm import masked_nll, shift_for_next_token
from alignlit.losses.ppo import entropy_bonus, ppo_policy_loss, ppo_value_loss
from alignlit.models.loading import load_policy, load_scalar_model
from alignlit.models.reward import load_reward_model
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, check_finite
from alignlit.ops import (
    AdaptiveKLController,
    FixedKLController,
    KLKind,
    RunningMoments,
    entropy_from_logits,
    gae,
    gather_logprobs,
    kl_estimate,
    masked_mean,
    masked_var,
    whiten,
)
from alignlit.rollout.base import Rollout, SamplingParams
from alignlit.rollout.hf_engine import HFEngine
from alignlit.models.forward import position_ids_from_mask, response_logprobs
from alignlit.rollout.loop import RolloutLoop
from alignlit.rollout.prompt_filter import PromptFilter
from alignlit.rollout.reward import Reward, RewardFn, score_rollout

RewardNorm = Literal["none", "normalize", "scale"]
AdvantageNorm = Literal["none", "batch", "minibatch"]
BASELINE_SEED_OFFSET = 1_000_003
"""Reference responses of rollout ``i`` are sampled with seed ``rollout.seed + BASELINE_SEED_OFFSET + i``."""


@dataclasses.dataclass
class PPOBatch:
    """The experience of one rollout, ready for PPO updates (``N`` samples, ``P`` prompt and ``T`` response tokens).

    Attributes:
        prompt_ids: (N, P) long, left-padded.
        prompt_mask: (N, P) bool.
        response_ids: (N, T) long, right-padded.
        mask: (N, T) bool, True on response tokens.
        old_logprobs: (N, T) ``log π_θ_old`` of the sampled tokens, recomputed by the trainer.
        ref_logprobs: (N, T) ``log π_0`` of the sampled tokens.
        old_values: (N, T) critic values ``V(s_t)`` at sampling time.
        rewards: (N, T) token rewards ``-β·kl_t`` plus the sequence reward on the last token.
        advantages: (N, T) GAE advantages (whitened/clipped as configured).
        returns: (N, T) GAE returns.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, rows: torch.Tensor) -> PPOBatch:
        """The rows ``rows`` (a (m,) index tensor) of every field."""
        rows = rows.to(self.prompt_ids.device)
        return PPOBatch(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})


def kl_penalized_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *, kl_coef: float
) -> torch.Tensor:
    """Token rewards with a token-level KL penalty (PPO-max §5.3.2, ChatGLM eq. 4-5).

    ``r_t = -β·kl_t`` on every response token, and the sequence reward ``R̃`` is added at the last
    valid token: ``r_T += R̃``. Rows without a response token get no reward.

    Args:
        scores: (N,) sequence rewards ``R̃``.
        kl: (N, T) per-token KL estimates.
        mask: (N, T) 1 on response tokens (right-padded).
        kl_coef: ``β``.

    Returns:
        (N, T) rewards, 0 at padding.
    """
    if scores.dim() != 1 or scores.shape[0] != kl.shape[0]:
        raise ValueError(f"scores must have shape (N,) = ({kl.shape[0]},), got {tuple(scores.shape)}")
    weights = mask.to(kl.dtype)  # (N, T)
    rewards = -kl_coef * kl * weights
    last = weights.sum(-1).long() - 1  # (N,)
    rows = (last >= 0).nonzero().flatten()
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(G - V) / Var(G)`` over valid tokens: 1 for a perfect critic, 0 for a constant one."""
    return 1.0 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp_min(1e-12)


def normalize_scores(
    scores: torch.Tensor, moments: RunningMoments, *, mode: RewardNorm, clip: float | None
) -> torch.Tensor:
    """PPO-max reward normalisation on running statistics: ``R̃ = clip((R - μ)/σ, -δ, δ)``.

    ``mode``: ``"normalize"`` uses ``(R - μ)/σ``, ``"scale"`` ``R/σ``, ``"none"`` ``R``; ``μ, σ`` are
    the running mean and standard deviation of ``moments`` (``σ = 1`` while it has < 2 values);
    ``clip`` (``δ``) is applied to the result when given.
    """
    if mode not in ("none", "normalize", "scale"):
        raise ValueError(f"reward_norm must be 'none', 'normalize' or 'scale', got {mode!r}")
    out = scores
    if mode != "none":
        std = moments.std if moments.count >= 2 else 1.0
        shift = moments.mean if mode == "normalize" and moments.count else 0.0
        out = (scores - shift) / max(std, 1e-8)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return out


def policy_logprobs_and_entropy(
    model: torch.nn.Module, batch: PPOBatch, *, temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced ``log π_θ`` (with gradient) and per-token entropies of the batch's responses.

    Same forward pass as :func:`~alignlit.rollout.response_logprobs` (positions counted over real
    tokens), keeping the logits for the entropy. Returns two (N, T) tensors, 0 at padding.
    """
    num_prompt = batch.prompt_ids.shape[1]
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # (N, P + T)
    attention_mask = torch.cat([batch.prompt_mask, batch.mask], dim=1).long()  # (N, P + T)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).logits[:, num_prompt - 1 : -1]  # (N, T, V)
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    weights = batch.mask.to(logits.dtype)
    logprobs = gather_logprobs(logits, batch.response_ids) * weights  # (N, T)
    entropy = entropy_from_logits(logits if entropy_grad else logits.detach()) * weights  # (N, T)
    return logprobs, entropy


def response_values(critic: torch.nn.Module, batch_ids: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(N, T) critic values ``V(s_t)``: the head at the position that predicts response token ``t``."""
    prompt_ids, prompt_mask, response_ids, response_mask = batch_ids
    num_prompt = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # (N, P + T)
    mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # (N, P + T)
    values = critic.values(ids, mask)[:, num_prompt - 1 : -1]  # (N, T)
    return values * response_mask.to(values.dtype)


def _mean_metrics(records: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    keys = {k for rec in records for k in rec}
    return {
        k: float(torch.stack([rec[k].float() for rec in records if k in rec]).mean()) for k in sorted(keys)
    }


class PPOModule(AlignModule):
    """PPO with a critic (PPO-max) on the rollout loop; every PPO-max / ChatGLM switch is an argument.

    One training step is one rollout of the prompt batch followed by ``rollout.epochs`` passes of
    ``rollout.minibatch_size`` updates. ``trainer.global_step`` counts optimizer steps of both models
    (Lightning's manual-optimisation convention): set the run length in rollouts with
    ``trainer.max_epochs`` and ``trainer.limit_train_batches``; LR schedules count rollouts.

    Args:
        policy: causal-LM directory (e.g. the SFT export), or a :class:`~alignlit.models.TinyLlama` spec.
        reward_model: a reward-model directory (``load_reward_model``: frozen, scores the response
            texts encoded as in its training) or any reward object/callable (``score_rollout(rollout)``,
            ``score(prompts, responses)`` or ``(prompts, responses) -> rewards``, e.g.
            :class:`~alignlit.sim.SimGoldReward`).
        reference: frozen reference policy ``π_0`` directory (default: ``policy``).
        critic: scalar-model directory the critic starts from (default: ``reward_model`` when it is
            a directory, else ``policy`` with a fresh head). Must share the policy's tokenizer.
        rollout: the rollout loop (engine, sampling, samples per prompt, ``epochs`` = PPO epochs,
            minibatch size, parity checks); default ``RolloutLoop()``.
        actor_lr: policy AdamW learning rate.
        critic_lr: critic AdamW learning rate.
        weight_decay: AdamW weight decay (both models).
        betas: AdamW betas (both models).
        actor_lr_warmup: rollouts of linear LR warmup of the policy (counted from its first update).
        critic_lr_warmup: rollouts of linear LR warmup of the critic.
        min_lr_ratio: both cosine schedules end at ``lr * min_lr_ratio`` (1.0: constant LR).
        max_grad_norm: global gradient-norm clipping of each model (None: off).
        clip_eps: policy ratio clip ``ε``.
        value_clip_eps: value clip ``ε_v`` (None: unclipped value loss).
        gamma: GAE discount ``γ``.
        lam: GAE ``λ``.
        reward_norm: ``"normalize"`` ``(R - μ)/σ``, ``"scale"`` ``R/σ`` or ``"none"``, with running ``μ, σ``.
        reward_clip: clip the (normalised) reward to ``±δ`` (None: off).
        reference_baseline: subtract the reward of a reference response ``y_ref ~ π_0``, sampled once
            per prompt and cached (ChatGLM eq. 5).
        kl_coef: KL penalty coefficient ``β`` (initial value when adaptive).
        kl_estimator: per-token KL estimator ``"k1"``, ``"k2"`` or ``"k3"``.
        kl_target: adaptive ``β`` towards this KL per response (nats); None keeps ``β`` fixed.
        kl_horizon: adaptive-controller horizon in samples.
        advantage_norm: whiten advantages over the rollout (``"batch"``), per minibatch, or not.
        advantage_clip: clip advantages to ``±c`` after whitening (None: off).
        entropy_coef: entropy bonus ``c_H``.
        critic_pretrain_rollouts: first rollouts that train only the critic (PPO-max §5.3.3).
        ptx_file: human (prompt, response) records for the SFT loss mix (ChatGLM eq. 6, PPO-ptx), read
            and encoded as :class:`~alignlit.data.SFTDataModule` does; its validation set gives
            ``val/sft_nll`` (capability retention) even when ``ptx_coef`` is 0.
        ptx_val_file: validation records for ``val/sft_nll`` (default: 5% of ``ptx_file``).
        ptx_coef: weight of the SFT NLL in the policy loss (one ptx batch per policy update).
        ptx_batch_size: SFT examples per policy update.
        ptx_max_length: longest SFT prompt + response in tokens.
        ptx_max_prompt_length: SFT prompts are left-truncated to this many tokens.
        prompt_filter: drop training prompts with low reward variance under the initial policy
            (ChatGLM §3.4), applied to the DataModule's ``train_prompts`` at the start of fit.
        gold: a reward callable scored on validation samples as ``val/gold`` (e.g. the simulated
            task's gold reward); None: not logged.
        val_sampling: sampling of validation responses (default: the rollout's, seeded with ``rollout.seed``).
        reward_batch_size: samples per reward-model forward pass.
        dtype: dtype of the loaded models.
        curves_file: PNG of the monitoring curves written at the end of fit (default:
            ``<log dir>/ppo_curves.png``); the history goes next to it as JSON.
        export_dir: where the trained policy is exported at the end of fit.
    """

    stage = "ppo"

    def __init__(
        self,
        policy: str | TinyLlama,
        reward_model: str | RewardFn,
        reference: str | None = None,
        critic: str | None = None,
        rollout: RolloutLoop | None = None,
        actor_lr: float = 1e-5,
        critic_lr: float = 5e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        actor_lr_warmup: int = 0,
        critic_lr_warmup: int = 0,
        min_lr_ratio: float = 1.0,
        max_grad_norm: float | None = 1.0,
        clip_eps: float = 0.2,
        value_clip_eps: float | None = 0.2,
        gamma: float = 1.0,
        lam: float = 0.95,
        reward_norm: RewardNorm = "normalize",
        reward_clip: float | None = 5.0,
        reference_baseline: bool = False,
        kl_coef: float = 0.05,
        kl_estimator: KLKind = "k1",
        kl_target: float | None = None,
        kl_horizon: int = 10000,
        advantage_norm: AdvantageNorm = "batch",
        advantage_clip: float | None = None,
        entropy_coef: float = 0.0,
        critic_pretrain_rollouts: int = 0,
        ptx_file: str | None = None,
        ptx_val_file: str | None = None,
        ptx_coef: float = 0.0,
        ptx_batch_size: int = 16,
        ptx_max_length: int = 256,
        ptx_max_prompt_length: int = 128,
        prompt_filter: PromptFilter | None = None,
        gold: RewardFn | None = None,
        val_sampling: SamplingParams | None = None,
        reward_batch_size: int = 64,
        dtype: str = "float32",
        curves_file: str | None = None,
        export_dir: str | None = None,
    ):
        super().__init__(export_dir=export_dir)
        self.save_hyperparameters(ignore=["reward_model", "rollout", "prompt_filter", "gold", "val_sampling"])
        if advantage_norm not in ("none", "batch", "minibatch"):
            raise ValueError(f"advantage_norm must be 'none', 'batch' or 'minibatch', got {advantage_norm!r}")
        if reward_norm not in ("none", "normalize", "scale"):
            raise ValueError(f"reward_norm must be 'none', 'normalize' or 'scale', got {reward_norm!r}")
        if ptx_coef > 0 and ptx_file is None:
            raise ValueError(f"ptx_coef={ptx_coef} needs ptx_file (human prompt/response records)")
        self.automatic_optimization = False
        self.rollout = rollout if rollout is not None else RolloutLoop()
        self.ptx_data: SFTDataModule | None = None
        self.prompt_filter = prompt_filter
        self.gold = gold
        self.val_sampling = val_sampling

        self.policy, self.tokenizer = (
            load_policy(policy) if isinstance(policy, TinyLlama) else load_policy(policy, dtype=dtype)
        )
        self.policy.train()
        self._policy_dir = None if isinstance(policy, TinyLlama) else str(policy)
        self._tokenizer_dir = policy.tokenizer if isinstance(policy, TinyLlama) else str(policy)
        if reference is not None:
            self.reference = load_policy(reference, dtype=dtype)[0]
        else:
            self.reference = copy.deepcopy(self.policy)
        self.reference.requires_grad_(False).eval()

        self.reward_model = None
        if isinstance(reward_model, str):
            self.reward: Reward = load_reward_model(reward_model, batch_size=reward_batch_size, dtype=dtype)
            self.reward_model = self.reward.model  # registered, so it follows the module's device
            self.reward_model.requires_grad_(False).eval()
        else:
            self.reward = reward_model
        critic_dir = critic or (reward_model if isinstance(reward_model, str) else self._policy_dir)
        if critic_dir is None:
            raise ValueError(
                "critic: give a scalar-model directory (the policy is a TinyLlama spec, not a directory)"
            )
        self.critic, critic_tokenizer = load_scalar_model(critic_dir, dtype=dtype)
        self.critic.train()
        if critic_tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(
                f"critic {critic_dir!r} has a different tokenizer from the policy; per-token values need the "
                "policy's tokens: set `critic` to a directory with the policy's tokenizer (e.g. the policy)"
            )

        self.reward_moments = RunningMoments()
        self.kl_ctl = (
            FixedKLController(kl_coef)
            if kl_target is None
            else AdaptiveKLController(kl_coef, kl_target, kl_horizon)
        )
        self.baseline_cache: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self._ptx_loader = None
        self._ptx_iter = None
        self._ptx_state: dict[str, int] | None = None
        self._val_records: list[dict[str, torch.Tensor]] = []
        self._planned_rollouts = 1

    # ------------------------------------------------------------------ setup
    def export_model(self):
        return self.policy

    def parallel_models(self) -> list[torch.nn.Module]:
        return [self.policy, self.critic]

    def setup(self, stage: str) -> None:
        world = self.trainer.world_size if self._trainer is not None else 1
        self.rollout.setup(self.policy, self.tokenizer, policy_dir=self._policy_dir, world_size=world)
        self.setup_ptx()

    def setup_ptx(self) -> None:
        """Read and encode the ptx data (once), as :class:`~alignlit.data.SFTDataModule` does."""
        hp = self.hparams
        if hp.ptx_file is None or self.ptx_data is not None:
            return
        self.ptx_data = SFTDataModule(
            train_file=hp.ptx_file,
            val_file=hp.ptx_val_file,
            tokenizer=self._tokenizer_dir,
            max_length=hp.ptx_max_length,
            max_prompt_length=hp.ptx_max_prompt_length,
            batch_size=hp.ptx_batch_size,
        )
        self.ptx_data.trainer = self._trainer
        self.ptx_data.setup("fit")

    def on_fit_start(self) -> None:
        if self.prompt_filter is None:
            return
        dm = self.trainer.datamodule
        if dm is None or not hasattr(dm, "train_prompts"):
            raise ValueError("prompt_filter needs a DataModule with `train_prompts` (e.g. PromptDataModule)")
        engine = HFEngine(self.tokenizer, self.policy, micro_batch_size=self.prompt_filter.batch_size)
        dm.train_prompts, report = self.prompt_filter(engine, self.reward, dm.train_prompts)
        if not dm.train_prompts:
            raise ValueError(f"prompt_filter dropped every training prompt ({report}); lower epsilon")
        print(f"alignlit: prompt filter kept {int(report['kept'])} of {int(report['prompts'])} prompts")

    def _lr_factor(self, warmup: int, offset: int):
        """Warmup + cosine LR factor per rollout, as :func:`~alignlit.modules.base.warmup_cosine`, over
        ``planned rollouts - offset`` steps. The total is read when the factor is evaluated (it is known
        at ``on_train_start``): asking for it in ``configure_optimizers`` would load the prompt loader
        before a checkpoint's loader state is restored, and resume would not be exact."""
        min_ratio = self.hparams.min_lr_ratio

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            total = max(1, self._planned_rollouts - offset)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

        return factor

    def configure_optimizers(self):
        hp = self.hparams

        def build(params, lr: float, warmup: int, offset: int) -> dict[str, Any]:
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor(warmup, offset))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        return [
            build(self.policy.parameters(), hp.actor_lr, hp.actor_lr_warmup, hp.critic_pretrain_rollouts),
            build(self.critic.parameters(), hp.critic_lr, hp.critic_lr_warmup, 0),
        ]

    def on_train_start(self) -> None:
        planned = self.trainer.estimated_stepping_batches
        self._planned_rollouts = int(planned) if planned != float("inf") else 1_000_000

    # ------------------------------------------------------------------ experience
    def _sequence_rewards(
        self, rollout: Rollout, scores: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``R = r(x, y)``, minus ``r(x, y_ref)`` with the reference baseline (ChatGLM eq. 5)."""
        if not self.hparams.reference_baseline:
            return scores, {}
        missing = list(dict.fromkeys(p for p in rollout.prompts if p not in self.baseline_cache))
        if missing:
            seed = self.rollout.seed + BASELINE_SEED_OFFSET + self.rollout.rollouts
            params = dataclasses.replace(self.rollout.sampling, seed=seed)
            engine = HFEngine(
                self.tokenizer, self.reference, micro_batch_size=self.rollout.generation_batch_size
            )
            ref_rollout = engine.generate(missing, 1, params)
            for prompt, value in zip(missing, score_rollout(self.reward, ref_rollout).tolist()):
                self.baseline_cache[prompt] = value
        baseline = torch.tensor([self.baseline_cache[p] for p in rollout.prompts], dtype=scores.dtype)
        return scores - baseline, {
            "reward/baseline": float(baseline.mean()),
            "reward/baseline_new": float(len(missing)),
        }

    def _update_moments(self, values: torch.Tensor) -> None:
        """Fold this rollout's rewards into the running moments, merged over all ranks."""
        local = RunningMoments()
        local.update(values)
        local.all_reduce()
        self.reward_moments.merge(local)

    @torch.no_grad()
    def make_experience(self, rollout: Rollout, scores: torch.Tensor) -> tuple[PPOBatch, dict[str, float]]:
        """Build the PPO batch of one scored rollout and its monitoring metrics (PPO-max §5.2).

        Samples without a response token are dropped from the batch (their scores still enter the
        running reward statistics).
        """
        hp = self.hparams
        device = self.device
        ids = tuple(
            t.to(device)
            for t in (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
        )
        temperature = self.rollout.sampling.temperature
        self.reference.eval()
        old_logprobs = response_logprobs(self.policy, *ids, temperature=temperature)  # (N, T)
        ref_logprobs = response_logprobs(self.reference, *ids, temperature=temperature)  # (N, T)
        old_values = response_values(self.critic, ids)  # (N, T)
        mask = ids[3]

        shaped, metrics = self._sequence_rewards(rollout, scores)
        self._update_moments(shaped)
        normalized = normalize_scores(shaped, self.reward_moments, mode=hp.reward_norm, clip=hp.reward_clip)
        kl = kl_estimate(old_logprobs, ref_logprobs, hp.kl_estimator) * mask  # (N, T)
        rewards = kl_penalized_rewards(normalized.to(device), kl, mask, kl_coef=self.kl_ctl.value)  # (N, T)
        advantages, returns = gae(rewards, old_values, mask, gamma=hp.gamma, lam=hp.lam)
        if hp.advantage_norm == "batch":
            advantages = whiten(advantages, mask)
        if hp.advantage_clip is not None:
            advantages = advantages.clamp(-hp.advantage_clip, hp.advantage_clip) * mask

        lengths = mask.sum(-1)
        keep = (lengths > 0).nonzero().flatten()
        batch = PPOBatch(*ids[:3], mask, old_logprobs, ref_logprobs, old_values, rewards, advantages, returns)
        seq_kl = ((old_logprobs - ref_logprobs) * mask).sum(-1)  # (N,) k1 per response
        metrics.update(
            {
                "reward/raw": float(scores.mean()),
                "reward/shaped": float(shaped.mean()),
                "reward/normalized": float(normalized.mean()),
                "reward/running_mean": self.reward_moments.mean,
                "reward/running_std": self.reward_moments.std if self.reward_moments.count >= 2 else 0.0,
                "kl/ref": float(seq_kl.mean()),
                "kl/token": float(masked_mean(kl, mask)),
                "kl/coef": self.kl_ctl.value,
                "kl/penalty": float((self.kl_ctl.value * kl).sum(-1).mean()),
                "response/length": float(lengths.float().mean()),
                "response/ppl": float(torch.exp(-masked_mean(old_logprobs, mask))),
                "response/empty": float((lengths == 0).sum()),
                "response/truncated": float(sum(r == "length" for r in rollout.finish_reasons)),
                "value/explained_var": float(explained_variance(old_values, returns, mask)),
                "value/mean": float(masked_mean(old_values, mask)),
                "advantage/mean": float(masked_mean(advantages, mask)),
            }
        )
        return batch.select(keep) if len(keep) < len(batch) else batch, metrics

    # ------------------------------------------------------------------ updates
    def _clip(self, params) -> torch.Tensor:
        """Clip the global gradient norm to ``max_grad_norm``; returns the norm before clipping."""
        params = [p for p in params if p.grad is not None]
        max_norm = self.hparams.max_grad_norm
        if self.device_mesh is not None:
            from alignlit.strategies import clip_grad_norm

            return clip_grad_norm(params, max_norm if max_norm is not None else float("inf"))
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))

    def _ptx_batch(self):
        if self._ptx_iter is None:
            if self._ptx_loader is None:
                self._ptx_loader = self.ptx_data.train_dataloader()
                if self._ptx_state is not None:
                    self._ptx_loader.load_state_dict(self._ptx_state)
            self._ptx_iter = iter(self._ptx_loader)
        try:
            return next(self._ptx_iter)
        except StopIteration:
            self._ptx_loader.sampler.set_epoch(self._ptx_loader.sampler.epoch + 1)
            self._ptx_iter = iter(self._ptx_loader)
            return next(self._ptx_iter)

    def ptx_nll(self, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Token-mean NLL of the policy on a batch of human (prompt, response) pairs (ChatGLM eq. 6)."""
        input_ids, attention_mask = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask).logits
        return masked_nll(*shift_for_next_token(logits, input_ids, batch.loss_mask.to(self.device)))

    def critic_loss(self, mb: PPOBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped value loss of the critic on a minibatch (:func:`~alignlit.losses.ppo_value_loss`)."""
        clip = self.hparams.value_clip_eps
        values = response_values(self.critic, (mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.mask))
        loss, metrics = ppo_value_loss(
            values, mb.old_values, mb.returns, mb.mask, clip_eps=clip if clip is not None else float("inf")
        )
        check_finite(loss, what="PPO value loss", step=self.global_step, metrics=metrics)
        return loss, metrics

    def actor_loss(self, mb: PPOBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped surrogate + entropy bonus + ``ptx_coef``·SFT NLL of the policy on a minibatch."""
        hp = self.hparams
        logprobs, entropy = policy_logprobs_and_entropy(
            self.policy, mb, temperature=self.rollout.sampling.temperature, entropy_grad=hp.entropy_coef > 0
        )
        advantages = whiten(mb.advantages, mb.mask) if hp.advantage_norm == "minibatch" else mb.advantages
        loss, metrics = ppo_policy_loss(logprobs, mb.old_logprobs, advantages, mb.mask, clip_eps=hp.clip_eps)
        entropy_loss, entropy_metrics = entropy_bonus(entropy, mb.mask, coef=hp.entropy_coef)
        metrics.update(entropy_metrics)
        loss = loss + entropy_loss
        if hp.ptx_coef > 0:
            nll, ptx_metrics = self.ptx_nll(self._ptx_batch())
            loss = loss + hp.ptx_coef * nll
            metrics["ptx_nll"] = ptx_metrics["nll"]
        check_finite(loss, what="PPO policy loss", step=self.global_step, metrics=metrics)
        return loss, metrics

    def _step(self, loss: torch.Tensor, optimizer, model: torch.nn.Module) -> torch.Tensor:
        """Backward, clip the model's gradient norm, step; returns the norm before clipping."""
        optimizer.zero_grad()
        self.manual_backward(loss)
        norm = self._clip(model.parameters())
        optimizer.step()
        return norm

    def training_step(self, prompts: list[str], batch_idx: int) -> None:
        hp = self.hparams
        actor_opt, critic_opt = self.optimizers()
        actor_sched, critic_sched = self.lr_schedulers()
        actor_active = self.rollout.rollouts >= hp.critic_pretrain_rollouts

        self.rollout.show_phase(self.trainer, "rollout")
        start = time.perf_counter()
        experience = self.rollout.collect(prompts, self.reward)
        batch, metrics = self.make_experience(experience.rollout, experience.rewards)
        metrics.update(self.rollout.metrics)
        metrics["time/rollout_s"] = time.perf_counter() - start

        self.rollout.show_phase(self.trainer, "train")
        start = time.perf_counter()
        critic_records, actor_records = [], []
        for rows in self.rollout.minibatches(len(batch)):
            mb = batch.select(rows)
            loss, critic_metrics = self.critic_loss(mb)
            critic_metrics["grad_norm"] = self._step(loss, critic_opt, self.critic)
            critic_records.append(critic_metrics)
            if actor_active:
                loss, actor_metrics = self.actor_loss(mb)
                actor_metrics["grad_norm"] = self._step(loss, actor_opt, self.policy)
                self.rollout.mark_stale()
                actor_records.append(actor_metrics)
        critic_sched.step()
        if actor_active:
            actor_sched.step()
            kl = self.trainer.strategy.reduce(
                torch.tensor(metrics["kl/ref"], device=self.device), reduce_op="mean"
            )
            self.kl_ctl.update(float(kl), len(experience))
        metrics["time/train_s"] = time.perf_counter() - start
        metrics.update(
            {f"value/{k.removeprefix('value_')}": v for k, v in _mean_metrics(critic_records).items()}
        )
        metrics.update({f"policy/{k}": v for k, v in _mean_metrics(actor_records).items()})
        metrics["lr/actor"] = actor_sched.get_last_lr()[0]
        metrics["lr/critic"] = critic_sched.get_last_lr()[0]
        metrics["rollout"] = float(self.rollout.rollouts)
        self.history.append(dict(metrics))
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(experience))
        self.log_dict(
            {"reward": metrics["reward/raw"], "kl": metrics["kl/ref"]},
            prog_bar=True,
            logger=False,
            batch_size=len(experience),
        )

    # ------------------------------------------------------------------ validation
    def validation_step(self, prompts: list[str], batch_idx: int) -> None:
        sampling = self.val_sampling or self.rollout.sampling
        sampling = dataclasses.replace(sampling, seed=self.rollout.seed + batch_idx)
        rollout = self.rollout.generate(prompts, n=1, sampling=sampling)
        mask = rollout.response_mask.to(self.device)
        ref = response_logprobs(
            self.reference,
            rollout.prompt_ids.to(self.device),
            rollout.prompt_mask.to(self.device),
            rollout.response_ids.to(self.device),
            mask,
            temperature=sampling.temperature,
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
        if self.ptx_data is not None and self.ptx_data.val_set:
            nll = [self.ptx_nll(b) for b in self.ptx_data.val_dataloader()]
            tokens = torch.stack([m["tokens"] for _, m in nll]).float()
            metrics["val/sft_nll"] = float(
                (torch.stack([loss for loss, _ in nll]) * tokens).sum() / tokens.sum()
            )
        if metrics:
            if not self.trainer.sanity_checking:
                self.log_dict(metrics, sync_dist=True)
            # the sanity check before training (``num_sanity_val_steps: -1`` runs all validation
            # batches) is the curve's starting point
            self.history.append({"rollout": float(self.rollout.rollouts), **metrics})

    # ------------------------------------------------------------------ checkpoints and curves
    def _frozen_prefixes(self) -> list[str]:
        return ["reference."] + (["reward_model."] if self.reward_model is not None else [])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the online state; leave the frozen reference and reward model out (they reload from disk)."""
        prefixes = tuple(self._frozen_prefixes())
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(prefixes)]:
            del state[key]
        loader = self._ptx_loader
        checkpoint["ppo_state"] = {
            "rollout": self.rollout.state_dict(),
            "reward_moments": self.reward_moments.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "baseline_cache": dict(self.baseline_cache),
            "history": list(self.history),
            "ptx_loader": loader.state_dict() if loader is not None else self._ptx_state,
            "torch_rng": torch.get_rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("ppo_state")
        if state is None:
            raise KeyError("checkpoint has no 'ppo_state': it was not written by PPOModule")
        for prefix in self._frozen_prefixes():
            module = getattr(self, prefix.rstrip("."))
            checkpoint["state_dict"].update({prefix + k: v for k, v in module.state_dict().items()})
        self.rollout.load_state_dict(state["rollout"])
        self.reward_moments.load_state_dict(state["reward_moments"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.baseline_cache = dict(state["baseline_cache"])
        self.history = list(state["history"])
        self._ptx_state = state["ptx_loader"]
        self._ptx_loader = self._ptx_iter = None
        torch.set_rng_state(state["torch_rng"])

    @rank_zero_only
    def write_curves(self) -> Path | None:
        """Plot the monitoring history (PNG) and write it as JSON next to it; None without history."""
        if not self.history:
            return None
        from alignlit.eval.plots import plot_curves

        out = self.hparams.curves_file
        if out is None:
            root = self.trainer.log_dir or self.trainer.default_root_dir
            out = str(Path(root) / "ppo_curves.png")
        path = plot_curves({"ppo": self.history}, out, title="PPO monitoring (PPO-max §5.2)")
        path.with_suffix(".json").write_text(json.dumps(self.history, indent=1) + "\n")
        print(f"alignlit: PPO curves written to {path}")
        return path

    def on_fit_end(self) -> None:
        self.write_curves()
        super().on_fit_end()
