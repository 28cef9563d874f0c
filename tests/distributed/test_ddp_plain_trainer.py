"""A plain ``lightning.Trainer(strategy="ddp", devices=2, accelerator="cpu")`` (no alignlit CLI, so
Lightning's ``use_distributed_sampler=True``) trains SFTModule on alignlit's DataModule: the loaders
shard themselves (their sampler is a ``DistributedSampler``, which Lightning does not re-wrap; before,
it crashed with ``'DistributedSamplerWrapper' object has no attribute 'skip'``), the two ranks' batches
of each step together are the one-process batch of the same global size, and the weights agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.distributed import ddp_plain_fit


def _write_data(path: Path) -> Path:
    # every response has the same number of tokens, so each rank's token-mean loss has the same weight
    # and the average of the two ranks' gradients is the gradient of the global batch
    rows = [
        {"prompt": f"\n\nHuman: copy {'abcdefgh'[i % 8]} {'abcdefgh'[i // 8 % 8]}\n\nAssistant:",
         "response": f" {'abcdefgh'[i % 8]} {'abcdefgh'[i // 8 % 8]}"}
        for i in range(48)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_plain_ddp_trainer_matches_one_process(tmp_path, tokenizer_dir):
    data = _write_data(tmp_path / "sft.jsonl")
    from alignlit.data import SFTDataModule

    dm = SFTDataModule(
        str(data), tokenizer=str(tokenizer_dir), val_fraction=0.0, max_length=32, max_prompt_length=16
    )
    dm.setup()
    assert len({len(e.input_ids) - e.prompt_length for e in dm.train_set}) == 1  # equal response lengths

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run(
        [sys.executable, ddp_plain_fit.__file__, str(data), str(tokenizer_dir), str(tmp_path / "ddp"), "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    ddp_plain_fit.fit(str(data), str(tokenizer_dir), str(tmp_path / "one"), 1)

    one = json.loads((tmp_path / "one" / "rows-0.json").read_text())
    r0, r1 = (json.loads((tmp_path / "ddp" / f"rows-{r}.json").read_text()) for r in (0, 1))
    assert len(one) == len(r0) == len(r1) == ddp_plain_fit.STEPS
    for step in range(ddp_plain_fit.STEPS):
        assert len(r0[step]) == len(r1[step]) == ddp_plain_fit.GLOBAL_BATCH // 2
        both = Counter(map(tuple, r0[step] + r1[step]))
        assert both == Counter(map(tuple, one[step])), (
            f"step {step}: the ranks' rows are not the global batch"
        )

    single, ddp, init = (torch.load(tmp_path / d / f, weights_only=True)
                         for d, f in (("one", "weights.pt"), ("ddp", "weights.pt"), ("one", "init.pt")))  # fmt: skip
    for name in single:
        # DDP averages two half-batch gradients where one process takes the mean of the whole batch:
        # the same math summed in another order; Adam turns that into differences far below 1e-4
        diff = (ddp[name] - single[name]).abs().max().item()
        assert diff < 1e-4, f"{name}: max |ddp - single| = {diff:.2e}"
    moved = max((single[n] - init[n]).abs().max().item() for n in single)
    assert moved > 3e-3  # 4 AdamW steps at lr 1e-3 move weights by ~4e-3: the comparison is not vacuous
