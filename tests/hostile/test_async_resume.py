"""Resuming an asynchronous run (issue 36, item 8): a finished ``max_staleness = 1`` run resumed with a larger
``max_epochs`` generated its first batch after the resume at staleness 0 (a straight run: 1), so it differed
from the run made that long from the start, without a word. The weights that batch would need are gone, so
the resume cannot be exact: it now prints a notice naming the steps. A checkpoint taken mid-run (which holds
the batches generated ahead) prints none, and its resume stays exact (tests/modules/test_async.py)."""

from __future__ import annotations

import json

import lightning as L
import torch

from alignlit.data import PromptDataModule
from tests.modules.test_async import PROMPTS, grpo


def run(module, prompts_file, root, *, epochs, ckpt_path=None):
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1,
                                                     save_top_k=-1, save_last=False)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=epochs, limit_train_batches=3, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint], default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(train_file=str(prompts_file), batch_size=2), ckpt_path=ckpt_path)


def test_resuming_a_finished_async_run_for_longer_says_it_is_not_the_straight_run(
    tiny_policy_dir, tmp_path, capsys
):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    first = grpo(tiny_policy_dir, 1)
    run(first, prompts_file, tmp_path / "a", epochs=1)
    by_step = {}
    for path in (tmp_path / "a" / "ckpt").iterdir():
        state = torch.load(path, weights_only=True)[f"{first.stage}_state"]
        by_step[state["rollout"]["rollouts"]] = (path, sorted(state["ahead"]))
    assert by_step[2][1] == [2] and by_step[3][1] == []  # the finished run's checkpoint has nothing ahead
    capsys.readouterr()

    resumed = grpo(tiny_policy_dir, 1)
    run(resumed, prompts_file, tmp_path / "b", epochs=2, ckpt_path=str(by_step[3][0]))
    out = capsys.readouterr().out
    assert (
        "alignlit: notice: this checkpoint (rollout step 3, max_staleness 1) holds no rollouts generated ahead "
        "for step(s) 3" in out
    )
    assert "not bit-identical" in out
    assert (
        resumed.progress.history[3]["async/staleness_max"] == 0.0
    )  # what the notice warns of (straight: 1.0)

    mid = grpo(tiny_policy_dir, 1)
    run(mid, prompts_file, tmp_path / "c", epochs=1, ckpt_path=str(by_step[2][0]))
    assert "notice" not in capsys.readouterr().out and mid.resume_notice == ""
