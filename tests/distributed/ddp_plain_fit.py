"""SFT on a plain ``lightning.Trainer`` (no alignlit CLI, Lightning's default
``use_distributed_sampler=True``), run by tests/distributed/test_ddp_plain_trainer.py: as a script with
``devices=2`` (Lightning's DDP launcher starts the second process by running this file again) and
in-process with ``devices=1``. Writes the rows every rank trained on and rank 0's final weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch

from alignlit.data import SFTDataModule
from alignlit.models import TinyLlama
from alignlit.modules import Optim, SFTModule

GLOBAL_BATCH = 8
STEPS = 4


class SeenRows(L.Callback):
    """The unpadded token rows of every training batch this rank sees."""

    def __init__(self):
        self.rows: list[list[list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append([ids[mask].tolist() for ids, mask in zip(batch.input_ids, batch.attention_mask)])


def fit(data: str, tokenizer: str, out: str, devices: int) -> None:
    L.seed_everything(0)
    spec = TinyLlama(tokenizer=tokenizer, hidden_size=64, num_layers=2, num_heads=1, head_dim=64,
                     intermediate_size=128)  # fmt: skip
    module = SFTModule(policy=spec, optim=Optim(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0))
    dm = SFTDataModule(
        data, batch_size=GLOBAL_BATCH // devices, val_fraction=0.0, max_length=32, max_prompt_length=16
    )
    seen = SeenRows()
    Path(out).mkdir(parents=True, exist_ok=True)
    if devices == 1:
        torch.save({k: v.clone() for k, v in module.policy.state_dict().items()}, Path(out, "init.pt"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[seen],
    )
    trainer.fit(module, dm)
    Path(out, f"rows-{trainer.global_rank}.json").write_text(json.dumps(seen.rows))
    if trainer.global_rank == 0:
        torch.save(module.policy.state_dict(), Path(out, "weights.pt"))


if __name__ == "__main__":
    fit(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
