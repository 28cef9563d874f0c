"""Offline preference optimisation: DPO, conservative DPO, IPO, with an optional SFT term (RPO)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

from alignlit.losses import dpo_loss, ipo_loss, rpo_sft_term, shift_for_next_token
from alignlit.models.loading import load_policy
from alignlit.models.tiny import TinyLlama
from alignlit.modules.base import AlignModule, Optim, check_finite
from alignlit.ops.logprobs import gather_logprobs

log = logging.getLogger(__name__)

LossType = Literal["dpo", "ipo"]


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced ``log π(y_t | x, y_<t)`` of the loss-masked tokens of right-padded sequences.

    Args:
        model: causal LM returning ``.logits`` (N, T, V).
        input_ids: (N, T) right-padded prompt + response ids.
        attention_mask: (N, T) True on real tokens.
        loss_mask: (N, T) True on response tokens.

    Returns:
        ``(token_logps, mask)``, both (N, T-1): position ``t`` scores token ``t + 1``; log-probs are
        0 where ``mask`` is False.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (N, T, V)
    logits, labels, mask = shift_for_next_token(logits, input_ids, loss_mask)  # (N, T-1, V), (N, T-1) x2
    mask = mask.bool()
    logps = gather_logprobs(logits, labels.masked_fill(~mask, 0))  # (N, T-1)
    return logps * mask, mask


@dataclass
class PairLogps:
    """Per-sequence log-probs (sums over response tokens) of the chosen and rejected responses.

    Attributes:
        chosen: (B,) ``log π(y_w|x)``.
        rejected: (B,) ``log π(y_l|x)``.
    """

    chosen: torch.Tensor
    rejected: torch.Tensor


def pair_logprobs(model: torch.nn.Module, batch) -> tuple[PairLogps, torch.Tensor]:
    """Chosen and rejected log-probs from ONE forward over the concatenated (2B, T) batch.

    ``batch`` is a :class:`~alignlit.data.preference.PreferenceBatch`: rows ``[0, B)`` chosen,
    ``[B, 2B)`` rejected. Returns ``(logps, chosen_lengths)`` with ``chosen_lengths`` (B,) ``|y_w|``.
    """
    rows = batch.input_ids.shape[0]
    if rows % 2:
        raise ValueError(f"a preference batch needs 2B rows (chosen then rejected), got {rows}")
    token_logps, mask = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    sums = token_logps.sum(-1)  # (2B,)
    half = rows // 2
    return PairLogps(sums[:half], sums[half:]), mask[:half].sum(-1)


def _dpo(policy: PairLogps, reference: PairLogps, *, beta: float, label_smoothing: float):
    return dpo_loss(
        policy.chosen,
        policy.rejected,
        reference.chosen,
        reference.rejected,
        beta=beta,
        label_smoothing=label_smoothing,
    )


def _ipo(policy: PairLogps, reference: PairLogps, *, beta: float, label_smoothing: float):
    return ipo_loss(policy.chosen, policy.rejected, reference.chosen, reference.rejected, beta=beta)


PREFERENCE_LOSSES: dict[str, Callable] = {"dpo": _dpo, "ipo": _ipo}
"""``loss_type`` -> loss on (policy, reference) :class:`PairLogps`; cDPO is ``dpo`` with label smoothing."""

_NOT_TOKENISATION = {"batch_size", "eval_batch_size", "num_workers"}


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _dir_digest(path: Path) -> dict[str, str]:
    """sha256 of every file of a model directory (alignlit.json, which holds only metadata, excluded)."""
    return {
        str(p.relative_to(path)): _file_digest(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "alignlit.json"
    }


def _path_fingerprint(value):
    if isinstance(value, str) and value:
        p = Path(value)
        if p.is_file():
            return {"file": _file_digest(p)}
        if p.is_dir():
            return {"dir": _dir_digest(p)}
    return value


def _state_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def row_digests(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> list[str]:
    """One digest per row of the tokens it holds and which of them are response tokens (padding
    ignored), so a cached reference log-prob is found whatever the batch or its padding width."""
    out = []
    for ids, attn, loss in zip(input_ids.cpu(), attention_mask.cpu().bool(), loss_mask.cpu().bool()):
        h = hashlib.blake2b(digest_size=16)
        h.update(ids[attn].numpy().astype("int64").tobytes())
        h.update(loss[attn].numpy().tobytes())
        out.append(h.hexdigest())
    return out


class ReferenceCache:
    """Reference log-probs ``log π_0(y|x)`` of every sequence of a dataset, looked up by content.

    Stored as one ``.pt`` file whose name holds a hash of the reference model, the data files and
    the tokenisation settings: when any of them changes, the name changes and the cache is
    recomputed (the stale file is removed).
    """

    def __init__(self, table: dict[str, float]):
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def lookup(self, batch) -> PairLogps:
        """Reference :class:`PairLogps` of a (2B, T) preference batch."""
        keys = row_digests(batch.input_ids, batch.attention_mask, batch.loss_mask)
        missing = [i for i, k in enumerate(keys) if k not in self.table]
        if missing:
            raise KeyError(
                f"rows {missing} of this batch have no cached reference log-probs; the cache does not "
                "match the data (delete it or set precompute_reference: false)"
            )
        values = torch.tensor(
            [self.table[k] for k in keys], dtype=torch.float32, device=batch.input_ids.device
        )
        half = len(keys) // 2
        return PairLogps(values[:half], values[half:])

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        keys = list(self.table)
        torch.save({"keys": keys, "logps": torch.tensor([self.table[k] for k in keys])}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> ReferenceCache:
        state = torch.load(path, weights_only=True)
        return cls(dict(zip(state["keys"], state["logps"].tolist())))

    @classmethod
    @torch.no_grad()
    def compute(cls, reference: torch.nn.Module, loaders: list[DataLoader], device) -> ReferenceCache:
        table: dict[str, float] = {}
        for loader in loaders:
            for batch in loader:
                ids, attn, loss = batch.input_ids, batch.attention_mask, batch.loss_mask
                token_logps, _ = token_logprobs(reference, ids.to(device), attn.to(device), loss.to(device))
                table.update(zip(row_digests(ids, attn, loss), token_logps.sum(-1).float().cpu().tolist()))
        return cls(table)


class DPOModule(AlignModule):
    """Direct preference optimisation of a policy against a frozen reference (algorithms.md §5).

    With ``h = β[(log π_θ(y_w|x) - log π_0(y_w|x)) - (log π_θ(y_l|x) - log π_0(y_l|x))]`` the loss
    is ``-log σ(h)`` (DPO, ChatGLM-RLHF eq. 7), ``-(1-ε)log σ(h) - ε log σ(-h)`` with
    ``label_smoothing = ε`` (conservative DPO), or ``(h/β - 1/(2β))²`` (IPO), plus
    ``α·NLL(y_w|x)/|y_w|`` when ``sft_weight = α > 0`` (RPO). Chosen and rejected responses go
    through the policy in one concatenated forward. Data: a
    :class:`~alignlit.data.PreferenceDataModule`.

    Reference log-probs are either computed each step by a frozen reference model kept in memory,
    or (``precompute_reference``) computed once before training and cached next to the training
    data; then no reference model is in memory while training.

    Args:
        policy: causal-LM directory to start from (usually the SFT export), or a
            :class:`~alignlit.models.TinyLlama` spec.
        reference: reference-policy directory ``π_0`` (default: the policy's starting weights).
        loss_type: "dpo" (with ``label_smoothing > 0``: conservative DPO) or "ipo".
        beta: ``β > 0``, strength of the implicit KL constraint to the reference.
        label_smoothing: ``ε ∈ [0, 0.5]``, assumed label-flip probability (cDPO); "dpo" only.
        sft_weight: ``α ≥ 0``, weight of the length-normalised NLL of the chosen response (RPO).
        precompute_reference: compute the reference log-probs once and cache them (no reference
            model in memory during training) instead of a reference forward every step.
        reference_cache_dir: where the cache lives (default: ``.alignlit_cache/`` next to the
            training data file).
        optim: AdamW with warmup and cosine decay (:class:`~alignlit.modules.Optim`).
        dtype: dtype the policy and reference are loaded in ("float32", "bfloat16").
        export_dir: where the trained policy is written as a Hugging Face directory at the end of fit.
    """

    stage = "dpo"

    def __init__(
        self,
        policy: str | TinyLlama,
        reference: str | None = None,
        loss_type: LossType = "dpo",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        sft_weight: float = 0.0,
        precompute_reference: bool = True,
        reference_cache_dir: str | None = None,
        optim: Optim = Optim(lr=1e-5, warmup_steps=10),
        dtype: str = "float32",
        export_dir: str | None = None,
    ):
        super().__init__(export_dir=export_dir, optim=optim)
        if loss_type not in PREFERENCE_LOSSES:
            raise ValueError(f"loss_type must be one of {sorted(PREFERENCE_LOSSES)}, got {loss_type!r}")
        if beta <= 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        if not 0.0 <= label_smoothing <= 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
        if label_smoothing > 0 and loss_type != "dpo":
            raise ValueError(f"label_smoothing (cDPO) applies to loss_type 'dpo' only, got {loss_type!r}")
        if sft_weight < 0:
            raise ValueError(f"sft_weight must be >= 0, got {sft_weight}")
        self.save_hyperparameters()
        self.policy, self.tokenizer = (
            load_policy(policy) if isinstance(policy, TinyLlama) else load_policy(policy, dtype=dtype)
        )
        self.policy.train()  # from_pretrained returns eval mode
        self.reference_source = reference if reference is not None else policy
        # Not registered as a submodule: it is frozen and never part of checkpoints or of DDP.
        self._reference: list[torch.nn.Module] = []
        if isinstance(self.reference_source, TinyLlama):
            self._reference.append(_frozen(copy.deepcopy(self.policy)))
        elif not precompute_reference:
            self._reference.append(_frozen(load_policy(self.reference_source, dtype=dtype)[0]))
        self.reference_cache: ReferenceCache | None = None
        #: "hit" or "miss" once the precomputed reference cache has been resolved
        self.reference_cache_status: str | None = None
        self.reference_cache_path: Path | None = None
        self.val_metrics = torch.nn.ModuleDict(
            {name: MeanMetric() for name in ("loss", "accuracy", "margin", "chosen", "rejected")}
        )

    # ----------------------------------------------------------------- reference log-probs
    @property
    def reference_model(self) -> torch.nn.Module | None:
        return self._reference[0] if self._reference else None

    def reference_fingerprint(self, datamodule) -> dict:
        """What the cached reference log-probs depend on: reference weights, data, tokenisation."""
        if isinstance(self.reference_source, TinyLlama):
            reference = {"initial_state": _state_digest(self.reference_model)}
        else:
            reference = {"dir": _dir_digest(Path(self.reference_source))}
        data = {
            k: _path_fingerprint(v)
            for k, v in sorted(dict(datamodule.hparams).items())
            if k not in _NOT_TOKENISATION
        }
        tokenizer = getattr(self.tokenizer, "backend_tokenizer", None)
        return {
            "reference": reference,
            "dtype": self.hparams.dtype,
            "data_class": type(datamodule).__name__,
            "data": data,
            "tokenizer": hashlib.sha256((tokenizer.to_str() if tokenizer else "").encode()).hexdigest(),
            "eos": self.tokenizer.eos_token_id,
        }

    def _cache_path(self, datamodule, key: str) -> Path:
        train_file = datamodule.hparams.get("train_file")
        if self.hparams.reference_cache_dir is not None:
            directory = Path(self.hparams.reference_cache_dir)
        elif train_file is not None:
            directory = Path(train_file).parent / ".alignlit_cache"
        else:
            raise ValueError("set reference_cache_dir: the datamodule has no train_file to cache next to")
        stem = Path(train_file).name if train_file else "data"
        return directory / f"ref_logps-{stem}-{key[:20]}.pt"

    @staticmethod
    def _loaders_for_reference(datamodule) -> list[DataLoader]:
        """Unshuffled, unsharded loaders over the train and val sets, with the datamodule's collation."""
        loaders = []
        for loader in (datamodule.train_dataloader(), datamodule.val_dataloader()):
            if isinstance(loader, DataLoader):
                loaders.append(
                    DataLoader(loader.dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn)
                )
        return loaders

    def prepare_reference(self, datamodule=None) -> None:
        """Resolve the reference log-probs cache: load it on a hit, compute and write it on a miss.

        Runs on fit start; call it directly (with a set-up ``datamodule``) to build the cache ahead
        of training. With several processes rank 0 computes and the others wait for it.
        """
        if not self.hparams.precompute_reference or self.reference_cache is not None:
            return
        trainer = self._trainer
        datamodule = datamodule or (getattr(trainer, "datamodule", None) if trainer is not None else None)
        if datamodule is None:
            raise ValueError("precompute_reference needs a datamodule; or set precompute_reference: false")
        fingerprint = json.dumps(self.reference_fingerprint(datamodule), sort_keys=True, default=str)
        path = self._cache_path(datamodule, hashlib.sha256(fingerprint.encode()).hexdigest())
        hit = path.exists()
        if not hit and (trainer is None or trainer.is_global_zero):
            reference = self.reference_model
            if reference is None:
                reference = _frozen(load_policy(self.reference_source, dtype=self.hparams.dtype)[0])
            reference.to(self.device)
            cache = ReferenceCache.compute(reference, self._loaders_for_reference(datamodule), self.device)
            for stale in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.pt"):
                stale.unlink()
            cache.save(path)
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

    def reference_logps(self, batch) -> PairLogps:
        if self.reference_cache is not None:
            return self.reference_cache.lookup(batch)
        if self.reference_model is None:
            raise RuntimeError("no reference: call prepare_reference() (done on fit start) first")
        with torch.no_grad():
            return pair_logprobs(self.reference_model, batch)[0]

    # ----------------------------------------------------------------- loss
    def export_model(self):
        return self.policy

    def preference_loss(self, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The configured loss on one (2B, T) preference batch, with implicit-reward metrics."""
        hp = self.hparams
        policy_logps, chosen_lengths = pair_logprobs(self.policy, batch)
        loss, metrics = PREFERENCE_LOSSES[hp.loss_type](
            policy_logps, self.reference_logps(batch), beta=hp.beta, label_smoothing=hp.label_smoothing
        )
        if hp.sft_weight > 0:
            sft, sft_metrics = rpo_sft_term(-policy_logps.chosen, chosen_lengths)
            loss = loss + hp.sft_weight * sft
            metrics = {**metrics, **sft_metrics, "loss": loss.detach()}
        return loss, metrics

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, metrics = self.preference_loss(batch)
        check_finite(
            loss, what=f"{self.hparams.loss_type.upper()} loss", step=self.global_step, metrics=metrics
        )
        size = batch.input_ids.shape[0] // 2
        for name, value in metrics.items():
            self.log(f"train/{name}", value, prog_bar=name in ("loss", "rewards/accuracy"), batch_size=size)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, metrics = self.preference_loss(batch)
        size = batch.input_ids.shape[0] // 2
        values = {
            "loss": loss,
            "accuracy": metrics["rewards/accuracy"],
            "margin": metrics["rewards/margin"],
            "chosen": metrics["rewards/chosen"],
            "rejected": metrics["rewards/rejected"],
        }
        for name, value in values.items():
            self.val_metrics[name].update(value, weight=size)
            label = "val/loss" if name == "loss" else f"val/rewards/{name}"
            self.log(label, self.val_metrics[name], prog_bar=name in ("loss", "accuracy"), batch_size=size)

    def configure_optimizers(self):
        return self.configure_adamw(self.policy.parameters())


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model
