"""The parts of the online stages that are not the loop of :class:`~alignlit.modules.online.OnlineModule`.

- :class:`KLPenalty` and :class:`PtxMix`: the KL-control and ptx settings a stage takes from its config;
- :class:`PtxMixer`: the ptx (SFT-loss) data, its loader's position and the policy's NLL on it;
- :class:`PhaseDisplay`: the phase of an online step in the progress bar;
- :class:`DataParallelStats`: sums and controllers over the global batch of several data-parallel ranks;
- :class:`ValidationSampling`: the validation steps (held-out samples scored and compared with ``π_0``);
- :class:`TrainedModel` and :func:`mean_metrics`: what a stage trains and the average of its minibatch
  metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

from alignlit.data.sft import SFTDataModule
from alignlit.losses.lm import masked_nll, shift_for_next_token
from alignlit.modules.base import Optim
from alignlit.ops.kl import AdaptiveKLController, FixedKLController, KLKind
from alignlit.rollout.reward import score_rollout


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


class DataParallelStats:
    """Statistics over the global batch of several data-parallel ranks: the methods
    :class:`~alignlit.modules.online.OnlineModule` (a LightningModule: ``device_mesh``, ``device``)
    takes from this base and a stage calls to decide, normalise or adapt over every rank as one
    process would over the same batch."""

    def data_parallel_group(self):
        """The process group of the data-parallel ranks (None: the default group). Tensor-parallel peers
        hold the same samples, so statistics over the global batch are summed over this group only."""
        mesh = self.device_mesh
        if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
            return mesh["data_parallel"].get_group()
        return None

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the data-parallel ranks (a copy; unchanged in a single process)."""
        out = values.detach().clone().to(self.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(out, group=self.data_parallel_group())
        return out

    def batch_all_reduce(self):
        """The ``all_reduce`` the ops take to compute statistics over the global batch
        (:data:`alignlit.ops.stats.AllReduce`): :meth:`all_reduce_sum` when a process group is
        initialised, else None (one process: the ops' local statistics)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return self.all_reduce_sum
        return None

    def update_kl_controller(self, controller, kl_sum: float, count: int) -> float:
        """Adapt ``controller`` to the mean KL per response over the global batch (``kl_sum`` and ``count``
        summed over the data-parallel ranks), counting the global batch's responses as its steps, so
        that every rank holds the value one process would over the same batch. Returns that mean."""
        totals = self.all_reduce_sum(
            torch.tensor([kl_sum, float(count)], dtype=torch.float64, device=self.device)
        )
        mean = float(totals[0] / totals[1])
        controller.update(mean, round(float(totals[1])))
        return mean


class ValidationSampling:
    """Validation of an online stage, the methods :class:`~alignlit.modules.online.OnlineModule` takes
    from this base: each validation batch is sampled once (``val_sampling``, seeded ``rollout.seed + i``)
    and scored: ``val/reward``, ``val/gold`` (with ``gold``), ``val/kl`` (the engine's log-probs against
    the reference's, summed over the response), ``val/length``, and ``val/sft_nll`` with ptx data."""

    def validation_step(self, prompts: list[str], batch_idx: int) -> None:
        sampling = self.val_sampling or self.rollout.sampling
        sampling = dataclasses.replace(sampling, seed=self.rollout.seed + batch_idx)
        rollout = self.rollout.generate(prompts, version=self.policy_version, n=1, sampling=sampling)
        actions = rollout.response_mask if rollout.action_mask is None else rollout.action_mask  # episodes
        mask = actions.to(self.device)
        ids = (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
        ref = self.logprobs(self.reference, ids, temperature=sampling.temperature)
        record = {
            "val/reward": score_rollout(self.reward, rollout),
            "val/kl": ((rollout.logprobs.to(self.device) - ref) * mask).sum(-1).cpu(),
            "val/length": actions.sum(-1).float(),
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
