"""Issue 36, silent wrong result 2: dropped prompts were invisible (GSM8K with max_prompt_length 100 and
overflow 'drop' trained on 14 of 200 prompts, exit 0, the count only in log.info). Every drop/truncation count
is now printed, written to the logged metrics, and a drop of more than DROP_WARN_SHARE warns."""

from __future__ import annotations

import csv
import gzip
import json

import lightning as L
import pytest

from alignlit.data import PromptDataModule, load_tokenizer
from alignlit.data.base import DROP_WARN_SHARE
from tests.hubcache import GSM8K_TRAIN, snapshot_dir


def test_gsm8k_drops_are_printed_logged_and_warned(hub_cache, tmp_path, capsys):
    tok = load_tokenizer(snapshot_dir(hub_cache))
    with gzip.open(GSM8K_TRAIN, "rt") as f:
        rows = [json.loads(next(f)) for _ in range(200)]
    kept = sum(len(tok(r["question"], add_special_tokens=False).input_ids) <= 60 for r in rows)
    assert 0 < kept < 200 * (1 - DROP_WARN_SHARE)  # the case of the issue: most prompts dropped
    dm = PromptDataModule(
        dataset={"path": "json", "data_files": str(GSM8K_TRAIN), "split": "train[:200]"},
        columns={"question": "prompt"},
        max_prompt_length=60,
        overflow="drop",
        tokenizer=str(snapshot_dir(hub_cache)),
    )
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="drops")
    dm.trainer = L.Trainer(logger=logger, accelerator="cpu", devices=1, enable_progress_bar=False)
    with pytest.warns(UserWarning, match=rf"{200 - kept} of 200 records \(\d+%\) were dropped"):
        dm.setup("fit")
    assert len(dm.train_prompts) == kept
    out = capsys.readouterr().out
    assert (
        f"200 records -> {kept} train / 0 val examples; prompts_dropped_over_max_length {200 - kept}" in out
    )
    logger.save()
    with open(logger.log_dir + "/metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    assert float(metrics[0]["data/prompts_dropped_over_max_length"]) == 200 - kept
    assert float(metrics[0]["data/examples_train"]) == kept


def test_no_warning_when_nothing_is_dropped(hub_cache, capsys, recwarn):
    dm = PromptDataModule(records=[{"prompt": "What is 2 + 2?"}] * 3, max_prompt_length=60, overflow="drop",
                          tokenizer=str(snapshot_dir(hub_cache)))  # fmt: skip
    dm.setup("fit")
    assert "3 records -> 3 train / 0 val examples; nothing truncated or dropped" in capsys.readouterr().out
    assert not [w for w in recwarn if "dropped" in str(w.message)]


def test_message_list_prompts_with_an_answers_file_say_what_to_do(tmp_path):
    """Issue 36 unclear error: message-list prompts with the math reward ended in 'unhashable type: list'."""
    from alignlit.data import DataError
    from alignlit.rewards.math import MathVerifyReward

    f = tmp_path / "mp.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+2?"}], "answer": "#### 3"}) + "\n")
    with pytest.raises(
        DataError, match=r"mp.jsonl:1, field 'prompt': a list of messages cannot key .* `answer` column"
    ):
        MathVerifyReward(answers_file=str(f))
