import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from alignlit.data import SFTDataModule
from alignlit.models import TinyLlama, load_policy, read_metadata
from alignlit.modules import Optim, SFTModule
from alignlit.modules.base import check_finite, warmup_cosine
from tests.conftest import TINY
from tests.helpers import write_sft_file


class Killed(Exception):
    pass


class Record(Callback):
    def __init__(self, crash_at=None):
        self.losses, self.crash_at = [], crash_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append((trainer.global_step, outputs["loss"].item()))
        if self.crash_at is not None and trainer.global_step == self.crash_at:
            raise Killed  # the process dies here, mid-epoch


def _run(
    tmp_path, tokenizer_dir, ckpt_dir, *, max_steps=-1, max_epochs=None, callbacks, ckpt_path=None, every=3
):
    L.seed_everything(0)
    module = SFTModule(
        policy=TinyLlama(tokenizer=str(tokenizer_dir), **TINY), optim=Optim(lr=1e-3, warmup_steps=2)
    )
    dm = SFTDataModule(str(write_sft_file(tmp_path, 48)), batch_size=5, val_fraction=0.0, seed=0)
    trainer = L.Trainer(
        max_steps=max_steps,
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        callbacks=[
            *callbacks,
            ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_last=True, save_top_k=-1),
        ],
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return module


def test_sft_resume_is_exact(tmp_path, tokenizer_dir):
    """Kill mid-epoch (10 batches an epoch) after the step-6 checkpoint, resume: same loss curve."""
    full = Record()
    m_full = _run(tmp_path, tokenizer_dir, tmp_path / "a", max_steps=14, callbacks=[full])
    killed = Record(crash_at=7)
    with pytest.raises(Killed):
        _run(tmp_path, tokenizer_dir, tmp_path / "b", max_steps=14, callbacks=[killed])
    assert killed.losses == full.losses[:7]
    resumed = Record()
    m_res = _run(
        tmp_path,
        tokenizer_dir,
        tmp_path / "b",
        max_steps=14,
        callbacks=[resumed],
        ckpt_path=str(tmp_path / "b" / "epoch=0-step=6.ckpt"),
    )
    assert resumed.losses == full.losses[6:]  # bit-identical from step 7 on, across the epoch boundary
    for p, q in zip(m_full.policy.parameters(), m_res.policy.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("length", [{"max_epochs": 3}, {"max_steps": 30}], ids=["epochs", "steps"])
def test_resume_from_the_last_batch_of_an_epoch_trains_every_epoch(tmp_path, tokenizer_dir, length):
    """A checkpoint written after the last batch of epoch 0 (step 10 of 10): Lightning 2.6 alone resumes
    it in epoch 2 and never trains epoch 1; the stage rewrites the loop state to the end of epoch 0, so
    the resumed run trains the same 20 steps on the same batches as the uninterrupted one."""
    full = Record()
    m_full = _run(tmp_path, tokenizer_dir, tmp_path / "a", callbacks=[full], every=5, **length)
    assert len(full.losses) == 30
    resumed = Record()
    m_res = _run(
        tmp_path,
        tokenizer_dir,
        tmp_path / "b",
        callbacks=[resumed],
        every=5,
        ckpt_path=str(tmp_path / "a" / "epoch=0-step=10.ckpt"),
        **length,
    )
    assert resumed.losses == full.losses[10:]
    for p, q in zip(m_full.policy.parameters(), m_res.policy.parameters()):
        assert torch.equal(p, q)


def test_sft_resume_is_exact_when_the_run_length_is_in_epochs(tmp_path, tokenizer_dir):
    """With max_epochs the schedule's length comes from the data; resuming mid-epoch stays exact."""
    full = Record()
    _run(tmp_path, tokenizer_dir, tmp_path / "a", max_epochs=2, callbacks=[full])
    assert len(full.losses) == 20
    killed = Record(crash_at=7)
    with pytest.raises(Killed):
        _run(tmp_path, tokenizer_dir, tmp_path / "b", max_epochs=2, callbacks=[killed])
    resumed = Record()
    _run(
        tmp_path,
        tokenizer_dir,
        tmp_path / "b",
        max_epochs=2,
        callbacks=[resumed],
        ckpt_path=str(tmp_path / "b" / "epoch=0-step=6.ckpt"),
    )
    assert resumed.losses == full.losses[6:]


def test_warmup_cosine_schedule_values():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine(opt, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warmup: 1/2, 2/2; then cosine over 4 steps: 0.1 + 0.9*0.5*(1+cos(pi*k/4)), k=0..4
    expected = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + 2**-0.5), 0.55, 0.1 + 0.45 * (1 - 2**-0.5), 0.1]
    assert lrs == pytest.approx(expected)
    # the total may be given late (a callable asked once warmup is over): same schedule
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    asked = []
    sched = warmup_cosine(opt, warmup_steps=2, total_steps=lambda: asked.append(1) or 6, min_lr_ratio=0.1)
    lazy = []
    for _ in range(7):
        lazy.append(opt.param_groups[0]["lr"])
        assert len(asked) == (1 if len(lazy) > 3 else 0)
        opt.step()
        sched.step()
    assert lazy == pytest.approx(expected)


def test_nan_loss_raises_with_step():
    with pytest.raises(FloatingPointError, match=r"SFT loss is nan at global step 12 \(nll=nan\)"):
        check_finite(
            torch.tensor(float("nan")), what="SFT loss", step=12, metrics={"nll": torch.tensor(float("nan"))}
        )


def test_sft_learns_and_exports(tmp_path, tokenizer_dir):
    """50 steps on a 3-example dataset drive the response NLL far below its initial ln(V)."""
    f = tmp_path / "sft.jsonl"
    rows = [
        {"prompt": "\n\nHuman: copy a b\n\nAssistant:", "response": " a b"},
        {"prompt": "\n\nHuman: reverse a b\n\nAssistant:", "response": " b a"},
        {"prompt": "\n\nHuman: sort c a\n\nAssistant:", "response": " a c"},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    L.seed_everything(0)
    module = SFTModule(
        policy=TinyLlama(tokenizer=str(tokenizer_dir), **TINY),
        optim=Optim(lr=3e-3, warmup_steps=5),
        export_dir=str(tmp_path / "out"),
    )
    dm = SFTDataModule(str(f), val_file=str(f), batch_size=3)
    trainer = L.Trainer(
        max_steps=60,
        default_root_dir=tmp_path,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=60,
        check_val_every_n_epoch=None,
    )
    trainer.fit(module, dm)
    vocab = len(module.tokenizer)
    assert trainer.callback_metrics["val/loss"] < 0.05 * torch.log(torch.tensor(float(vocab)))
    assert trainer.callback_metrics["val/ppl"] == pytest.approx(
        torch.exp(trainer.callback_metrics["val/loss"])
    )
    meta = read_metadata(tmp_path / "out")
    assert meta["stage"] == "sft" and meta["data"]["train_file"] == str(f)
    policy, tok = load_policy(tmp_path / "out")
    ids = tok("\n\nHuman: reverse a b\n\nAssistant:", return_tensors="pt").input_ids
    out = policy.generate(ids, max_new_tokens=4, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == " b a"


def test_compile_decoder_callback_compiles_the_policy_and_trains_the_same(tmp_path, tokenizer_dir):
    """CompileDecoder (backend "eager": torch.compile's graph capture without code generation, fast
    enough for CI) compiles the policy's decoder, and the 5 losses equal the uncompiled run's."""
    from alignlit.callbacks import CompileDecoder

    plain, compiled = Record(), Record()
    _run(tmp_path, tokenizer_dir, tmp_path / "a", max_steps=5, callbacks=[plain])
    module = _run(
        tmp_path,
        tokenizer_dir,
        tmp_path / "b",
        max_steps=5,
        callbacks=[compiled, CompileDecoder(backend="eager")],
    )
    assert module.policy.get_decoder()._compiled_call_impl is not None
    assert [s for s, _ in compiled.losses] == [s for s, _ in plain.losses]
    assert [x for _, x in compiled.losses] == pytest.approx([x for _, x in plain.losses], rel=1e-5, abs=1e-6)
