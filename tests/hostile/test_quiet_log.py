"""A quiet log: the benign messages of Lightning and transformers are left out by exact text
(``alignlit.quiet``), real warnings stay.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from alignlit.models import load_scalar_model
from tests.hostile.stage_world import fit_args


def test_the_benign_messages_are_filtered_by_exact_text_and_real_ones_are_not():
    """Before: alignlit.quiet did not exist; each of these was printed in every stage."""
    from alignlit.quiet import benign

    noise = [
        "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
        "treespec.is_leaf()` instead.",
        "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization state was "
        "saved. The checkpoint will contain the model state AFTER optimization. To save ...",
        "Found 119 module(s) in eval mode at the start of training. This may lead to unexpected behavior during "
        "training. If this is intentional, you can ignore this warning.",
        "Checkpoint directory /runs/ckpt exists and is not empty.",
        "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](https://pypi.org/...)",
        "💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels](https://pypi.org/...)",
    ]
    real = [
        "The number of training batches (4) is smaller than the logging interval Trainer(log_every_n_steps=20).",
        "`isinstance(x, Foo)` is deprecated, use `isinstance(x, Bar)` instead.",
        "Found 3 module(s) in eval mode at the start of training because of X.",
        "The 'train_dataloader' does not have many workers which may be a bottleneck.",
    ]
    assert all(benign(m) for m in noise)
    assert not any(benign(m) for m in real)
    entry, match = benign(noise[2])
    assert entry.say(match).startswith(
        "119 modules are in eval mode at the start of training, as alignlit intends"
    )


def test_a_fresh_reward_head_is_one_line_not_a_load_report(world, capfd):
    """Before: transformers' 8-line LOAD REPORT for the expected fresh head (and unused lm_head)."""
    load_scalar_model(world["policy"], head="fresh")
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err
    assert re.search(
        r"alignlit: .*policy: a new scalar head \(score\.weight\) is initialised, to be trained", out
    )


def test_a_stage_log_has_no_benign_warning_lines(world, tmp_path):
    """`alignlit fit` as a user runs it (a new process, progress bar on): before, the log held the LeafSpec
    deprecation twice, a LitLogger tip and "Epoch 0/-2" in the bar."""
    argv = [
        a for a in fit_args(tmp_path, world, steps=2) if not a.startswith("--trainer.enable_progress_bar")
    ]
    res = subprocess.run(
        [sys.executable, "-m", "alignlit.cli", *argv, "--trainer.enable_progress_bar=true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
        timeout=300,
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    for noise in ("LeafSpec", "Tip:", "litlogger", "Epoch 0/-2", "Warning", "warn("):
        assert noise not in log, f"{noise!r} in the log:\n{log}"
