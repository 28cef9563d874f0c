"""alignlit.callbacks: divergence stops the run naming the step; export_dir is checked before training."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from alignlit.callbacks import (
    CheckpointStageStamp,
    DivergenceError,
    DivergenceMonitor,
    ExportDirCheck,
    default_callbacks,
)
from alignlit.data import SFTDataModule
from alignlit.models import ExportDirError, TinyLlama, make_tiny_llama
from alignlit.modules import Optim, SFTModule
from tests.conftest import TINY
from tests.helpers import write_sft_file


def _trainer(tmp_path, max_steps, callbacks=(), clip=None):
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        gradient_clip_val=clip,
        default_root_dir=tmp_path,
        callbacks=list(callbacks),
    )


def _sft(tokenizer_dir, lr, export_dir=None):
    L.seed_everything(0)
    return SFTModule(
        policy=TinyLlama(tokenizer=str(tokenizer_dir), **TINY),
        optim=Optim(lr=lr, warmup_steps=0, min_lr_ratio=1.0),
        export_dir=export_dir,
    )


def _monitor(trainer) -> DivergenceMonitor:
    return next(c for c in trainer.callbacks if isinstance(c, DivergenceMonitor))


def test_divergent_sft_stops_naming_the_step_and_exports_nothing(tmp_path, tokenizer_dir):
    """lr 10 (the largest AdamW learning rate alignlit accepts): the weights' norm passes 100x its start
    at the first step; the run stops there with an error naming the step, and nothing is exported."""
    module = _sft(tokenizer_dir, lr=10.0, export_dir=str(tmp_path / "export"))
    dm = SFTDataModule(str(write_sft_file(tmp_path, 40)), batch_size=5, val_fraction=0.0, seed=0)
    trainer = _trainer(tmp_path, max_steps=30)
    with pytest.raises(
        DivergenceError, match=r"training diverged at global step (\d+): the trainable weights' norm"
    ) as e:
        trainer.fit(module, dm)
    assert int(e.value.args[0].split("global step ")[1].split(":")[0]) <= 3
    assert trainer.global_step <= 3
    assert not (tmp_path / "export").exists()


def test_healthy_sft_is_untouched(tmp_path, tokenizer_dir):
    """lr 1e-3 for 30 steps: no error; the monitor saw a falling loss and a weight norm close to its start."""
    module = _sft(tokenizer_dir, lr=1e-3)
    dm = SFTDataModule(str(write_sft_file(tmp_path, 40)), batch_size=5, val_fraction=0.0, seed=0)
    trainer = _trainer(tmp_path, max_steps=30, clip=1.0)
    trainer.fit(module, dm)
    assert trainer.global_step == 30
    monitor = _monitor(trainer)
    assert sum(monitor.recent) / len(monitor.recent) < monitor.start_loss  # the loss fell
    norm = float(torch.linalg.vector_norm(torch.stack([p.norm() for p in module.parameters()])))
    assert 0.5 < norm / monitor.weight_norm0 < 2.0


class ManualLM(L.LightningModule):
    """Manual optimisation, as the online stages do: the loss is only logged, nothing is returned."""

    def __init__(self, tokenizer, lr):
        super().__init__()
        self.automatic_optimization = False
        self.model = make_tiny_llama(tokenizer, seed=0, **TINY)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        loss = self.model(input_ids=ids, labels=ids).loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train/loss", loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 300, (64, 12), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)


def test_manual_optimisation_with_lr_1e6_stops(tmp_path, tokenizer):
    """lr 1e6 (the setting that used to finish with exit 0 and weights ~1e9): stopped at the first step."""
    trainer = _trainer(tmp_path, max_steps=20, callbacks=[DivergenceMonitor()])
    with pytest.raises(
        DivergenceError, match=r"diverged at global step 1: the trainable weights' norm is .* times its start"
    ):
        trainer.fit(ManualLM(tokenizer, lr=1e6))


def test_manual_optimisation_healthy(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, max_steps=16, callbacks=[DivergenceMonitor(window=4)])
    trainer.fit(ManualLM(tokenizer, lr=1e-3))
    monitor = _monitor(trainer)
    assert trainer.global_step == 16 and monitor.start_loss is not None and len(monitor.recent) == 4


def _fake_trainer(step):
    return SimpleNamespace(global_step=step, callback_metrics={}, precision_plugin=SimpleNamespace())


def test_loss_rise_by_hand():
    """first loss 2, loss_factor 3 -> limit 2 + 3 * max(2, 1) = 8; window 3.
    Losses 2, 7, 8, 9: windows [2,7,8] mean 5.67 and [7,8,9] mean 8.0, not above 8;
    then 9.3: [8, 9, 9.3] mean 8.767 > 8 -> stops at that step (4)."""
    m = DivergenceMonitor(window=3, loss_factor=3.0, max_weight_ratio=None)
    for step, loss in enumerate([2.0, 7.0, 8.0, 9.0]):
        m.on_train_batch_end(_fake_trainer(step), None, {"loss": torch.tensor(loss)}, None, step)
    with pytest.raises(
        DivergenceError, match=r"global step 4: the mean training loss of the last 3 steps is 8\.767, above 8"
    ):
        m.on_train_batch_end(_fake_trainer(4), None, {"loss": torch.tensor(9.3)}, None, 4)


def test_logged_loss_is_read_when_none_is_returned():
    m = DivergenceMonitor(window=1, loss_factor=1.0, max_weight_ratio=None)
    t = _fake_trainer(0)
    t.callback_metrics["train/loss"] = torch.tensor(0.5)
    m.on_train_batch_end(t, None, None, None, 0)
    assert m.start_loss == 0.5
    t.callback_metrics["train/loss"] = torch.tensor(2.6)  # limit 0.5 + 1 * max(0.5, 1) = 1.5
    with pytest.raises(DivergenceError, match=r"is 2\.6, above 1\.5"):
        m.on_train_batch_end(t, None, None, None, 1)


def _optimizer_with_grad(value):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), value)
    return SimpleNamespace(param_groups=[{"params": [p]}])


def test_non_finite_gradient_norm_stops():
    m = DivergenceMonitor()
    with pytest.raises(DivergenceError, match="global step 7: the gradient norm is inf"):
        m.on_before_optimizer_step(_fake_trainer(7), None, _optimizer_with_grad(float("inf")))
    with pytest.raises(DivergenceError, match="the gradient norm is nan"):
        m.on_before_optimizer_step(_fake_trainer(8), None, _optimizer_with_grad(float("nan")))


def test_fp16_loss_scaling_skips_the_non_finite_check():
    """Under fp16 loss scaling an infinite gradient is normal: the scaler skips that step itself."""
    m = DivergenceMonitor()
    t = _fake_trainer(0)
    t.precision_plugin = SimpleNamespace(scaler=object())
    m.on_before_optimizer_step(t, None, _optimizer_with_grad(float("inf")))


def test_dead_gradients_stop_after_the_configured_run():
    m = DivergenceMonitor(dead_steps=3)
    for step in range(2):
        m.on_before_optimizer_step(_fake_trainer(step), None, _optimizer_with_grad(0.0))
    m.on_before_optimizer_step(_fake_trainer(2), None, _optimizer_with_grad(1.0))  # the run restarts
    for step in range(3, 5):
        m.on_before_optimizer_step(_fake_trainer(step), None, _optimizer_with_grad(0.0))
    with pytest.raises(DivergenceError, match="global step 5: the gradient norm has been exactly 0 for 3"):
        m.on_before_optimizer_step(_fake_trainer(5), None, _optimizer_with_grad(0.0))


def test_state_round_trip_and_argument_checks():
    m = DivergenceMonitor(window=2)
    m.on_train_batch_end(_fake_trainer(0), None, {"loss": torch.tensor(1.0)}, None, 0)
    m.weight_norm0 = 3.0
    other = DivergenceMonitor(window=2)
    other.load_state_dict(m.state_dict())
    assert (
        other.state_dict()
        == m.state_dict()
        == {
            "start_loss": 1.0,
            "recent": [1.0],
            "weight_norm0": 3.0,
            "zero_grad_run": 0,
        }
    )
    with pytest.raises(ValueError, match="window must be >= 1"):
        DivergenceMonitor(window=0)
    with pytest.raises(ValueError, match="max_weight_ratio must be > 1"):
        DivergenceMonitor(max_weight_ratio=0.5)


def test_default_callbacks_keep_a_configured_one():
    mine = DivergenceMonitor(loss_factor=10.0)
    got = default_callbacks(SimpleNamespace(callbacks=[mine]))
    assert [type(c) for c in got] == [ExportDirCheck, CheckpointStageStamp]
    assert [type(c) for c in default_callbacks(None)] == [
        ExportDirCheck,
        CheckpointStageStamp,
        DivergenceMonitor,
    ]


def test_export_dir_is_checked_before_training(tmp_path, tokenizer_dir):
    """export_dir pointing at a file fails in setup, before the first step (nothing trained, file intact)."""
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    module = _sft(tokenizer_dir, lr=1e-3, export_dir=str(target))
    dm = SFTDataModule(str(write_sft_file(tmp_path, 40)), batch_size=5, val_fraction=0.0, seed=0)
    trainer = _trainer(tmp_path, max_steps=3)
    with pytest.raises(ExportDirError, match=r"notes\.txt' is a file, not a directory"):
        trainer.fit(module, dm)
    assert trainer.global_step == 0 and target.read_text() == "mine"
