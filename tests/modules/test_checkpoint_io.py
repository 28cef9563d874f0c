"""Crash-safe checkpoints (AtomicCheckpointIO): a crash or a kill mid-write leaves the previous good
checkpoint in place, and training resumes from it; unusable checkpoints give errors naming the file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from alignlit.checkpoint_io import (
    AtomicCheckpointIO,
    CheckpointError,
    atomic_torch_save,
    check_checkpoint_module,
    read_checkpoint,
)
from alignlit.data import SFTDataModule
from alignlit.models import TinyLlama
from alignlit.modules import Optim, SFTModule
from tests.conftest import TINY


def _sft_data(tmp_path, n=30):
    f = tmp_path / "sft.jsonl"
    f.write_text(
        "".join(
            json.dumps(
                {"prompt": f"\n\nHuman: copy {'abcdefgh'[i % 8]} c\n\nAssistant:", "response": " c ok"}
            )
            + "\n"
            for i in range(n)
        )
    )
    return f


def _fit(tmp_path, tokenizer_dir, *, max_steps, ckpt_path=None, plugins=None):
    L.seed_everything(0)
    module = SFTModule(
        policy=TinyLlama(tokenizer=str(tokenizer_dir), **TINY), optim=Optim(lr=1e-3, warmup_steps=2)
    )
    dm = SFTDataModule(str(_sft_data(tmp_path)), batch_size=5, val_fraction=0.0, seed=0)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        plugins=[AtomicCheckpointIO()] if plugins is None else plugins,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)],
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def test_atomic_save_replaces_and_keeps_umask(tmp_path):
    path = tmp_path / "a" / "x.ckpt"
    old = os.umask(0o027)
    try:
        atomic_torch_save({"state_dict": {"w": torch.ones(2)}}, path)
        atomic_torch_save({"state_dict": {"w": torch.zeros(2)}}, path)
    finally:
        os.umask(old)
    assert torch.equal(read_checkpoint(path)["state_dict"]["w"], torch.zeros(2))
    assert (path.stat().st_mode & 0o777) == 0o640  # 0o666 & ~0o027, as open() would give
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.ckpt"]  # no temporary left


def test_crash_mid_write_keeps_previous_checkpoint_and_resume_works(tmp_path, tokenizer_dir, monkeypatch):
    """The step-4 save dies half-way through writing (an exception inside torch.save after half the
    bytes): last.ckpt is still the complete step-2 checkpoint, no temporary file is left, and a new run
    resumes from it to step 6."""
    real_save = torch.save
    calls = {"n": 0}

    def dying_save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # step 2: epoch-2 file + last.ckpt; the 3rd save is the step-4 checkpoint
            f.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr("alignlit.checkpoint_io.torch.save", dying_save)
    with pytest.raises(OSError, match="No space left"):
        _fit(tmp_path, tokenizer_dir, max_steps=6)
    monkeypatch.undo()
    last = tmp_path / "ckpt" / "last.ckpt"
    assert read_checkpoint(last)["global_step"] == 2
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))
    trainer = _fit(tmp_path, tokenizer_dir, max_steps=6, ckpt_path=str(last))
    assert trainer.global_step == 6
    assert read_checkpoint(last)["global_step"] == 6


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from alignlit.checkpoint_io import atomic_torch_save
    path = sys.argv[1]
    atomic_torch_save({"state_dict": {"w": torch.ones(4)}, "global_step": 1}, path)
    real_save = torch.save

    def slow_save(obj, f, *a, **k):
        f.write(b"x" * (8 << 20))  # 8 MB of a large checkpoint are on disk ...
        f.flush()
        print("writing", flush=True)
        time.sleep(60)  # ... when the process is killed

    torch.save = slow_save
    atomic_torch_save({"state_dict": {"w": torch.zeros(1 << 22)}, "global_step": 2}, path)
    """
)


def test_sigkill_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """A process SIGKILLed while writing a checkpoint (no exception handler runs) leaves the previous
    complete file at the destination; the next save removes the dead writer's temporary file."""
    path = tmp_path / "last.ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        tmp_files = list(tmp_path.glob(".last.ckpt.*.tmp"))
        assert len(tmp_files) == 1 and tmp_files[0].stat().st_size >= 8 << 20
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    ckpt = read_checkpoint(path)
    assert ckpt["global_step"] == 1 and torch.equal(ckpt["state_dict"]["w"], torch.ones(4))
    time.sleep(0.01)
    atomic_torch_save({"state_dict": {}, "global_step": 3}, path)
    assert read_checkpoint(path)["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize("keep", [0, 100, 0.5])
def test_truncated_or_empty_checkpoint_names_the_file(tmp_path, keep):
    good = tmp_path / "good.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.randn(256)}, "global_step": 1}, good)
    data = good.read_bytes()
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(
        CheckpointError, match=r"checkpoint .*bad\.ckpt \(\d+ bytes\) cannot be read: it is truncated"
    ):
        read_checkpoint(bad)
    with pytest.raises(CheckpointError, match=r"bad\.ckpt"):
        AtomicCheckpointIO().load_checkpoint(bad)


def test_not_a_lightning_checkpoint(tmp_path):
    f = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(1)}, f)
    with pytest.raises(CheckpointError, match=r"weights\.pt is not a Lightning checkpoint"):
        read_checkpoint(f)


def test_checkpoint_of_another_stage_names_both(tmp_path, tokenizer_dir):
    """Checkpoints carry their stage and module class (CheckpointStageStamp); resuming another stage
    from one is refused naming both classes and the file, before any state is loaded."""
    trainer = _fit(tmp_path, tokenizer_dir, max_steps=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    ckpt = read_checkpoint(last)
    stamp = ckpt["alignlit"]
    assert (stamp["stage"], stamp["module"]) == ("sft", "alignlit.modules.sft.SFTModule")
    assert len(stamp["run"]) == 32 and stamp["config"] is None  # a run id; no config outside `alignlit fit`
    check_checkpoint_module(ckpt, SFTModule, last)  # same stage: fine
    check_checkpoint_module(ckpt, "alignlit.modules.SFTModule", last)  # re-exported path: same class
    from alignlit.modules import RewardModule

    with pytest.raises(
        CheckpointError,
        match=r"last\.ckpt was written by alignlit\.modules\.sft\.SFTModule \(stage 'sft'\), but the model to resume is alignlit\.modules\.reward\.RewardModule",
    ):
        check_checkpoint_module(ckpt, RewardModule, last)
    assert trainer.global_step == 2


def test_plain_trainer_resume_checks_the_stage_first(tmp_path, tokenizer_dir):
    """Without the CLI, AlignModule.on_load_checkpoint refuses another stage's checkpoint before any state
    is loaded; with the plugin, a truncated checkpoint is named (Lightning's own writer and reader know
    nothing of either)."""
    trainer = _fit(tmp_path, tokenizer_dir, max_steps=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    ckpt = read_checkpoint(last)
    ckpt["alignlit"] = {"stage": "reward", "module": "alignlit.modules.reward.RewardModule"}
    torch.save(ckpt, tmp_path / "reward.ckpt")
    with pytest.raises(
        CheckpointError, match=r"reward\.ckpt was written by alignlit\.modules\.reward\.RewardModule"
    ):
        _fit(tmp_path, tokenizer_dir, max_steps=4, ckpt_path=str(tmp_path / "reward.ckpt"), plugins=[])
    data = last.read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=r"cut\.ckpt \(\d+ bytes\) cannot be read"):
        _fit(tmp_path, tokenizer_dir, max_steps=4, ckpt_path=str(tmp_path / "cut.ckpt"))
    assert trainer.global_step == 2
