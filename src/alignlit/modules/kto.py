"""KTO: offline alignment from unpaired thumbs-up / thumbs-down examples (Ethayarajh et al. 2024)."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric

from alignlit.data.unpaired import UnpairedBatch
from alignlit.losses.kto import kto_loss, kto_reference_point
from alignlit.models.forward import token_logprobs
from alignlit.models.lora import LoRA
from alignlit.models.modes import eval_mode
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite, load_policy_and_reference


class KTOModule(AlignModule):
    """KTO on unpaired examples (:class:`~alignlit.data.UnpairedDataModule`).

    Each step scores every example's completion under the policy and the frozen reference (one forward each
    over the batch's matched and mismatched sequences together), estimates the reference point ``z_ref``
    from the mismatched ones (each prompt with another example's completion; batch mean of the implicit
    reward, detached, clamped at 0) and trains :func:`~alignlit.losses.kto_loss`. A batch needs at least two
    examples for the estimate to use another example's completion.

    Args:
        policy: causal-LM directory or hub id to start from (usually the SFT export), or a
            :class:`~alignlit.models.TinyLlama` spec.
        reference: reference-policy directory or hub id (default: the policy's starting weights; with
            ``lora``, the base with the adapter disabled).
        beta: ``β > 0``.
        desirable_weight, undesirable_weight: ``λ_D`` and ``λ_U`` (balance them when the labels are
            unbalanced: ``λ_D n_D / (λ_U n_U)`` in ``[1, 4/3]``).
        optim: AdamW with warmup and cosine decay.
        dtype, frozen_dtype: dtypes of the policy and of a reference loaded as its own model.
        lora: LoRA adapters instead of full fine-tuning (None: full).
        gradient_checkpointing: recompute the policy's activations in the backward pass.
        export_dir: where the trained policy is written at the end of fit.
    """

    stage = "kto"

    def __init__(
        self,
        policy: str | TinyLlama,
        reference: str | None = None,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        optim: Optim = Optim(lr=5e-6, warmup_steps=10),
        dtype: str = "float32",
        frozen_dtype: str | None = None,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        export_dir: str | None = None,
    ):
        super().__init__(export_dir=export_dir, optim=optim, lora=lora)
        if not beta > 0:
            raise ValueError(f"KTOModule: beta must be > 0, got {beta}")
        if desirable_weight < 0 or undesirable_weight < 0:
            raise ValueError("KTOModule: desirable_weight and undesirable_weight must be >= 0")
        self.save_hyperparameters()
        self.policy, self.tokenizer, self.reference = load_policy_and_reference(
            self, policy, reference, copy_policy=True, dtype=dtype, frozen_dtype=frozen_dtype or dtype,
            gradient_checkpointing=gradient_checkpointing,
        )  # fmt: skip
        self.val_loss = MeanMetric()

    def export_model(self):
        return self.policy

    def sequence_logps(
        self, model: torch.nn.Module, batch: UnpairedBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) log-probs of the matched and of the mismatched completions under ``model`` (one forward)."""
        m, x = batch.matched, batch.mismatched
        width = max(m.input_ids.shape[1], x.input_ids.shape[1])

        def pad(t: torch.Tensor, value) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        ids = torch.cat(
            [pad(m.input_ids, self.tokenizer.pad_token_id), pad(x.input_ids, self.tokenizer.pad_token_id)]
        )
        attn = torch.cat([pad(m.attention_mask, False), pad(x.attention_mask, False)])
        loss = torch.cat([pad(m.loss_mask, False), pad(x.loss_mask, False)])
        total = token_logprobs(model, ids, attn, loss).sum()  # (2B,)
        return total[: len(batch)], total[len(batch) :]

    def kto(self, batch: UnpairedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy, policy_mis = self.sequence_logps(self.policy, batch)
        with torch.no_grad(), eval_mode(self.reference):
            reference, reference_mis = self.sequence_logps(self.reference, batch)
        z = kto_reference_point(policy_mis.detach(), reference_mis)
        hp = self.hparams
        return kto_loss(
            policy, reference, batch.desirable.to(policy.device), z, beta=hp.beta,
            desirable_weight=hp.desirable_weight, undesirable_weight=hp.undesirable_weight,
        )  # fmt: skip

    def training_step(self, batch: UnpairedBatch, batch_idx: int) -> torch.Tensor:
        loss, metrics = self.kto(batch)
        check_finite(loss, what="KTO loss", step=self.global_step, metrics=metrics)
        for name, value in metrics.items():
            self.log(f"train/{name}", value, prog_bar=name == "loss", batch_size=len(batch))
        return loss

    def validation_step(self, batch: UnpairedBatch, batch_idx: int) -> None:
        loss, metrics = self.kto(batch)
        self.val_loss.update(loss, weight=len(batch))
        self.log("val/loss", self.val_loss, prog_bar=True, batch_size=len(batch))
        for name in ("rewards/chosen", "rewards/rejected", "kl"):
            if name in metrics:
                self.log(f"val/{name}", metrics[name], batch_size=len(batch))

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device)

    def configure_optimizers(self):
        return self.configure_adamw(self.policy.parameters())
