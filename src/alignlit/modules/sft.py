"""Supervised fine-tuning on (prompt, response) pairs."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric

from alignlit.data.encoding import LMBatch
from alignlit.hub import Pretrained
from alignlit.models.forward import token_nll
from alignlit.models.loading import load_policy
from alignlit.models.lora import LoRA
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite


class SFTModule(AlignModule):
    """Next-token loss on response tokens (prompt and padding masked out).

    Args:
        policy: a Hugging Face causal-LM directory, or a :class:`~alignlit.models.TinyLlama` spec
            to train a tiny model from scratch.
        optim: AdamW with warmup and cosine decay (:class:`~alignlit.modules.Optim`).
        dtype: dtype the policy is loaded in ("float32", "bfloat16").
        lora: LoRA adapters instead of full fine-tuning (:class:`~alignlit.models.lora.LoRA`; None: full).
        gradient_checkpointing: recompute activations in the backward pass (HF activation
            checkpointing): same gradients, less memory, about one more forward per step.
        export_dir: where the trained policy is written as a Hugging Face directory at the end of fit
            (None: no export).
    """

    stage = "sft"

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        optim: Optim = Optim(lr=3e-4, warmup_steps=50),
        dtype: str = "float32",
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        export_dir: str | None = None,
    ):
        super().__init__(export_dir=export_dir, optim=optim, lora=lora)
        self.save_hyperparameters()
        self.policy, self.tokenizer = (
            load_policy(policy) if isinstance(policy, TinyLlama) else load_policy(policy, dtype=dtype)
        )
        self.prepare_trained(self.policy, gradient_checkpointing=gradient_checkpointing)
        self.val_nll = MeanMetric()

    def export_model(self):
        return self.policy

    def nll(self, batch: LMBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Token-mean NLL over the batch's response tokens."""
        return token_nll(self.policy, batch.input_ids, batch.attention_mask, batch.loss_mask)

    def training_step(self, batch: LMBatch, batch_idx: int) -> torch.Tensor:
        loss, metrics = self.nll(batch)
        check_finite(loss, what="SFT loss", step=self.global_step, metrics=metrics)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        self.log("train/tokens", metrics["tokens"].float(), reduce_fx="sum", batch_size=len(batch))
        return loss

    def validation_step(self, batch: LMBatch, batch_idx: int) -> None:
        loss, metrics = self.nll(batch)
        self.val_nll.update(loss, weight=metrics["tokens"])
        self.log("val/loss", self.val_nll, prog_bar=True, batch_size=len(batch))

    def on_validation_epoch_end(self) -> None:
        self.log("val/ppl", torch.exp(self.val_nll.compute()), sync_dist=True)

    def configure_optimizers(self):
        return self.configure_adamw(self.policy.parameters())
