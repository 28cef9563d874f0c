"""What every stage shares: export of the result, the optimizer schedule, the NaN guard, LoRA and
activation checkpointing of the trained models, sharding under ``ModelParallelStrategy``."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from alignlit.checks import validate_optimizer_args
from alignlit.hub import Pretrained
from alignlit.lightning_internals import attached_trainer, finish_epoch_in_checkpoint
from alignlit.models.export import export_pretrained
from alignlit.models.loading import DTYPES, enable_gradient_checkpointing, load_policy, model_source
from alignlit.models.lora import AdapterDisabled, LoRA, apply_lora
from alignlit.models.mlp_memory import recompute_mlp_activations
from alignlit.models.modes import disable_dropout
from alignlit.models.tiny import TinyLlama


def warmup_cosine(
    optimizer, *, warmup_steps: int, total_steps: int | Callable[[], int], min_lr_ratio: float = 0.1
):
    """Linear warmup to the base LR over ``warmup_steps``, then cosine decay to ``min_lr_ratio``
    times the base LR at ``total_steps`` (a LambdaLR stepped every optimizer step).

    ``total_steps`` may be a callable, asked only once warmup is over: pass
    ``lambda: trainer.estimated_stepping_batches`` from ``configure_optimizers``. Reading that
    property there makes Lightning load the training data before a checkpoint is restored, after
    which it never restores the loader's position, and resuming mid-epoch is no longer exact.
    """
    total: list[int] = []

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if step == warmup_steps:
            return 1.0
        if not total:
            total.append(int(total_steps() if callable(total_steps) else total_steps))
        progress = min(1.0, (step - warmup_steps) / max(1, total[0] - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclasses.dataclass(frozen=True)
class Optim:
    """AdamW with linear warmup and cosine decay: the optimiser of every alignlit stage.

    In YAML it is a group: ``optim: {lr: 1.0e-4, warmup_steps: 20}`` (PPO adds ``critic_optim``);
    fields not given keep the stage's defaults.

    Args:
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        betas: Adam ``(β1, β2)``.
        warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr`` over this many steps (online
            stages count rollouts).
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio`` at the end of the run (1.0: constant LR
            after warmup).
        fused: torch's fused AdamW kernel (one kernel over all parameters instead of a loop of small
            ops; the same update up to floating-point rounding). None: fused when every trained
            parameter is a plain floating-point CPU or CUDA tensor (not a DTensor), else torch's default.
            On CPU torch's default is a per-parameter loop: fused made SFT steps of the benchmark model
            about 10% faster (``benchmarks/bench_vs_trl.py``, README Performance).
    """

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    fused: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        validate_optimizer_args(
            self.lr,
            self.weight_decay,
            self.betas,
            warmup_steps=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def build(self, params, *, total_steps: int | Callable[[], int]) -> dict[str, Any]:
        """AdamW over ``params`` plus :func:`warmup_cosine` over ``total_steps`` (an int, or a callable
        asked once warmup is over), as the dict Lightning's ``configure_optimizers`` returns."""
        params = list(params)
        fused = self.fused if self.fused is not None else fusable(params)
        optimizer = torch.optim.AdamW(
            params,
            lr=self.lr,
            weight_decay=self.weight_decay,
            betas=self.betas,
            fused=True if fused else None,  # None: torch's own choice (for-each on CUDA, a loop on CPU)
        )
        scheduler = warmup_cosine(
            optimizer,
            warmup_steps=self.warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fusable(params) -> bool:
    """Whether torch's fused AdamW applies to every parameter of ``params`` (tensors or param-group
    dicts): plain (not DTensor) floating-point tensors on CPU or CUDA."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return bool(tensors) and all(
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.is_floating_point()
        and t.device.type in ("cpu", "cuda")
        for t in tensors
    )


# Stages keep their __init__ arguments (an Optim among them) in checkpoints; let torch.load's
# weights-only unpickler rebuild it on resume.
torch.serialization.add_safe_globals([Optim, LoRA])


def check_finite(loss: torch.Tensor, *, what: str, step: int, metrics: dict[str, Any] | None = None) -> None:
    """Raise (never continue silently) when a loss is NaN or infinite."""
    if not torch.isfinite(loss).all():
        detail = ", ".join(f"{k}={float(v):.4g}" for k, v in (metrics or {}).items() if torch.is_tensor(v))
        raise FloatingPointError(
            f"{what} is {loss.item()} at global step {step}"
            + (f" ({detail})" if detail else "")
            + "; lower the learning rate, check the data, or enable gradient clipping"
        )


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"class": type(value).__name__, **dataclasses.asdict(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


class AlignModule(L.LightningModule):
    """Base of every alignlit stage.

    Subclasses set :attr:`stage` and implement :meth:`export_model` (the model whose weights are the
    stage's result). At the end of ``fit`` the result is written to ``export_dir`` as a Hugging Face
    directory with an ``alignlit.json`` saying which stage, config and data produced it (with
    ``lora``, merged or the adapter alone, as ``lora.export`` says). Trained models go through
    :meth:`prepare_trained` (LoRA, activation checkpointing); the optimiser gets their trainable
    parameters only.
    """

    stage: str = "base"
    tokenizer: Any = None

    def __init__(self, export_dir: str | None = None, optim: Optim | None = None, lora: LoRA | None = None):
        super().__init__()
        self.export_dir = export_dir
        #: the stage's optimiser settings (LightningCLI records the config, not the object, in hparams)
        self.optim = optim
        #: LoRA adapters on the trained models (None: full fine-tuning)
        self.lora = lora
        #: the full CLI config, filled in by ``alignlit`` so the export records it
        self.cli_config: dict[str, Any] | None = None

    def export_model(self):
        raise NotImplementedError

    def prepare_trained(
        self, model: torch.nn.Module, *, gradient_checkpointing: bool = False, lora: bool = True
    ):
        """A model this stage trains, made ready: activation checkpointing on when asked
        (:func:`alignlit.models.loading.enable_gradient_checkpointing`), its gated MLPs' activations
        recomputed in the backward pass instead of kept (:mod:`alignlit.models.mlp_memory`; same gradients),
        then the stage's LoRA adapter injected (when ``lora`` is set and the ``lora`` argument is True;
        :func:`alignlit.models.lora.apply_lora`)."""
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        recompute_mlp_activations(model)
        if lora and self.lora is not None:
            apply_lora(model, self.lora)
        return model

    #: the arguments that name a model the stage reads (:meth:`input_dirs`)
    MODEL_ARGUMENTS = ("policy", "reference", "reward", "critic", "model")

    def input_dirs(self) -> dict[str, Path]:
        """The local directories this stage reads models from (its ``policy``, ``reference``, ``reward``,
        ``critic`` or ``model`` argument, where that is a directory), which ``export_dir`` must not
        replace (:func:`alignlit.models.export.check_export_dir`)."""
        out = {}
        for role in self.MODEL_ARGUMENTS:
            value = self.hparams.get(role)
            path = value.path if isinstance(value, Pretrained) else value
            if isinstance(path, (str, Path)) and str(path) and Path(path).is_dir():
                out[role] = Path(path)
        return out

    def export_metrics(self) -> dict[str, float]:
        return {
            k: float(v)
            for k, v in self.trainer.callback_metrics.items()
            if torch.is_tensor(v) and v.numel() == 1
        }

    def export(self, out_dir: str | Path, *, state_dict: dict[str, Any] | None = None) -> Path:
        """Write this stage's result to ``out_dir`` (see :func:`alignlit.models.export_pretrained`)."""
        dm = getattr(self.trainer, "datamodule", None) if attached_trainer(self) is not None else None
        data = _plain(dict(dm.hparams)) if dm is not None else {}
        if dm is not None:
            data["class"] = type(dm).__name__
        config = self.cli_config or {"model": {"class": type(self).__name__, **_plain(dict(self.hparams))}}
        metrics = self.export_metrics() if attached_trainer(self) is not None else {}
        return export_pretrained(
            self.export_model(),
            self.tokenizer,
            out_dir,
            stage=self.stage,
            config=config,
            data=data,
            metrics=metrics,
            state_dict=state_dict,
            lora_export=self.lora.export if self.lora is not None else "merged",
            source=model_source(self.export_model()),
        )

    def configure_adamw(self, params, optim: Optim | None = None):
        """:class:`Optim` (default: the stage's ``optim`` hyperparameter) over the trainable ones of
        ``params`` (frozen base weights under LoRA get no optimiser state), with the cosine schedule over
        the run's length as Lightning estimates it."""
        optim = optim if optim is not None else self.optim
        if optim is None:
            raise ValueError(f"{type(self).__name__} has no optimiser settings (`optim`)")
        trainable = [p for p in params if p.requires_grad]
        return optim.build(trainable, total_steps=lambda: self.trainer.estimated_stepping_batches)

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
        """The ``all_reduce`` the ops take for statistics over the global batch (:data:`alignlit.ops.stats.AllReduce`):
        :meth:`all_reduce_sum` when a process group is initialised, else None (one process: local statistics)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return self.all_reduce_sum
        return None

    def clip_grad_norm(self, params, max_norm: float | None) -> torch.Tensor:
        """Clip the global gradient norm of ``params`` to ``max_norm`` (None: only measure it); returns
        the norm before clipping. Works across DTensor (tensor-parallel / FSDP2) and plain parameters."""
        params = [p for p in params if p.grad is not None]
        limit = max_norm if max_norm is not None else float("inf")
        if self.device_mesh is not None:
            from alignlit.strategies import clip_grad_norm

            return clip_grad_norm(params, limit)
        return torch.nn.utils.clip_grad_norm_(params, limit)

    def parallel_models(self) -> list[torch.nn.Module]:
        """The models :meth:`configure_model` shards under ``ModelParallelStrategy`` (default: the
        exported one). Stages with several trained models (PPO: policy and critic) list them all."""
        return [self.export_model()]

    def frozen_parallel_models(self) -> list[torch.nn.Module]:
        """Frozen models :meth:`configure_model` shards too (default: none; see ``shard_frozen``); they
        free their gathered weights after every forward."""
        return []

    def configure_model(self) -> None:
        """Apply FSDP2 + tensor parallel when the strategy provides a device mesh
        (:func:`alignlit.strategies.parallelize_causal_lm`)."""
        mesh = self.device_mesh
        if mesh is None or getattr(self, "_parallelized", False):
            return
        from alignlit.strategies import parallelize_causal_lm

        for model in self.parallel_models():
            parallelize_causal_lm(getattr(model, "hf_model", model), mesh)
        for model in self.frozen_parallel_models():
            parallelize_causal_lm(getattr(model, "hf_model", model), mesh, reshard_after_forward=True)
        self._parallelized = True

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Step, then free the gradients: Lightning zeroes them only after the next step's forward, so
        they would sit beside its activations (``benchmarks/bench_memory.py``)."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        optimizer.zero_grad(set_to_none=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.device_mesh is None or not gradient_clip_val:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("with ModelParallelStrategy alignlit clips by norm only")
        self.clip_grad_norm(
            [p for group in optimizer.param_groups for p in group["params"]], gradient_clip_val
        )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, before any state is loaded, a checkpoint written by another stage (its stage and module
        class are recorded in it), naming both (:func:`alignlit.checkpoint_io.check_checkpoint_module`);
        make a checkpoint from the last batch of an epoch resume in the next one
        (:func:`finish_epoch_in_checkpoint`). Subclasses call it first."""
        from alignlit.checkpoint_io import check_checkpoint_module

        path = attached_trainer(self).ckpt_path if attached_trainer(self) is not None else None
        check_checkpoint_module(checkpoint, type(self), path or "being loaded")
        if finish_epoch_in_checkpoint(checkpoint):
            print(
                f"alignlit: {path or 'the checkpoint'} was written after the last batch of epoch "
                f"{checkpoint.get('epoch')}; training resumes with epoch {checkpoint.get('epoch', 0) + 1}"
            )

    def configure_callbacks(self):
        """alignlit's guards (:func:`alignlit.callbacks.default_callbacks`): ``export_dir`` checked before
        training, checkpoints stamped with their stage and checked before a resume, divergence stops
        the run naming the step. One of the same class in the trainer's callbacks is kept instead."""
        from alignlit.callbacks import default_callbacks

        return default_callbacks(attached_trainer(self))

    def export_from_every_rank(self, out_dir: str | Path) -> Path | None:
        """:meth:`export` called on every rank: a sharded model's full state is gathered on every rank and
        written by rank 0 (its path returned; None on the other ranks), then the ranks wait for it."""
        state = None
        if self.device_mesh is not None:
            from alignlit.models.state_dict import full_state_dict

            model = self.export_model()
            state = full_state_dict(getattr(model, "hf_model", model))  # the names save_pretrained writes
        path = self.export(out_dir, state_dict=state) if self.global_rank == 0 else None
        self.trainer.strategy.barrier("alignlit-export")
        return path

    def on_fit_end(self) -> None:
        if not self.export_dir:
            return
        path = self.export_from_every_rank(self.export_dir)
        if path is not None:
            print(f"alignlit: exported {self.stage} result to {path}")


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as a frozen model: dropout off, no gradients, eval mode."""
    return disable_dropout(model).requires_grad_(False).eval()


def load_policy_and_reference(
    module: AlignModule,
    policy: str | TinyLlama | Pretrained,
    reference: str | Pretrained | None,
    *,
    copy_policy: bool,
    dtype: str,
    frozen_dtype: str,
    gradient_checkpointing: bool,
) -> tuple[torch.nn.Module, Any, torch.nn.Module | None]:
    """The trained policy of ``module`` and its frozen reference ``π_0``, built in the one order that works.

    The policy is loaded (``dtype``), prepared (:meth:`AlignModule.prepare_trained`: activation
    checkpointing, ``module.lora``), with dropout off and in train mode. The reference is the model at
    the directory ``reference`` (``frozen_dtype``); or, when ``reference`` is None and ``copy_policy``,
    the policy's starting weights: with LoRA the policy's base with the adapter disabled (no second
    copy), else a copy taken before any adapter is injected; or None. Returns
    ``(policy, tokenizer, reference)``.
    """
    model, tokenizer = (
        load_policy(policy) if isinstance(policy, TinyLlama) else load_policy(policy, dtype=dtype)
    )
    ref = None
    if reference is not None:
        ref = load_policy(reference, dtype=frozen_dtype)[0]
    elif copy_policy and module.lora is None:
        ref = copy.deepcopy(model).to(DTYPES[frozen_dtype])  # before the adapter and checkpointing
    module.prepare_trained(model, gradient_checkpointing=gradient_checkpointing)
    disable_dropout(model).train()  # from_pretrained returns eval mode
    if reference is None and copy_policy and module.lora is not None:
        ref = AdapterDisabled(model)
    return model, tokenizer, (frozen(ref) if ref is not None else None)
