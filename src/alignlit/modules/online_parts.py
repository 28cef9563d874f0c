"""The parts of the online stages that are not the loop of :class:`~alignlit.modules.online.OnlineModule`.

- :class:`KLPenalty` and :class:`PtxMix`: the KL-control and ptx settings a stage takes from its config;
- :class:`PtxMixer`: the ptx (SFT-loss) data, its loader's position and the policy's NLL on it;
- :class:`PhaseDisplay`: the phase of an online step in the progress bar;
- :class:`Validation`: the validation samples (held-out prompts scored and compared with ``π_0``);
- :func:`load_online_models`: the policy, its reference and the reward;
- :func:`data_parallel_group`, :func:`all_reduce_sum`, :func:`update_kl_controller`: sums and controllers
  over the data-parallel ranks;
- :class:`TrainedModel` and :func:`mean_metrics`: what a stage trains and the average of its minibatch
  metrics.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

from alignlit.data.sft import SFTDataModule
from alignlit.hub import Pretrained, is_repo_id, resolve_model
from alignlit.losses.lm import masked_nll, shift_for_next_token
from alignlit.models.loading import model_source
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, load_policy_and_reference
from alignlit.modules.trajectory_maker import TrajectoryMaker
from alignlit.ops.kl import AdaptiveKLController, FixedKLController, KLKind
from alignlit.rollout.base import SamplingParams
from alignlit.rollout.loop import RolloutLoop
from alignlit.rollout.reward_protocol import Reward, RewardFn, resolve_reward, score_rollout


@dataclasses.dataclass(frozen=True)
class KLPenalty:
    """The KL(π‖π_0) control of an online stage (algorithms.md §4).

    Args:
        coef: ``β`` (the initial value when adaptive).
        estimator: per-token estimator ``"k1"``, ``"k2"`` or ``"k3"``.
        target: adapt ``β`` towards this KL per response in nats (Ziegler et al. 2019); None keeps
            ``β`` fixed.
        horizon: horizon of the adaptive controller, in samples.
    """

    coef: float = 0.05
    estimator: KLKind = "k1"
    target: float | None = None
    horizon: int = 10000

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ValueError(f"kl.coef must be >= 0, got {self.coef}")
        if self.estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl.estimator must be 'k1', 'k2' or 'k3', got {self.estimator!r}")
        if self.target is not None and self.target <= 0:
            raise ValueError(f"kl.target must be > 0 or None, got {self.target}")
        if self.horizon < 1:
            raise ValueError(f"kl.horizon must be >= 1, got {self.horizon}")

    def controller(self) -> FixedKLController | AdaptiveKLController:
        """A fresh controller of ``β``."""
        if self.target is None:
            return FixedKLController(self.coef)
        return AdaptiveKLController(self.coef, self.target, self.horizon)


@dataclasses.dataclass(frozen=True)
class PtxMix:
    """Human (prompt, response) data whose SFT loss is mixed into every policy update (ChatGLM eq. 6,
    InstructGPT PPO-ptx). Its validation set gives ``val/sft_nll`` (capability retention), also
    when ``coef`` is 0. Read and encoded as :class:`~alignlit.data.SFTDataModule` does.

    Args:
        file: human (prompt, response) records.
        val_file: validation records for ``val/sft_nll`` (default: 5% of ``file``).
        coef: weight of the token-mean SFT NLL in every policy loss.
        batch_size: SFT examples per policy update.
        max_length: longest SFT prompt + response in tokens.
        max_prompt_length: SFT prompts are left-truncated to this many tokens.
    """

    file: str
    val_file: str | None = None
    coef: float = 0.0
    batch_size: int = 16
    max_length: int = 256
    max_prompt_length: int = 128

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ValueError(f"ptx.coef must be >= 0, got {self.coef}")


# checkpoints keep them in the stage's hyper-parameters
torch.serialization.add_safe_globals([KLPenalty, PtxMix])


class PtxMixer:
    """The ptx (SFT-loss) mixer of an online stage (ChatGLM eq. 6, InstructGPT PPO-ptx): the
    :class:`PtxMix` data read and encoded once, the next batch of its training loader (whose position
    goes into checkpoints for an exact resume), the policy's token-mean NLL on a batch and, on its
    validation set, ``val/sft_nll``. Without a ``config`` it adds nothing and has no data.

    Args:
        config: the ptx settings (None: off).
    """

    def __init__(self, config: PtxMix | None):
        self.config = config
        self.data: SFTDataModule | None = None
        self._loader = None
        self._iter = None
        self._state: dict[str, Any] | None = None

    def setup(self, tokenizer: str, trainer: L.Trainer | None) -> None:
        """Read and encode the ptx data (once), as :class:`~alignlit.data.SFTDataModule` does."""
        if self.config is None or self.data is not None:
            return
        self.data = SFTDataModule(
            train_file=self.config.file,
            val_file=self.config.val_file,
            tokenizer=tokenizer,
            max_length=self.config.max_length,
            max_prompt_length=self.config.max_prompt_length,
            batch_size=self.config.batch_size,
        )
        self.data.trainer = trainer
        self.data.setup("fit")

    def next_batch(self):
        """The next training batch; the loader starts a new epoch when one ends."""
        if self._iter is None:
            if self._loader is None:
                self._loader = self.data.train_dataloader()
                if self._state is not None:
                    self._loader.load_state_dict(self._state)
            self._iter = iter(self._loader)
        try:
            return next(self._iter)
        except StopIteration:
            self._loader.sampler.set_epoch(self._loader.sampler.epoch + 1)
            self._iter = iter(self._loader)
            return next(self._iter)

    @staticmethod
    def nll(
        policy: torch.nn.Module, batch, device: torch.device
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Token-mean NLL of ``policy`` on a batch of human (prompt, response) pairs (ChatGLM eq. 6)."""
        input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        logits = policy(input_ids=input_ids, attention_mask=attention_mask).logits
        return masked_nll(*shift_for_next_token(logits, input_ids, batch.loss_mask.to(device)))

    def add(
        self,
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor],
        policy: torch.nn.Module,
        device: torch.device,
    ) -> torch.Tensor:
        """``loss + ptx.coef · NLL`` on the next batch (metric ``ptx_nll``); ``loss`` when ``coef`` is 0."""
        if self.config is not None and self.config.coef > 0:
            nll, ptx_metrics = self.nll(policy, self.next_batch(), device)
            loss = loss + self.config.coef * nll
            metrics["ptx_nll"] = ptx_metrics["nll"]
        return loss

    def val_nll(self, policy: torch.nn.Module, device: torch.device) -> float | None:
        """``val/sft_nll``: the NLL of ``policy`` over every validation token; None without validation data."""
        if self.data is None or not self.data.val_set:
            return None
        nll = [self.nll(policy, b, device) for b in self.data.val_dataloader()]
        tokens = torch.stack([m["tokens"] for _, m in nll]).float()
        return float((torch.stack([loss for loss, _ in nll]) * tokens).sum() / tokens.sum())

    def state_dict(self) -> dict[str, Any] | None:
        """The training loader's position (the restored one until the loader is built; None before)."""
        return self._loader.state_dict() if self._loader is not None else self._state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`: the loader is rebuilt at that position on the next batch."""
        self._state = state
        self._loader = self._iter = None


class PhaseDisplay(L.Callback):
    """Shows the phase of an online step (``rollout``, ``train``) in the progress bar's description.

    Installed by :class:`~alignlit.modules.online.OnlineModule` (``configure_callbacks``); uses only
    the progress bars' public attributes, and does nothing without a progress bar.
    """

    def show(self, trainer: L.Trainer, phase: str) -> None:
        bar: ProgressBar | None = trainer.progress_bar_callback
        if bar is None or not bar.is_enabled:
            return
        description = f"Epoch {trainer.current_epoch} [{phase}]"
        if isinstance(bar, TQDMProgressBar) and bar.train_progress_bar is not None:
            bar.train_progress_bar.set_description(description, refresh=True)
        elif (
            isinstance(bar, RichProgressBar)
            and bar.progress is not None
            and bar.train_progress_bar_id is not None
        ):
            bar.progress.update(bar.train_progress_bar_id, description=description)
            bar.refresh()


class Validation:
    """The validation of an online stage: each validation batch is sampled once (``sampling``, default the
    rollout's, seeded ``rollout.seed + i`` for batch ``i``) and scored: ``val/reward``, ``val/gold`` (with
    ``gold``), ``val/kl`` (the engine's log-probs against the reference's, summed over the response) and
    ``val/length``, averaged over the epoch by :meth:`metrics`, and with ptx validation data ``val/sft_nll``.

    Args:
        loop: the rollout loop that samples.
        reward: the stage's reward.
        trajectories: what computes the reference's log-probs (its ``reference``).
        ptx: the ptx mixer (``val/sft_nll`` on its validation data).
        gold: a reward scored as ``val/gold`` (None: not logged).
        sampling: the validation sampling (None: the rollout's).
    """

    def __init__(
        self,
        loop: RolloutLoop,
        reward: Reward,
        trajectories: TrajectoryMaker,
        ptx: PtxMixer,
        *,
        gold: RewardFn | None = None,
        sampling: SamplingParams | None = None,
    ):
        self.loop, self.reward, self.trajectories, self.ptx = loop, reward, trajectories, ptx
        self.gold, self.sampling = gold, sampling
        self.records: list[dict[str, torch.Tensor]] = []

    def sample(self, prompts: list[str], batch_idx: int, *, version: int, device: torch.device) -> None:
        """Sample and score validation batch ``batch_idx`` from the policy at ``version``."""
        sampling = dataclasses.replace(self.sampling or self.loop.sampling, seed=self.loop.seed + batch_idx)
        rollout = self.loop.generate(prompts, version=version, n=1, sampling=sampling)
        actions = rollout.response_mask if rollout.action_mask is None else rollout.action_mask  # episodes
        ids = (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
        maker = self.trajectories
        ref = maker.logprobs(maker.reference, ids, device=device, temperature=sampling.temperature)
        record = {
            "val/reward": score_rollout(self.reward, rollout),
            "val/kl": ((rollout.logprobs.to(device) - ref) * actions.to(device)).sum(-1).cpu(),
            "val/length": actions.sum(-1).float(),
        }
        if self.gold is not None:
            record["val/gold"] = score_rollout(self.gold, rollout)
        self.records.append(record)

    def metrics(self, policy: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """The means over the epoch's samples (the records are cleared) and ``val/sft_nll`` of ``policy``."""
        records, self.records = self.records, []
        metrics = {k: float(torch.cat([r[k] for r in records]).mean()) for k in records[0]} if records else {}
        sft_nll = self.ptx.val_nll(policy, device)
        if sft_nll is not None:
            metrics["val/sft_nll"] = sft_nll
        return metrics


def data_parallel_group(mesh):
    """The process group of the data-parallel ranks of a device ``mesh`` (None: the default group).
    Tensor-parallel peers hold the same samples, so statistics over the global batch are summed over this
    group only."""
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        return mesh["data_parallel"].get_group()
    return None


def all_reduce_sum(values: torch.Tensor, group) -> torch.Tensor:
    """``values`` summed over the ranks of ``group`` (a copy; unchanged in a single process)."""
    out = values.detach().clone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(out, group=group)
    return out


def update_kl_controller(controller, kl_sum: float, count: int, all_reduce_sum, device) -> float:
    """Adapt ``controller`` to the mean KL per response over the global batch (``kl_sum`` and ``count``
    summed over the data-parallel ranks by ``all_reduce_sum``, the global batch's responses counted as its
    steps), so that every rank holds the value one process would over the same batch. Returns that mean."""
    totals = all_reduce_sum(torch.tensor([kl_sum, float(count)], dtype=torch.float64, device=device))
    mean = float(totals[0] / totals[1])
    controller.update(mean, round(float(totals[1])))
    return mean


class OnlineModels(NamedTuple):
    """The models of an online stage, as :func:`load_online_models` loads them."""

    policy: torch.nn.Module
    tokenizer: Any
    reference: torch.nn.Module | None
    reward: Reward
    policy_dir: str | None
    """The local directory the policy was loaded from (a hub id's snapshot, not the id): what the vLLM
    engine is built from (:meth:`~alignlit.rollout.RolloutLoop.setup`)."""
    tokenizer_dir: str | None
    """Where the ptx data's tokenizer is read."""
    position_limit: int | None
    """The policy's ``max_position_embeddings`` (None: unlimited)."""


def load_online_models(
    module: AlignModule,
    policy: str | TinyLlama | Pretrained,
    reference: str | Pretrained | None,
    reward: str | Reward,
    *,
    dtype: str,
    frozen_dtype: str,
    gradient_checkpointing: bool,
    reward_batch_size: int,
) -> OnlineModels:
    """The trained policy, its frozen reference (:func:`~alignlit.modules.base.load_policy_and_reference`)
    and the reward (:func:`~alignlit.rollout.reward_protocol.resolve_reward`; a reward model by hub id is fetched)."""
    model, tokenizer, ref = load_policy_and_reference(
        module, policy, reference, copy_policy=True, dtype=dtype, frozen_dtype=frozen_dtype,
        gradient_checkpointing=gradient_checkpointing,
    )  # fmt: skip
    source = model_source(model)
    policy_dir = source["dir"] if source is not None else None
    if isinstance(reward, str) and is_repo_id(reward) and not Path(reward).exists():
        reward = str(resolve_model(reward, what="reward model"))
    return OnlineModels(
        model, tokenizer, ref, resolve_reward(reward, batch_size=reward_batch_size, dtype=frozen_dtype), policy_dir,
        policy.tokenizer if isinstance(policy, TinyLlama) else policy_dir,
        getattr(model.config, "max_position_embeddings", None),
    )  # fmt: skip


class TrainedModel(NamedTuple):
    """A model an online stage updates, with its own optimizer and LR schedule."""

    name: str
    """Name in metrics (``lr/<name>``) and in :meth:`~alignlit.modules.online.OnlineModule.update`."""
    module: torch.nn.Module
    optim: Optim
    first_rollout: int = 0
    """Rollouts before its first update (its schedule runs over the remaining ones)."""


def mean_metrics(records: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Average each metric over the minibatch records that have it."""
    keys = sorted({k for rec in records for k in rec})
    return {k: float(torch.stack([rec[k].float() for rec in records if k in rec]).mean()) for k in keys}
