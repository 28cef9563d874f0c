"""Offline preference optimisation: DPO, cDPO, IPO, hinge, SimPO, SLiC or any registered preference
loss, with an optional SFT term (RPO)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torchmetrics import MeanMetric

from alignlit.hub import Pretrained
from alignlit.lightning_internals import attached_trainer
from alignlit.losses import PreferenceLoss
from alignlit.models.loading import check_dtype, load_policy, resolve_source
from alignlit.models.lora import LoRA
from alignlit.models.reference_cache import (
    ReferenceCache,
    cache_file,
    dataset_loaders,
    reference_fingerprint,
)
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite, frozen, load_policy_and_reference
from alignlit.modules.preference_objective import PreferenceObjective

log = logging.getLogger(__name__)

_VAL_METRICS = {
    "loss": "loss",
    "rewards/accuracy": "accuracy",
    "rewards/margin": "margin",
    "rewards/chosen": "chosen",
    "rewards/rejected": "rejected",
}


class DPOModule(AlignModule):
    """Direct preference optimisation of a policy, against a frozen reference or reference-free
    (algorithms.md §5, §9).

    The loss comes from the preference-loss registry (:mod:`alignlit.losses.preference_registry`),
    with ``h = β[(log π_θ(y_w|x) - log π_0(y_w|x)) - (log π_θ(y_l|x) - log π_0(y_l|x))]`` and
    ``ℓ = log π_θ(y|x)``: ``dpo`` ``-log σ(h)`` (with ``label_smoothing = ε``: cDPO
    ``-(1-ε)log σ(h) - ε log σ(-h)``), ``ipo`` ``(h/β - 1/(2β))²``, ``hinge`` ``max(0, 1 - h)``,
    ``simpo`` ``-log σ(β(ℓ_w/|y_w| - ℓ_l/|y_l|) - γ)``, ``slic`` ``max(0, δ - ℓ_w + ℓ_l)``; plus
    ``α·NLL(y_w|x)/|y_w|`` for any loss when ``sft_weight = α > 0`` (RPO). Chosen and rejected
    responses go through the policy in one concatenated forward, with dropout off (so the loss at
    initialisation is the loss at ``h = 0``). Data: a :class:`~alignlit.data.PreferenceDataModule`.

    Reference log-probs are either computed each step by a frozen reference model kept in memory,
    or (``precompute_reference``) computed once before training and cached next to the training
    data; then no reference model is in memory while training. Reference-free losses (``simpo``,
    ``slic``) build no reference and no cache. With ``lora`` and the default reference, the
    reference is the policy's base with the adapter disabled (no second copy of the weights).

    Args:
        policy: causal-LM directory to start from (usually the SFT export), or a
            :class:`~alignlit.models.TinyLlama` spec.
        reference: reference-policy directory ``π_0`` (default: the policy's starting weights);
            ``none``: no reference (what a reference-free loss implies anyway).
        loss_type: a registered preference loss, ``dpo``, ``ipo``, ``hinge``, ``simpo`` or ``slic``
            (``alignlit.losses.PREFERENCE_LOSSES``), or the dotted path of a function registered
            elsewhere (``mypkg.losses.my_loss``); or a loss object as ``class_path`` + ``init_args``
            (:class:`~alignlit.losses.PreferenceLoss`).
        loss_args: hyperparameters of a registered loss, defaults: dpo ``{beta: 0.1,
            label_smoothing: 0.0}`` (``label_smoothing = ε ∈ [0, 0.5]``, the assumed label-flip
            rate, makes it cDPO); ipo and hinge ``{beta: 0.1}``; simpo ``{beta: 2.0, gamma: 0.5}``;
            slic ``{delta: 1.0}``.
        beta: ``β > 0`` of the DPO family, a shortcut for ``loss_args: {beta: ...}`` (None: the
            loss's default).
        sft_weight: ``α ≥ 0``, weight of the length-normalised NLL of the chosen response (RPO),
            added to whichever loss is trained.
        precompute_reference: compute the reference log-probs once and cache them (no reference
            model in memory during training) instead of a reference forward every step.
        reference_cache_dir: where the cache lives (default: ``.alignlit_cache/`` next to the
            training data file).
        optim: AdamW with warmup and cosine decay (:class:`~alignlit.modules.Optim`).
        dtype: dtype the policy and reference are loaded in ("float32", "bfloat16").
        frozen_dtype: dtype of a reference loaded as a model of its own (default: ``dtype``), e.g.
            ``bfloat16`` next to a float32 policy.
        lora: LoRA adapters instead of full fine-tuning (:class:`~alignlit.models.lora.LoRA`; None: full).
        gradient_checkpointing: recompute the policy's activations in the backward pass (HF
            activation checkpointing): same gradients, less memory, about one more forward per step.
        export_dir: where the trained policy is written as a Hugging Face directory at the end of fit.
    """

    stage = "dpo"

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        reference: str | Pretrained | None = None,
        loss_type: str | PreferenceLoss = "dpo",
        loss_args: dict[str, Any] | None = None,
        beta: float | None = None,
        sft_weight: float = 0.0,
        precompute_reference: bool = True,
        reference_cache_dir: str | None = None,
        optim: Optim = Optim(lr=1e-5, warmup_steps=10),
        dtype: str = "float32",
        frozen_dtype: str | None = None,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        export_dir: str | None = None,
    ):
        super().__init__(export_dir=export_dir, optim=optim, lora=lora)
        self.frozen_dtype = check_dtype(frozen_dtype or dtype, "frozen_dtype")
        self.objective = PreferenceObjective(loss_type, loss_args, beta=beta, sft_weight=sft_weight)
        self.reference_source = self.objective.reference_source(reference, default=policy)
        self.save_hyperparameters()
        if self.hparams.get("loss_type") is loss_type and not isinstance(loss_type, str):
            self.hparams["loss_type"] = self.objective.name  # checkpoints hold plain values only
        starts_at_policy = self.reference_source is policy
        copy_policy = starts_at_policy and (lora is not None or isinstance(policy, TinyLlama))
        load_now = self.reference_source is not None and not precompute_reference and not copy_policy
        self.policy, self.tokenizer, reference_model = load_policy_and_reference(
            self, policy, self.reference_source if load_now else None, copy_policy=copy_policy,
            dtype=dtype, frozen_dtype=self.frozen_dtype, gradient_checkpointing=gradient_checkpointing,
        )  # fmt: skip
        # Not registered as a submodule: it is frozen and never part of checkpoints or of DDP.
        self._reference: list[torch.nn.Module] = [reference_model] if reference_model is not None else []
        self.reference_cache: ReferenceCache | None = None
        #: "hit" or "miss" once the precomputed reference cache has been resolved
        self.reference_cache_status: str | None = None
        self.reference_cache_path: Path | None = None
        self.val_metrics = torch.nn.ModuleDict({name: MeanMetric() for name in _VAL_METRICS.values()})

    # ----------------------------------------------------------------- reference log-probs
    @property
    def reference_model(self) -> torch.nn.Module | None:
        return self._reference[0] if self._reference else None

    def _load_reference(self) -> torch.nn.Module:
        return frozen(load_policy(self.reference_source, dtype=self.frozen_dtype)[0])

    def prepare_reference(self, datamodule=None) -> None:
        """Resolve the reference log-probs cache: load it on a hit, compute and write it on a miss.

        Runs on fit start; call it directly (with a set-up ``datamodule``) to build the cache ahead
        of training. With several processes rank 0 computes and the others wait for it. Nothing to
        do for a reference-free loss or without ``precompute_reference``.
        """
        if self.reference_source is None or not self.hparams.precompute_reference:
            return
        if self.reference_cache is not None:
            return
        trainer = attached_trainer(self)
        datamodule = datamodule or (getattr(trainer, "datamodule", None) if trainer is not None else None)
        if datamodule is None:
            raise ValueError("precompute_reference needs a datamodule; or set precompute_reference: false")
        weights = (  # the model itself, or its local directory (a hub id's snapshot), whose files are hashed
            self.reference_model
            if isinstance(self.reference_source, TinyLlama)
            else resolve_source(self.reference_source, "reference")[0]
        )
        fingerprint = reference_fingerprint(
            weights, datamodule=datamodule, tokenizer=self.tokenizer, dtype=self.frozen_dtype
        )
        path = cache_file(
            fingerprint,
            train_file=datamodule.hparams.get("train_file"),
            cache_dir=self.hparams.reference_cache_dir,
        )
        hit = path.exists()
        if not hit and (trainer is None or trainer.is_global_zero):
            reference = self.reference_model if self.reference_model is not None else self._load_reference()
            reference.to(self.device)
            cache = ReferenceCache.compute(reference, dataset_loaders(datamodule), self.device)
            cache.save(path)
            ReferenceCache.remove_stale(path)
            log.info("reference log-probs: computed %d sequences -> %s", len(cache), path)
        if trainer is not None:
            trainer.strategy.barrier("dpo_reference_cache")
        self.reference_cache = ReferenceCache.load(path)
        self.reference_cache_status = "hit" if hit else "miss"
        self.reference_cache_path = path
        self._reference.clear()  # no reference model in memory while training

    def on_fit_start(self) -> None:
        if self.reference_model is not None:
            self.reference_model.to(self.device)
        self.prepare_reference()

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking and self.trainer.state.fn == "validate":
            self.on_fit_start()

    # ----------------------------------------------------------------- loss
    def export_model(self):
        return self.policy

    def preference_loss(self, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The configured loss (plus the SFT term) on one (2B, T) preference batch, with its metrics."""
        reference = self.reference_cache if self.reference_cache is not None else self.reference_model
        if self.reference_source is not None and reference is None:
            raise RuntimeError("no reference: call prepare_reference() (done on fit start) first")
        return self.objective(self.policy, batch, reference)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, metrics = self.preference_loss(batch)
        check_finite(loss, what=f"{self.objective.name} loss", step=self.global_step, metrics=metrics)
        size = batch.input_ids.shape[0] // 2
        for name, value in metrics.items():
            self.log(f"train/{name}", value, prog_bar=name in ("loss", "rewards/accuracy"), batch_size=size)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        _, metrics = self.preference_loss(batch)
        size = batch.input_ids.shape[0] // 2
        for key, name in _VAL_METRICS.items():
            if key in metrics:
                self.val_metrics[name].update(metrics[key], weight=size)
                label = "val/loss" if name == "loss" else f"val/rewards/{name}"
                self.log(
                    label, self.val_metrics[name], prog_bar=name in ("loss", "accuracy"), batch_size=size
                )

    def configure_optimizers(self):
        return self.configure_adamw(self.policy.parameters())
