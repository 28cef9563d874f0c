"""RRHF: rank k responses per prompt by length-normalised log-probability, plus SFT on the best."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric

from alignlit.data.ranking import RankingBatch
from alignlit.hub import Pretrained
from alignlit.losses import rrhf_loss
from alignlit.models.forward import token_logprobs
from alignlit.models.loading import load_policy
from alignlit.models.lora import LoRA
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite


class RRHFModule(AlignModule):
    """RRHF (Yuan et al. 2023; algorithms.md §7) on ``k`` scored responses per prompt.

    With ``p_i = (1/|y_i|) Σ_t log π(y_{i,t} | x, y_{i,<t})`` the loss per prompt is
    ``rank_weight · Σ_{r_i < r_j} max(0, p_i - p_j) + sft_weight · (-Σ_t log π(y_{i*,t} | …))``,
    ``i* = argmax_i r_i``, averaged over prompts (:func:`alignlit.losses.rrhf_loss`). All ``B·k``
    responses of a batch go through the policy in one forward; prompt and padding tokens are
    excluded everywhere, so any batch size and ``k`` give the same per-prompt loss. No reference
    model is needed. Data: a :class:`~alignlit.data.RankingDataModule` (e.g. ``alignlit sample``
    output scored by a reward model).

    Args:
        policy: causal-LM directory to start from (usually the SFT export), or a
            :class:`~alignlit.models.TinyLlama` spec.
        rank_weight: weight of the ranking hinge loss.
        sft_weight: weight of the summed NLL of the best response.
        optim: AdamW with warmup and cosine decay (:class:`~alignlit.modules.Optim`).
        dtype: dtype the policy is loaded in ("float32", "bfloat16").
        lora: LoRA adapters instead of full fine-tuning (:class:`~alignlit.models.lora.LoRA`; None: full).
        gradient_checkpointing: recompute activations in the backward pass (HF activation
            checkpointing): same gradients, less memory, about one more forward per step.
        export_dir: where the trained policy is written as a Hugging Face directory at the end of fit.
    """

    stage = "rrhf"

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        rank_weight: float = 1.0,
        sft_weight: float = 1.0,
        optim: Optim = Optim(lr=1e-5, warmup_steps=10),
        dtype: str = "float32",
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        export_dir: str | None = None,
    ):
        super().__init__(export_dir=export_dir, optim=optim, lora=lora)
        if rank_weight < 0 or sft_weight < 0:
            raise ValueError(f"rank_weight and sft_weight must be >= 0, got {rank_weight} and {sft_weight}")
        self.save_hyperparameters()
        self.policy, self.tokenizer = (
            load_policy(policy) if isinstance(policy, TinyLlama) else load_policy(policy, dtype=dtype)
        )
        self.prepare_trained(self.policy, gradient_checkpointing=gradient_checkpointing)
        self.policy.train()  # from_pretrained returns eval mode
        self.val_loss = MeanMetric()
        self.val_rank_loss = MeanMetric()
        self.val_accuracy = MeanMetric(nan_strategy="ignore")

    def export_model(self):
        return self.policy

    def rrhf(self, batch: RankingBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`~alignlit.losses.rrhf_loss` of one batch of ``B`` prompts x ``k`` responses."""
        num_prompts, k = batch.rewards.shape
        if batch.input_ids.shape[0] != num_prompts * k:
            raise ValueError(
                f"ranking batch has {batch.input_ids.shape[0]} sequences for rewards of shape "
                f"{tuple(batch.rewards.shape)}; expected B*k = {num_prompts * k}"
            )
        scored = token_logprobs(self.policy, batch.input_ids, batch.attention_mask, batch.loss_mask)
        width = scored.logprobs.shape[-1]
        return rrhf_loss(
            scored.logprobs.view(num_prompts, k, width),  # (B, k, T-1)
            scored.mask.view(num_prompts, k, width),
            batch.rewards,
            rank_weight=self.hparams.rank_weight,
            sft_weight=self.hparams.sft_weight,
        )

    def training_step(self, batch: RankingBatch, batch_idx: int) -> torch.Tensor:
        loss, metrics = self.rrhf(batch)
        check_finite(loss, what="RRHF loss", step=self.global_step, metrics=metrics)
        for name, value in metrics.items():
            if name == "ranking_accuracy" and torch.isnan(value):
                continue  # every reward of the batch tied: no pair to rank
            self.log(f"train/{name}", value, prog_bar=name == "loss", batch_size=len(batch))
        return loss

    def validation_step(self, batch: RankingBatch, batch_idx: int) -> None:
        loss, metrics = self.rrhf(batch)
        self.val_loss.update(loss, weight=len(batch))
        self.val_rank_loss.update(metrics["rank_loss"], weight=len(batch))
        self.val_accuracy.update(metrics["ranking_accuracy"], weight=len(batch))
        self.log("val/loss", self.val_loss, prog_bar=True, batch_size=len(batch))
        self.log("val/rank_loss", self.val_rank_loss, batch_size=len(batch))
        self.log("val/ranking_accuracy", self.val_accuracy, batch_size=len(batch))

    def configure_optimizers(self):
        return self.configure_adamw(self.policy.parameters())
