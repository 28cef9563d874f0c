"""The resume contract of ``alignlit fit``: what ``--ckpt_path`` may change (applied and logged) and what it
refuses (named); a run never starts into another run's checkpoint folder; a resume that trains nothing
fails; Ctrl-C says where the last checkpoint is and how to resume, and that command resumes. Each case
failed on main before the fix it names, and passes after.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path

import pytest
from lightning.pytorch import Callback

from alignlit.checkpoint_io import CheckpointError
from alignlit.cli import main
from tests.hostile.stage_world import fit_args


def _stamp(path: Path) -> int:
    return (path / "alignlit.json").stat().st_mtime_ns


@pytest.fixture()
def trained(tmp_path, world, monkeypatch):
    """A finished 2-step run with a checkpoint per step and an export."""
    monkeypatch.chdir(tmp_path)
    main(fit_args(tmp_path, world))
    assert (tmp_path / "ckpt/last.ckpt").is_file() and (tmp_path / "export/alignlit.json").is_file()
    return tmp_path


def test_a_resume_applies_a_new_length_and_export_dir_and_logs_each_change(trained, world, capsys):
    """Before: LightningCLI replaced the model's arguments by the checkpoint's, so the new export_dir was
    dropped and the *old* export was overwritten."""
    tmp = trained
    before = _stamp(tmp / "export")
    capsys.readouterr()
    main(
        fit_args(
            tmp,
            world,
            f"--ckpt_path={tmp}/ckpt/last.ckpt",
            f"--model.init_args.export_dir={tmp}/new",
            steps=3,
        )
    )
    out = capsys.readouterr().out
    assert (tmp / "new/alignlit.json").is_file(), "the export_dir given on the command line was not used"
    assert _stamp(tmp / "export") == before, "the old export_dir was written to"
    assert re.search(r"changed setting: model\.init_args\.export_dir: '.*/export' -> '.*/new'", out), out
    assert re.search(r"changed setting: trainer\.max_steps: 2 -> 3", out), out
    assert json.loads((tmp / "new/alignlit.json").read_text())["config"]["trainer"]["max_steps"] == 3


@pytest.mark.parametrize(
    "override, field, values",
    [
        (
            "--model.init_args.optim.lr=0.01",
            r"model\.init_args\.optim\.lr",
            r"checkpoint 0\.001, given 0\.01",
        ),
        ("--data.init_args.batch_size=2", r"data\.init_args\.batch_size", r"checkpoint 4, given 2"),
        ("--trainer.gradient_clip_val=0.5", r"trainer\.gradient_clip_val", r"checkpoint 1\.0, given 0\.5"),
        ("--seed_everything=3", r"seed_everything", r"checkpoint 0, given 3"),
    ],
    ids=["optimizer", "data-not-in-hparams", "gradient-clipping", "seed"],
)
def test_a_resume_refuses_a_changed_training_setting_naming_it(
    trained, world, capsys, override, field, values
):
    """Before: the optimizer's lr silently stayed the checkpoint's while data settings (not saved in the
    checkpoint's hyperparameters) took effect; now both are refused, naming the field and both values."""
    tmp = trained
    before = _stamp(tmp / "export")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(fit_args(tmp, world, f"--ckpt_path={tmp}/ckpt/last.ckpt", override, steps=3))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert re.search(rf"a resume continues the run as it was configured.*{field} \({values}\)", err), err
    assert "start a new run without --ckpt_path" in err
    assert _stamp(tmp / "export") == before


def test_a_fresh_run_refuses_a_checkpoint_folder_holding_another_runs_checkpoints(trained, world):
    """Before: the second run wrote last-v1.ckpt beside the first run's last.ckpt, and resuming
    `last.ckpt` (as docs/guarantees.md says) resumed the first, finished run."""
    tmp = trained
    files = sorted(p.name for p in (tmp / "ckpt").iterdir())
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*ckpt: it already holds checkpoints of another run"
                       r" \(.*last\.ckpt.*resume that run with --ckpt_path .*ckpt/last\.ckpt"):  # fmt: skip
        main(fit_args(tmp, world))
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == files  # no last-v1.ckpt


def test_a_resume_that_trains_zero_steps_fails_and_exports_nothing(trained, world):
    """Before: resuming a finished run trained 0 steps, exited 0 and re-exported the old weights."""
    tmp = trained
    before = _stamp(tmp / "export")
    with pytest.raises(CheckpointError, match=r"at global step 2, where the run already ends .*0 steps were trained "
                       r"and nothing was exported.*--trainer\.max_steps"):  # fmt: skip
        main(fit_args(tmp, world, f"--ckpt_path={tmp}/ckpt/last.ckpt"))
    assert _stamp(tmp / "export") == before


def test_a_resume_past_a_finished_epoch_says_to_raise_max_epochs(tmp_path, world, monkeypatch):
    """The online configs' shape (max_epochs 1, limit_train_batches N): a checkpoint written at the end of
    the epoch resumes in epoch 1, so a larger limit_train_batches trains nothing. Before: exit 0 and the
    old weights re-exported; now the error says which length to raise."""
    monkeypatch.chdir(tmp_path)
    epoch = [
        "--trainer.max_steps=-1",
        "--trainer.max_epochs=1",
        "--trainer.val_check_interval=1.0",
        "--trainer.check_val_every_n_epoch=1",
    ]
    main([*fit_args(tmp_path, world), *epoch, "--trainer.limit_train_batches=2"])
    before = _stamp(tmp_path / "export")
    with pytest.raises(CheckpointError, match=r"max_epochs=1 is reached: the checkpoint finished the last epoch\): 0 steps were trained .*raise "
                       r"--trainer\.max_epochs \(a larger limit_train_batches does not reopen"):  # fmt: skip
        main(
            [
                *fit_args(tmp_path, world, f"--ckpt_path={tmp_path}/ckpt/last.ckpt"),
                *epoch,
                "--trainer.limit_train_batches=3",
            ]
        )
    assert _stamp(tmp_path / "export") == before


class InterruptOnce(Callback):
    """Raises KeyboardInterrupt (what Ctrl-C raises) after ``step`` optimizer steps, once per ``flag`` file."""

    def __init__(self, flag: str, step: int = 2):
        self.flag, self.step = flag, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step and not Path(self.flag).exists():
            Path(self.flag).touch()
            raise KeyboardInterrupt


def test_ctrl_c_prints_the_last_checkpoint_and_a_resume_command_that_works(
    tmp_path, world, monkeypatch, capsys
):
    """Before: Lightning's "Detected KeyboardInterrupt, attempting graceful shutdown" and nothing on where
    to resume from."""
    monkeypatch.chdir(tmp_path)
    interrupt = {"class_path": f"{__name__}.InterruptOnce", "init_args": {"flag": str(tmp_path / "flag")}}
    argv = fit_args(tmp_path, world, f"--trainer.callbacks+={json.dumps(interrupt)}", steps=4)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as info:
            main(argv)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT while it shuts down
    assert info.value.code == 1
    err = capsys.readouterr().err
    m = re.search(
        r"interrupted at global step 2\. The last checkpoint is (\S+); resume the run with:\n  (.+)", err
    )
    assert m, err
    assert Path(m.group(1)).is_file()
    command = shlex.split(m.group(2))
    assert command[:2] == ["alignlit", "fit"] and command[-2:] == ["--ckpt_path", m.group(1)]
    main(command[1:])  # the printed command resumes the run to its end
    assert json.loads((tmp_path / "export/alignlit.json").read_text())["config"]["ckpt_path"] == m.group(1)
