import json
import subprocess
import sys
from pathlib import Path

import pytest

from alignlit.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "alignlit.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_top_level_usage(capsys):
    main([])
    assert "alignlit {fit,validate,test,predict}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown command 'frobnicate'"):
        main(["frobnicate"])


def test_fit_help_documents_fields_from_docstrings():
    out = run_cli("fit", "--model.help", "alignlit.modules.SFTModule").stdout
    # the text comes from the Args sections of the SFTModule and Optim docstrings: written once
    assert "--model.optim.lr" in out and "peak learning rate" in out
    assert "--model.export_dir" in out and "where the trained policy is written" in out


def test_config_error_names_key_and_expected_type():
    res = run_cli(
        "fit", "--config", str(ROOT / "configs/quickstart/sft.yaml"), "--model.init_args.optim.lr", "fast"
    )
    assert res.returncode != 0
    assert "lr" in res.stderr and "float" in res.stderr


def test_unknown_key_is_rejected():
    res = run_cli(
        "fit", "--config", str(ROOT / "configs/quickstart/sft.yaml"), "--model.init_args.learning_rate", "0.1"
    )
    assert res.returncode != 0 and "learning_rate" in res.stderr


@pytest.mark.slow
def test_quickstart_sft_config_runs_from_the_command_line(tmp_path):
    """`alignlit sim make-data` then the shipped SFT config at reduced size, then `alignlit eval`."""
    res = run_cli(
        "sim",
        "make-data",
        "--out",
        "data/sim",
        "--n-sft",
        "400",
        "--n-pairs",
        "50",
        "--n-prompts",
        "50",
        "--n-val",
        "40",
        "--n-test",
        "40",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "data/sim/tokenizer/tokenizer.json").exists()
    res = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs/quickstart/sft.yaml"),
        "--trainer.max_steps",
        "12",
        "--trainer.val_check_interval",
        "6",
        "--data.init_args.batch_size",
        "16",
        "--trainer.enable_progress_bar",
        "false",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    meta = json.loads((tmp_path / "out/quickstart/sft/alignlit.json").read_text())
    assert meta["stage"] == "sft"
    assert meta["config"]["trainer"]["max_steps"] == 12  # the full CLI config, overrides included
    assert meta["data"]["train_file"] == "data/sim/sft_train.jsonl"
    assert (tmp_path / "out/quickstart/checkpoints/sft/last.ckpt").exists()
    # resume from the last checkpoint and continue to 16 steps
    res = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs/quickstart/sft.yaml"),
        "--trainer.max_steps",
        "16",
        "--data.init_args.batch_size",
        "16",
        "--trainer.enable_progress_bar",
        "false",
        "--ckpt_path",
        "out/quickstart/checkpoints/sft/last.ckpt",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_cli(
        "eval",
        "--sim",
        "data/sim",
        "--policy",
        "out/quickstart/sft",
        "--n-prompts",
        "8",
        "--json",
        "eval.json",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())["results"][0]
    assert result["samples"] == 8 and -2.0 <= result["gold"] <= 1.0


def test_fit_installs_the_atomic_checkpoint_io(tokenizer_dir, tmp_path):
    """`alignlit fit` writes checkpoints with AtomicCheckpointIO unless the config names another
    CheckpointIO; the stage's guards (alignlit.callbacks) are installed too."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from alignlit.callbacks import DivergenceMonitor, ExportDirCheck
    from alignlit.checkpoint_io import AtomicCheckpointIO
    from alignlit.cli import AlignCLI

    args = [
        "--config",
        str(ROOT / "configs/quickstart/sft.yaml"),
        f"--model.init_args.policy.init_args.tokenizer={tokenizer_dir}",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    cli = AlignCLI(args=args, run=False)
    assert type(cli.trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    assert {ExportDirCheck, DivergenceMonitor} <= {type(c) for c in cli.model.configure_callbacks()}
    mine = AlignCLI(
        args=[*args, "--trainer.plugins=lightning.pytorch.plugins.io.TorchCheckpointIO"], run=False
    )
    assert type(mine.trainer.strategy.checkpoint_io) is TorchCheckpointIO


def test_batch_limits_given_as_integers_stay_integers(capsys):
    """Lightning annotates limit_*_batches and val_check_interval ``float | int``; "1" must stay one
    batch (an int), not become 1.0 (100% of the batches); "0.5" stays a fraction."""
    import yaml

    with pytest.raises(SystemExit) as exit_info:
        main(
            ["fit", "--config", str(ROOT / "configs/quickstart/sft.yaml"), "--trainer.limit_val_batches=1",
             "--trainer.limit_train_batches", "0.5", "--trainer.val_check_interval", "3",
             "--trainer.overfit_batches", "2", "--print_config"]
        )  # fmt: skip
    assert exit_info.value.code in (0, None)
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["limit_val_batches"] == 1 and isinstance(trainer["limit_val_batches"], int)
    assert trainer["limit_train_batches"] == 0.5
    assert trainer["val_check_interval"] == 3 and isinstance(trainer["val_check_interval"], int)
    assert trainer["overfit_batches"] == 2 and isinstance(trainer["overfit_batches"], int)
