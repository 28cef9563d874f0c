"""KTO (issue 34 item 2): the loss and reference point by hand, unpaired records and pairs split into
unpaired examples, the mismatched batch, and the stage against a naive forward."""

from __future__ import annotations

import gzip
import json
import math

import lightning as L
import pytest
import torch

from alignlit.data import DataError, UnpairedDataModule, load_tokenizer
from alignlit.data.unpaired import UnpairedExample, collate_unpaired
from alignlit.losses import kto_loss, kto_reference_point
from alignlit.modules import KTOModule, Optim
from tests.hubcache import GSM8K_TRAIN, snapshot_dir

HH = GSM8K_TRAIN.parents[1] / "hh-rlhf-harmless-base-dev.jsonl.gz"


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_by_hand():
    """β = 0.5, λ_D = 1, λ_U = 2, z = 0.2; r = (0.5, -0.5, 0.5), labels (good, bad, good):
    (1 - σ(0.15)) + 2(1 - σ(0.35)) + (1 - σ(0.15)), over 3."""
    policy = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([-1.5, -1.5, -3.5], dtype=torch.float64)
    good = torch.tensor([True, False, True])
    loss, metrics = kto_loss(policy, reference, good, torch.tensor(0.2), beta=0.5, undesirable_weight=2.0)
    want = ((1 - sig(0.15)) + 2 * (1 - sig(0.35)) + (1 - sig(0.15))) / 3
    assert loss.item() == pytest.approx(want, abs=1e-8)  # z given as float32 0.2
    assert (
        metrics["rewards/chosen"].item() == pytest.approx(0.25)
        and metrics["rewards/rejected"].item() == -0.25
    )
    loss.backward()  # d/dr of (1 - σ(β(r - z))) = -β σ'(·): desirable rows pushed up, undesirable down
    assert policy.grad[0] < 0 and policy.grad[1] > 0
    assert policy.grad[0].item() == pytest.approx(-0.5 * sig(0.15) * (1 - sig(0.15)) / 3, abs=1e-8)


def test_reference_point_by_hand():
    assert kto_reference_point(torch.tensor([-2.0, -1.0]), torch.tensor([-1.0, -3.0])).item() == 0.5
    assert (
        kto_reference_point(torch.tensor([-3.0, -3.0]), torch.tensor([-1.0, -1.0])).item() == 0.0
    )  # clamped
    with pytest.raises(ValueError):
        kto_reference_point(torch.zeros(2), torch.zeros(3))


def test_collate_mismatches_each_prompt_with_the_previous_completion():
    ex = [
        UnpairedExample([1, 2], [10, 11, 99], True),
        UnpairedExample([3], [20, 99], False),
        UnpairedExample([4, 5, 6], [30, 99], True),
    ]
    batch = collate_unpaired(ex, pad_id=0, max_length=5)
    rows = [r[m].tolist() for r, m in zip(batch.mismatched.input_ids, batch.mismatched.attention_mask)]
    assert rows == [[1, 2, 30, 99], [3, 10, 11, 99], [4, 5, 6, 20, 99]]
    assert batch.desirable.tolist() == [True, False, True]
    loss_rows = [r[m].tolist() for r, m in zip(batch.matched.input_ids, batch.matched.loss_mask)]
    assert loss_rows == [[10, 11, 99], [20, 99], [30, 99]]


@pytest.fixture
def hh_rows():
    with gzip.open(HH, "rt") as f:
        return [json.loads(next(f)) for _ in range(8)]


def test_records_and_pairs(hub_cache, hh_rows, tmp_path):
    tok = load_tokenizer(snapshot_dir(hub_cache))
    dm = UnpairedDataModule(
        records=hh_rows, from_pairs=True, chat=True, val_fraction=0.0, max_length=512, max_prompt_length=384
    )
    dm.tokenizer = tok
    examples = dm.encode(dm.read()[0], "train")
    assert len(examples) == 16 and [e.desirable for e in examples[:4]] == [True, False, True, False]
    assert examples[0].prompt_ids == examples[1].prompt_ids  # the pair's shared prompt
    f = tmp_path / "u.jsonl"
    f.write_text(
        json.dumps({"prompt": "q", "completion": "a", "label": True})
        + "\n"
        + json.dumps({"prompt": "q", "completion": "b", "label": "yes"})
        + "\n"
    )
    bad = UnpairedDataModule(str(f), val_fraction=0.0)
    bad.tokenizer = tok
    with pytest.raises(DataError, match=r"u.jsonl:2, field 'label': expected true or false, got 'yes'"):
        bad.encode(bad.read()[0], "train")


def naive_logps(model, batch_part) -> torch.Tensor:
    """(B,) sequence log-probs of the loss-masked tokens, one row at a time with full logits."""
    out = []
    for ids, attn, loss in zip(batch_part.input_ids, batch_part.attention_mask, batch_part.loss_mask):
        ids, loss = ids[attn], loss[attn]
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double(), -1)
        out.append(logp.gather(-1, ids[1:, None])[:, 0][loss[1:]].sum())
    return torch.stack(out)


def test_stage_loss_equals_a_naive_forward_and_trains(hub_cache, hh_rows, tmp_path):
    policy = str(snapshot_dir(hub_cache))
    module = KTOModule(policy, beta=0.3, undesirable_weight=1.5, optim=Optim(lr=1e-2, warmup_steps=0))
    dm = UnpairedDataModule(
        records=hh_rows,
        from_pairs=True,
        chat=True,
        val_fraction=0.0,
        batch_size=4,
        max_length=256,
        max_prompt_length=192,
        tokenizer=policy,
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    loss0, metrics0 = module.kto(batch)
    assert loss0.item() == pytest.approx(
        sum(1.5 if not g else 1.0 for g in batch.desirable.tolist()) * 0.5 / 4, abs=1e-6
    )
    assert metrics0["kl"].item() == 0.0  # policy = reference at the start
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm)
    with torch.no_grad():
        loss, metrics = module.kto(batch)
        pol, ref = naive_logps(module.policy, batch.matched), naive_logps(module.reference, batch.matched)
        z = kto_reference_point(
            naive_logps(module.policy, batch.mismatched), naive_logps(module.reference, batch.mismatched)
        )
        want, _ = kto_loss(pol, ref, batch.desirable, z, beta=0.3, undesirable_weight=1.5)
    assert loss.item() == pytest.approx(want.item(), abs=1e-5)
    assert metrics["kl"].item() == pytest.approx(z.item(), abs=1e-5)
    assert abs(loss.item() - loss0.item()) > 1e-4  # the policy moved


@pytest.mark.slow
def test_quickstart_config_runs(tmp_path, tiny_policy_dir):
    """configs/quickstart/kto.yaml through the command line for 2 steps on a tiny policy, exporting a policy."""
    from alignlit.cli import main
    from alignlit.models.export import read_metadata

    pairs = tmp_path / "pairs.jsonl"
    ops = ("sort", "copy", "reverse", "dedupe")
    pairs.write_text("".join(
        json.dumps({"prompt": f"\n\nHuman: {ops[i % 4]} a b\n\nAssistant:", "chosen": " a b", "rejected": " b"}) + "\n"
        for i in range(16)
    ))  # fmt: skip
    out = tmp_path / "kto"
    main(["fit", "--config", "configs/quickstart/kto.yaml", f"--model.init_args.policy={tiny_policy_dir}",
          f"--model.init_args.export_dir={out}", f"--data.init_args.train_file={pairs}", "--data.init_args.val_fraction=0.25",
          "--data.init_args.batch_size=4", "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.logger=false",
          "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    meta = read_metadata(out)
    assert meta["stage"] == "kto" and math.isfinite(meta["metrics"]["val/loss"])
