"""AlignDataModule: arguments checked at construction, files and in-memory records alike, the seeded
split, and loaders that resume exactly inside Lightning's fit loop wherever the checkpoint was written
(mid-epoch, at an epoch's last batch, at the next epoch's first), with and without DataLoader workers."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from alignlit.data import (
    AlignDataModule,
    DataError,
    PreferenceDataModule,
    PromptDataModule,
    RankingDataModule,
    SFTDataModule,
)
from alignlit.data.records import Record


def _collate_ints(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs)


class IntsDataModule(AlignDataModule):
    """The smallest AlignDataModule: records ``{"x": int}``, batches of ints."""

    def uses_tokenizer(self) -> bool:
        return False

    def encode(self, records: list[Record], split: str) -> list[int]:
        return [r.fields["x"] for r in records]

    def collate_fn(self):
        return _collate_ints


class Recorder(L.LightningModule):
    """Records the batches it trains on; one parameter so there is something to optimise."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.tolist() if torch.is_tensor(batch) else list(batch.prompts))
        return (self.w * 1.0).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, *, max_steps=-1, max_epochs=None, every=None, ckpt_path=None, num_workers=0, dm=None):
    module = Recorder()
    if dm is None:
        dm = IntsDataModule(records=[{"x": i} for i in range(10)], batch_size=3, val_fraction=0.0, seed=5,
                            num_workers=num_workers)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        enable_checkpointing=every is not None,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1)]
        if every
        else [],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return module.seen


LIGHTNING_EPOCH_END = pytest.mark.xfail(
    strict=True,
    reason="Lightning 2.6.6's fit loop, resumed from a checkpoint written at the last batch of an epoch, "
    "starts epoch e+2 (current_epoch skips e+1; with max_epochs a whole epoch is never trained), whatever "
    "the loader. This plain LightningModule shows Lightning's behaviour; alignlit's stages rewrite such "
    "checkpoints (AlignModule.on_load_checkpoint -> finish_epoch_in_checkpoint, tests/modules/test_sft.py)",
)


# 10 records in batches of 3: 4 batches an epoch (3, 3, 3, 1), a new permutation every epoch
@pytest.mark.parametrize(
    "length, step, num_workers",
    [
        ({"max_steps": 11}, 2, 0),  # mid-epoch 0
        ({"max_steps": 11}, 5, 0),  # after the first batch of epoch 1
        ({"max_steps": 11}, 7, 0),  # at the second-to-last batch of epoch 1
        ({"max_epochs": 3}, 6, 0),  # run length in epochs, mid-epoch 1
        ({"max_steps": 11}, 6, 2),  # DataLoader workers, mid-epoch 1
        pytest.param({"max_steps": 11}, 4, 0, marks=LIGHTNING_EPOCH_END),  # at the last batch of epoch 0
        pytest.param({"max_epochs": 3}, 4, 0, marks=LIGHTNING_EPOCH_END),
    ],
    ids=["mid0", "start1", "mid1", "epochs-mid1", "workers-mid1", "end0", "epochs-end0"],
)
def test_resume_in_the_fit_loop_replays_the_same_batches(tmp_path, length, step, num_workers):
    straight = _fit(tmp_path / "a", **length, every=step, num_workers=num_workers)
    assert len(straight) == length.get("max_steps", 12)
    epochs = [sorted(x for batch in straight[e * 4 : e * 4 + 4] for x in batch) for e in range(2)]
    assert epochs == [list(range(10))] * 2 and straight[:4] != straight[4:8]  # reshuffled every epoch
    ckpt = next((tmp_path / "a").glob(f"*step={step}.ckpt"))
    resumed = _fit(tmp_path / "b", **length, ckpt_path=str(ckpt), num_workers=num_workers)
    assert resumed == straight[step:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_length_grouped_batches_resume_in_the_fit_loop(tmp_path, tokenizer_dir, num_workers):
    """Preference batches grouped by length, re-formed every epoch: resumed mid-epoch 1 (with workers
    too, whose copies of the dataset get the epoch with every index), the same batches follow."""
    rows = [{"prompt": f"p{i}", "chosen": " a" * (i % 9 + 1), "rejected": " b"} for i in range(24)]

    def dm():
        return PreferenceDataModule(records=rows, tokenizer=str(tokenizer_dir), val_fraction=0.0, max_length=32,
                                    max_prompt_length=16, batch_size=4, group_by_length=True, num_workers=num_workers)  # fmt: skip

    straight = _fit(tmp_path / "a", max_steps=15, every=9, dm=dm())
    assert set(map(tuple, straight[:6])) != set(map(tuple, straight[6:12]))  # new batches every epoch
    resumed = _fit(
        tmp_path / "b", max_steps=15, ckpt_path=str(tmp_path / "a" / "epoch=1-step=9.ckpt"), dm=dm()
    )
    assert resumed == straight[9:]


def test_loader_restored_outside_lightning_keeps_its_epoch():
    """What PPO's ptx loader does: state_dict mid-epoch 1, a fresh loader restored from it continues
    epoch 1 (its sampler's epoch comes back with the state, no set_epoch needed), then epoch 2."""
    dm = IntsDataModule(records=[{"x": i} for i in range(10)], batch_size=3, val_fraction=0.0)
    dm.setup()
    loader = dm.train_dataloader()
    epoch0 = [b.tolist() for b in loader]
    loader.sampler.set_epoch(1)
    it = iter(loader)
    first = [next(it).tolist(), next(it).tolist()]
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    restored = dm.train_dataloader()
    restored.load_state_dict(state)
    assert [b.tolist() for b in restored] == rest and first + rest != epoch0
    assert restored.sampler.epoch == 1


def test_records_and_files_give_the_same_split_and_batches(tmp_path, tokenizer_dir):
    rows = [{"prompt": f"\n\nHuman: copy {'abcd'[i % 4]}\n\nAssistant:", "response": f" {'abcd'[i % 4]}"}
            for i in range(20)]  # fmt: skip
    f = tmp_path / "sft.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import datasets

    common = dict(tokenizer=str(tokenizer_dir), batch_size=4, val_fraction=0.25, seed=3, max_examples=16)
    modules = [
        SFTDataModule(str(f), **common),
        SFTDataModule(records=rows, **common),
        SFTDataModule(records=datasets.Dataset.from_list(rows), **common),
    ]
    batches = []
    for dm in modules:
        dm.setup()
        assert (len(dm.train_set), len(dm.val_set)) == (12, 4)
        batches.append([b.input_ids.tolist() for b in dm.train_dataloader()])
    assert batches[0] == batches[1] == batches[2]
    # the records are not hyperparameters; a digest of them is
    assert "records" not in modules[1].hparams and len(modules[1].hparams["records_sha256"]) == 64
    assert modules[1].hparams["records_sha256"] != SFTDataModule(records=rows[:5], **common).hparams.get(
        "records_sha256"
    )


def test_val_records_and_record_errors_name_the_index(tokenizer_dir):
    rows = [{"prompt": "a", "response": " b"}] * 4
    dm = SFTDataModule(
        records=rows, val_records=[{"prompt": "a", "response": " c"}], tokenizer=str(tokenizer_dir)
    )
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set)) == (4, 1)
    bad = [*rows, {"prompt": "a", "response": ""}]
    with pytest.raises(DataError, match=r"^records\[4\], field 'response': is empty$"):
        SFTDataModule(records=bad, tokenizer=str(tokenizer_dir)).setup()
    with pytest.raises(DataError, match=r"^val_records\[0\]: expected a dict, got str$"):
        SFTDataModule(records=rows, val_records=["x"], tokenizer=str(tokenizer_dir)).setup()


def test_prompt_records_need_no_tokenizer_and_keep_prompt_names():
    dm = PromptDataModule(records=[{"prompt": f"p{i}"} for i in range(6)], batch_size=4)
    dm.setup()
    assert dm.train_prompts == [f"p{i}" for i in range(6)] and dm.val_prompts == []
    dm.train_prompts = ["q"]
    assert dm.train_set == ["q"]


GOOD = {"train_file": "x.jsonl"}


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (SFTDataModule, {}, "give exactly one of train_file, dataset and records \\(got neither\\)"),
        (SFTDataModule, {**GOOD, "records": []}, "give exactly one of train_file, dataset and records \\(got train_file and records\\)"),
        (SFTDataModule, {**GOOD, "val_file": "v", "val_records": []}, "give at most one of val_file, val_dataset and val_records"),
        (SFTDataModule, {**GOOD, "batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        (SFTDataModule, {**GOOD, "batch_size": 2.5}, "batch_size must be an integer >= 1, got 2.5"),
        (SFTDataModule, {**GOOD, "batch_size": True}, "batch_size must be an integer >= 1, got True"),
        (SFTDataModule, {**GOOD, "eval_batch_size": 0}, "eval_batch_size must be an integer >= 1, got 0"),
        (SFTDataModule, {**GOOD, "max_examples": -1}, "max_examples must be an integer >= 1, got -1"),
        (SFTDataModule, {**GOOD, "max_examples": 0}, "max_examples must be an integer >= 1, got 0"),
        (SFTDataModule, {**GOOD, "val_fraction": 1.0}, r"val_fraction must be a number in \[0, 1\), got 1.0"),
        (SFTDataModule, {**GOOD, "val_fraction": -0.1}, r"val_fraction must be a number in \[0, 1\)"),
        (SFTDataModule, {**GOOD, "val_fraction": math.nan}, r"val_fraction must be a number in \[0, 1\), got nan"),
        (SFTDataModule, {**GOOD, "num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
        (SFTDataModule, {**GOOD, "seed": -3}, "seed must be an integer >= 0, got -3"),
        (SFTDataModule, {**GOOD, "max_prompt_length": 0}, "max_prompt_length must be an integer >= 1, got 0"),
        (SFTDataModule, {**GOOD, "max_prompt_length": -5}, "max_prompt_length must be an integer >= 1, got -5"),
        (SFTDataModule, {**GOOD, "max_length": 16, "max_prompt_length": 16}, r"max_prompt_length \(16\) must be < max_length \(16\)"),
        (SFTDataModule, {**GOOD, "overflow": "wrap"}, r"overflow must be one of \['truncate', 'drop', 'error'\], got 'wrap'"),
        (PreferenceDataModule, {**GOOD, "max_length": 0}, "max_length must be an integer >= 2, got 0"),
        (PreferenceDataModule, {**GOOD, "pad_to_multiple_of": 0}, "pad_to_multiple_of must be an integer >= 1, got 0"),
        (PreferenceDataModule, {**GOOD, "length_bucket_edges": (4, 2)}, "length bucket edges must be strictly increasing"),
        (RankingDataModule, {**GOOD, "num_responses": 1}, "RRHF needs at least 2 responses per prompt, got num_responses=1"),
        (RankingDataModule, {**GOOD, "batch_size": -2}, "batch_size must be an integer >= 1, got -2"),
        (PromptDataModule, {**GOOD, "max_prompt_length": 0}, "max_prompt_length must be an integer >= 1, got 0"),
        (PromptDataModule, {**GOOD, "overflow": "cut"}, "overflow must be one of"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)  # fmt: skip
def test_bad_arguments_fail_at_construction_naming_the_argument(cls, kwargs, match):
    with pytest.raises(ValueError, match=f"{cls.__name__}: {match}"):
        cls(**kwargs)
