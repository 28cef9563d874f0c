"""Pairwise preference model: an LM that answers which of two responses is better (algorithms.md §2)."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric

from alignlit.data.args import resolve_seed
from alignlit.data.preference import PreferenceBatch
from alignlit.data.sampler import data_parallel_rank
from alignlit.hub import Pretrained
from alignlit.lightning_internals import attached_trainer
from alignlit.losses.lm import masked_nll
from alignlit.losses.preference import ab_order_averaged_probability, ab_preference_loss
from alignlit.models.loading import load_policy
from alignlit.models.lora import LoRA
from alignlit.models.reward_model import AB_FORMAT_KEY, ABFormat, ab_logits, next_token_logits
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite


class PairwisePrefModule(AlignModule):
    """Pairwise preference model (RLHF-Workflow §2.2).

    The causal LM reads ``[CONTEXT] {x} [RESPONSE A] {y_1} [RESPONSE B] {y_2} [PREFERRED]``
    (:class:`~alignlit.models.ABFormat`) and is trained to emit ``A`` or ``B``: by default the
    cross-entropy of the 2-way softmax over the two answer logits
    (:func:`~alignlit.losses.ab_preference_loss`), or the next-token cross-entropy over the full
    vocabulary with ``vocab_loss``. In training the chosen response is shown as A or B at random
    (seeded by step, so resumed runs draw the same orders). Validation shows both orders and
    reports the order-averaged ``P(y_w ≻ y_l) = ½(P(A | y_w, y_l) + 1 - P(A | y_l, y_w))``, its
    accuracy (> ½) and the position consistency (both orders prefer the same response). The export
    is a causal LM whose config records the format; load it with
    :func:`~alignlit.models.load_preference_model`.

    Args:
        policy: a causal-LM directory (e.g. the SFT export) or a :class:`~alignlit.models.TinyLlama` spec.
        ab_format: prompt template, answer tokens and length limits (default: :class:`ABFormat`).
        vocab_loss: train with the full-vocabulary next-token cross-entropy on the answer token
            instead of the 2-way softmax.
        randomize_order: show the chosen response as A or B at random in training (False: always A).
        seed: seed of the order draws (None: the run's ``seed_everything``, :func:`alignlit.data.args.resolve_seed`).
        optim: AdamW with warmup and cosine decay (:class:`~alignlit.modules.Optim`).
        dtype: dtype the model is loaded in ("float32", "bfloat16").
        lora: LoRA adapters instead of full fine-tuning (:class:`~alignlit.models.lora.LoRA`; None: full).
        gradient_checkpointing: recompute activations in the backward pass (HF activation
            checkpointing): same gradients, less memory, about one more forward per step.
        export_dir: where the trained model is written as a Hugging Face causal-LM directory at the
            end of fit (None: no export).
    """

    stage = "pairpref"

    def __init__(
        self,
        policy: str | TinyLlama | Pretrained,
        ab_format: ABFormat | None = None,
        vocab_loss: bool = False,
        randomize_order: bool = True,
        seed: int | None = None,
        optim: Optim = Optim(lr=3e-4, warmup_steps=20),
        dtype: str = "float32",
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        export_dir: str | None = None,
    ):
        super().__init__(export_dir=export_dir, optim=optim, lora=lora)
        seed = resolve_seed(seed)
        self.save_hyperparameters()
        self.hparams.seed = seed  # resolved
        if isinstance(policy, TinyLlama):
            self.policy, self.tokenizer = load_policy(policy)
        else:
            self.policy, self.tokenizer = load_policy(policy, dtype=dtype)  # a directory, hub id or package:
        self.format = ab_format or ABFormat()
        self.answer_ids = self.format.token_ids(self.tokenizer)
        limit = getattr(self.policy.config, "max_position_embeddings", None)
        if limit is not None and self.format.max_length > limit:
            raise ValueError(
                f"ab_format.max_length={self.format.max_length} exceeds the model's max_position_embeddings={limit}"
            )
        setattr(self.policy.config, AB_FORMAT_KEY, self.format.to_dict())
        self.prepare_trained(self.policy, gradient_checkpointing=gradient_checkpointing)
        self.val_loss = MeanMetric()
        self.val_accuracy = MeanMetric()
        self.val_consistency = MeanMetric()
        self.val_prob = MeanMetric()

    def export_model(self):
        return self.policy

    def answer_logits(self, prompts: list[str], first: list[str], second: list[str]):
        """(logit_A, logit_B), each (N,), for ``first`` shown as response A and ``second`` as B."""
        seqs = [
            self.format.encode(self.tokenizer, p, a, b)
            for p, a, b in zip(prompts, first, second, strict=True)
        ]
        return ab_logits(self.policy, self.tokenizer.pad_token_id, seqs, self.answer_ids)

    def order_draw(self, n: int) -> torch.Tensor:
        """(n,) bool, True where the chosen response is shown as A; fixed by (seed, global step).

        With ``W`` data-parallel ranks the draw is made for the global batch of ``W·n`` pairs and rank
        ``r`` takes rows ``r, r + W, …``, the rows the data sampler deals it, so every pair is shown in
        the order one process would show it."""
        if not self.hparams.randomize_order:
            return torch.ones(n, dtype=torch.bool)
        rank, world = data_parallel_rank(attached_trainer(self))
        g = torch.Generator().manual_seed(self.hparams.seed * 1_000_003 + self.global_step)
        return (torch.rand(n * world, generator=g) < 0.5)[rank::world]

    def training_step(self, batch: PreferenceBatch, batch_idx: int) -> torch.Tensor:
        chosen_is_a = self.order_draw(len(batch)).to(self.device)
        first = [
            c if a else r
            for c, r, a in zip(batch.chosen_texts, batch.rejected_texts, chosen_is_a, strict=True)
        ]
        second = [
            r if a else c
            for c, r, a in zip(batch.chosen_texts, batch.rejected_texts, chosen_is_a, strict=True)
        ]
        if self.hparams.vocab_loss:
            loss, metrics = self.vocab_loss(batch.prompts, first, second, chosen_is_a)
        else:
            logit_a, logit_b = self.answer_logits(batch.prompts, first, second)
            loss, metrics = ab_preference_loss(logit_a, logit_b, chosen_is_a)
        check_finite(loss, what="pairwise preference loss", step=self.global_step, metrics=metrics)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        self.log("train/accuracy", metrics["accuracy"], prog_bar=True, batch_size=len(batch))
        return loss

    def vocab_loss(self, prompts, first, second, chosen_is_a):
        """Next-token cross-entropy over the whole vocabulary on the answer token, with the 2-way
        metrics of :func:`~alignlit.losses.ab_preference_loss`."""
        seqs = [
            self.format.encode(self.tokenizer, p, a, b)
            for p, a, b in zip(prompts, first, second, strict=True)
        ]
        logits = next_token_logits(self.policy, self.tokenizer.pad_token_id, seqs)  # (N, V)
        ids_a, ids_b = self.answer_ids
        labels = torch.where(chosen_is_a, ids_a, ids_b)[:, None]  # (N, 1)
        loss, _ = masked_nll(logits[:, None], labels, torch.ones_like(labels, dtype=torch.bool))
        _, metrics = ab_preference_loss(logits[:, ids_a].detach(), logits[:, ids_b].detach(), chosen_is_a)
        return loss, metrics

    def validation_step(self, batch: PreferenceBatch, batch_idx: int) -> None:
        n = len(batch)
        fa, fb = self.answer_logits(batch.prompts, batch.chosen_texts, batch.rejected_texts)  # chosen as A
        sa, sb = self.answer_logits(batch.prompts, batch.rejected_texts, batch.chosen_texts)  # chosen as B
        labels = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)]).to(fa.device)
        loss, _ = ab_preference_loss(torch.cat([fa, sa]), torch.cat([fb, sb]), labels)
        prob, consistent = ab_order_averaged_probability(fa, fb, sa, sb)
        self.val_loss.update(loss, weight=n)
        self.val_accuracy.update((prob > 0.5).float())
        self.val_consistency.update(consistent.float())
        self.val_prob.update(prob)
        self.log("val/loss", self.val_loss, prog_bar=True, batch_size=n)
        self.log("val/accuracy", self.val_accuracy, prog_bar=True, batch_size=n)
        self.log("val/position_consistency", self.val_consistency, batch_size=n)
        self.log("val/prob_chosen", self.val_prob, batch_size=n)

    def configure_optimizers(self):
        return self.configure_adamw(self.policy.parameters())
