"""DPOModule: the concatenated forward, the loss selection, the precomputed reference cache, a config fit,
dropout off, reference-free losses, custom losses with the SFT term."""

from __future__ import annotations

import json
import math
import shutil

import lightning as L
import pytest
import torch

from alignlit.data import PreferenceDataModule
from alignlit.losses import dpo_loss
from alignlit.models import TinyLlama, export_pretrained, load_policy, make_tiny_llama, read_metadata
from alignlit.models.forward import token_logprobs
from alignlit.models.reference_cache import ReferenceCache
from alignlit.modules import Optim
from alignlit.modules.dpo import DPOModule
from alignlit.modules.preference_objective import pair_logprobs
from tests.conftest import TINY

ROWS = [
    ("sort c a d", " a c d", " c a d ok done"),
    ("reverse a b", " b a", " a b"),
    ("copy h g f", " h g f", " sure h g ok"),
    ("dedupe a a b", " a b", " a a b"),
    ("sort b a", " a b", " b"),
    ("reverse c d e", " e d c", " e d c ok that is all"),
    ("copy a b c d", " a b c d", " a b d"),
    ("dedupe c c", " c", " c c c"),
]


def _pairs_file(path, rows=ROWS):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"prompt": f"\n\nHuman: {q}\n\nAssistant:", "chosen": c, "rejected": r}) + "\n"
            for q, c, r in rows
        )
    )
    return path


def _dm(path, tokenizer_dir=None, **kwargs):
    args = dict(val_fraction=0.25, max_length=32, max_prompt_length=16, batch_size=3, seed=0)
    args.update(kwargs)
    return PreferenceDataModule(
        str(path), tokenizer=None if tokenizer_dir is None else str(tokenizer_dir), **args
    )


def _batch(path, tokenizer_dir):
    dm = _dm(path, tokenizer_dir, val_fraction=0.0, batch_size=len(ROWS))
    dm.setup()
    return next(iter(dm.train_dataloader()))


def _naive_sequence_logps(model, batch) -> torch.Tensor:
    """(2B,) per row: run the unpadded sequence alone, sum log_softmax over its response tokens."""
    out = []
    for ids, attn, loss in zip(batch.input_ids, batch.attention_mask, batch.loss_mask):
        ids, loss = ids[attn], loss[attn]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]  # (L, V)
        logps = torch.log_softmax(logits[:-1].double(), -1).gather(-1, ids[1:, None]).squeeze(-1)  # (L-1,)
        out.append(logps[loss[1:]].sum())
    return torch.stack(out).float()


def _export_tiny(tokenizer, path, seed):
    export_pretrained(make_tiny_llama(tokenizer, seed=seed, **TINY), tokenizer, path, stage="init")
    return path


def test_concatenated_forward_equals_separate_forwards(tmp_path, tiny_policy_dir, tokenizer_dir, tokenizer):
    """One (2B, T) forward gives, for every chosen and rejected row, the same log-prob as running that
    sequence alone without padding; |y_w| counts the response tokens plus EOS."""
    batch = _batch(_pairs_file(tmp_path / "pairs.jsonl"), tokenizer_dir)
    model = load_policy(tiny_policy_dir)[0]
    with torch.no_grad():
        logps = pair_logprobs(model, batch)
        separate = [
            token_logprobs(model, half.input_ids, half.attention_mask, half.loss_mask).sum()
            for half in (batch.chosen, batch.rejected)
        ]
    naive = _naive_sequence_logps(model, batch)
    b = len(batch)
    assert batch.input_ids.shape[0] == 2 * b == 2 * len(ROWS)
    torch.testing.assert_close(logps.chosen_sum, separate[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logps.rejected_sum, separate[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logps.chosen_sum, naive[:b], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logps.rejected_sum, naive[b:], atol=1e-5, rtol=1e-5)
    expected_lengths = [len(tokenizer(c, add_special_tokens=False).input_ids) + 1 for c in batch.chosen_texts]
    assert logps.chosen_length.tolist() == expected_lengths


def test_loss_selection_at_initialisation(tmp_path, tiny_policy_dir, tokenizer_dir):
    """At step 0 the policy equals the reference, so h = 0 for every pair:
    DPO -log σ(0) = ln 2; cDPO -(1-ε)log σ(0) - ε log σ(0) = ln 2 too; IPO (0 - 1/(2β))² = (1/0.2)² = 25
    for β = 0.1; RPO adds α·mean(-log π(y_w)/|y_w|)."""
    batch = _batch(_pairs_file(tmp_path / "pairs.jsonl"), tokenizer_dir)
    cases = {
        "dpo": (dict(loss_type="dpo"), math.log(2)),
        "cdpo": (dict(loss_type="dpo", loss_args={"label_smoothing": 0.2}), math.log(2)),
        "ipo": (dict(loss_type="ipo", beta=0.1), 25.0),
    }
    for name, (kwargs, expected) in cases.items():
        module = DPOModule(str(tiny_policy_dir), precompute_reference=False, **kwargs)
        with torch.no_grad():
            loss, metrics = module.preference_loss(batch)
        assert loss.item() == pytest.approx(expected, rel=1e-5), name
        assert metrics["rewards/margin"].item() == pytest.approx(0.0, abs=1e-5), name

    module = DPOModule(str(tiny_policy_dir), precompute_reference=False, sft_weight=0.5)
    with torch.no_grad():
        loss, metrics = module.preference_loss(batch)
        logps = pair_logprobs(module.policy, batch)
    sft = (-logps.chosen_sum / logps.chosen_length).mean().item()
    assert metrics["sft_loss"].item() == pytest.approx(sft, rel=1e-5)
    assert loss.item() == pytest.approx(math.log(2) + 0.5 * sft, rel=1e-5)


def test_loss_with_a_different_reference(tmp_path, tiny_policy_dir, tokenizer_dir, tokenizer):
    """With π_0 a different model, the module's loss is dpo_loss on the per-sequence log-probs of the
    policy and of the reference, each computed here by unpadded forwards."""
    reference_dir = _export_tiny(tokenizer, tmp_path / "reference", seed=1)
    batch = _batch(_pairs_file(tmp_path / "pairs.jsonl"), tokenizer_dir)
    module = DPOModule(
        str(tiny_policy_dir),
        reference=str(reference_dir),
        precompute_reference=False,
        beta=0.5,
        loss_args={"label_smoothing": 0.1},
    )
    with torch.no_grad():
        loss, _ = module.preference_loss(batch)
    policy = _naive_sequence_logps(load_policy(tiny_policy_dir)[0], batch)
    reference = _naive_sequence_logps(load_policy(reference_dir)[0], batch)
    b = len(batch)
    expected, _ = dpo_loss(
        policy[:b], policy[b:], reference[:b], reference[b:], beta=0.5, label_smoothing=0.1
    )
    assert abs(expected.item() - math.log(2)) > 1e-3  # the reference really differs
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


def test_bad_settings_are_named():
    """Every bad setting fails at construction (before any model is loaded), naming the setting."""
    with pytest.raises(
        ValueError,
        match=r"loss_type 'kto' is not a registered preference loss \(one of \['dpo', 'hinge', 'ipo', 'orpo', 'simpo', 'slic'",
    ):
        DPOModule("unused", loss_type="kto")
    with pytest.raises(
        ValueError,
        match=r"loss_args: preference loss 'ipo' has no argument 'label_smoothing' \(its arguments: beta\)",
    ):
        DPOModule("unused", loss_type="ipo", loss_args={"label_smoothing": 0.1})
    with pytest.raises(ValueError, match="beta must be > 0, got 0"):
        DPOModule("unused", beta=0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\], got 0.7"):
        DPOModule("unused", loss_args={"label_smoothing": 0.7})
    with pytest.raises(ValueError, match="gamma must be >= 0, got -1"):
        DPOModule("unused", loss_type="simpo", loss_args={"gamma": -1})
    with pytest.raises(ValueError, match=r"beta is given twice: beta=0.2 and loss_args.beta=0.3"):
        DPOModule("unused", beta=0.2, loss_args={"beta": 0.3})
    with pytest.raises(ValueError, match="sft_weight must be >= 0, got -1"):
        DPOModule("unused", sft_weight=-1)
    with pytest.raises(ValueError, match="preference loss 'dpo' needs a reference policy"):
        DPOModule("unused", reference="none")
    with pytest.raises(
        ValueError, match=r"preference loss 'simpo' is reference-free: drop reference='ref/dir'"
    ):
        DPOModule("unused", loss_type="simpo", reference="ref/dir")


def test_reference_cache_hit_miss_and_invalidation(tmp_path, tiny_policy_dir, tokenizer_dir, tokenizer):
    """The first fit computes the cache next to the data (miss), the next run loads it (hit); changing
    the data file, a tokenisation setting or the reference weights each gives a miss and removes the
    stale file. The cached values are the reference model's log-probs; no reference model is kept."""
    policy = tmp_path / "policy"
    shutil.copytree(tiny_policy_dir, policy)
    data = _pairs_file(tmp_path / "data" / "pairs.jsonl")
    cache_dir = tmp_path / "data" / ".alignlit_cache"

    L.seed_everything(0)
    first = DPOModule(str(policy), optim=Optim(lr=1e-3, warmup_steps=1))
    assert (
        first.reference_model is None
    )  # precompute_reference: the reference is loaded only to fill the cache
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(first, _dm(data))
    assert first.reference_cache_status == "miss" and first.reference_model is None
    assert first.reference_cache_path.parent == cache_dir and first.reference_cache_path.exists()
    assert len(first.reference_cache) == 2 * len(ROWS)  # every chosen and rejected sequence, train and val
    batch = _batch(data, tokenizer_dir)
    cached = first.reference_cache.lookup(batch)
    with torch.no_grad():
        direct = pair_logprobs(load_policy(policy)[0], batch)
    torch.testing.assert_close(cached.chosen_sum, direct.chosen_sum, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached.rejected_sum, direct.rejected_sum, atol=1e-5, rtol=1e-5)

    def prepare(**dm_kwargs) -> DPOModule:
        module = DPOModule(str(policy))
        dm = _dm(data, tokenizer_dir, **dm_kwargs)
        dm.setup()
        module.prepare_reference(dm)
        return module

    # tokenizer given to the datamodule: a different fingerprint from the fit above
    assert prepare().reference_cache_status == "miss"
    second = prepare()
    assert second.reference_cache_status == "hit"
    assert prepare(batch_size=2).reference_cache_status == "hit"  # the batch size does not matter

    _pairs_file(data, [*ROWS, ("sort d c", " c d", " d c")])  # the data changes
    third = prepare()
    assert (
        third.reference_cache_status == "miss" and third.reference_cache_path != second.reference_cache_path
    )
    assert sorted(cache_dir.iterdir()) == [third.reference_cache_path]  # the stale file is gone

    assert prepare(max_length=30).reference_cache_status == "miss"  # a tokenisation setting changes
    _export_tiny(tokenizer, policy, seed=3)  # the reference weights change in place
    assert prepare(max_length=30).reference_cache_status == "miss"
    assert prepare(max_length=30).reference_cache_status == "hit"
    assert len(list(cache_dir.iterdir())) == 1


def test_cache_lookup_of_unknown_rows_raises(tmp_path, tokenizer_dir):
    batch = _batch(_pairs_file(tmp_path / "pairs.jsonl"), tokenizer_dir)
    with pytest.raises(KeyError, match=r"rows \[0, 1, .*\] of this batch have no cached reference log-probs"):
        ReferenceCache({}).lookup(batch)


def test_dpo_config_fits(tmp_path, tiny_policy_dir):
    """configs/quickstart/dpo.yaml runs end to end (2 steps) on a tiny policy and exports a DPO policy."""
    from alignlit.cli import main

    data = _pairs_file(tmp_path / "pairs.jsonl")
    out = tmp_path / "dpo"
    main(
        [
            "fit",
            "--config",
            "configs/quickstart/dpo.yaml",
            f"--model.init_args.policy={tiny_policy_dir}",
            f"--model.init_args.export_dir={out}",
            f"--data.init_args.train_file={data}",
            "--data.init_args.val_fraction=0.25",
            "--trainer.max_steps=2",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    meta = read_metadata(out)
    assert meta["stage"] == "dpo" and meta["data"]["train_file"] == str(data)
    assert load_policy(out)[0].num_parameters() == load_policy(tiny_policy_dir)[0].num_parameters()


def test_dpo_learns_the_preferences(tmp_path, tiny_policy_dir, tokenizer_dir):
    """25 steps on 8 pairs: every pair ends with a positive implicit-reward margin h > 0 (a sign error
    in the chosen/rejected rows would drive the accuracy to 0 instead)."""
    data = _pairs_file(tmp_path / "pairs.jsonl")
    L.seed_everything(0)
    module = DPOModule(str(tiny_policy_dir), beta=0.5, optim=Optim(lr=3e-3, warmup_steps=1))
    trainer = L.Trainer(
        max_steps=25,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(module, _dm(data, val_fraction=0.0, batch_size=4))
    with torch.no_grad():
        _, metrics = module.preference_loss(_batch(data, tokenizer_dir))
    assert metrics["rewards/accuracy"].item() == 1.0
    assert metrics["rewards/margin"].item() > 1.0


# ---------------------------------------------------------------------- dropout, reference-free, custom losses
def _first_step_loss(module, dm) -> float:
    """The loss the first training step returns."""

    class First(L.Callback):
        loss: float | None = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.loss is None:
                self.loss = outputs["loss"].item()

    first = First()
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[first],
    )
    trainer.fit(module, dm)
    return first.loss


@pytest.mark.parametrize("source", ["tiny_spec", "directory_with_cache"])
def test_dropout_is_off_so_the_first_loss_is_log_2(tmp_path, tokenizer_dir, tokenizer, source):
    """A backbone with attention_dropout = 0.1 and the reference equal to the policy: with dropout on, the
    policy's log-probs in train mode differ from the reference's (checked first, so the test can fail) and
    the loss is not ln 2; with dropout off h = 0 for every pair and the first loss is -log σ(0) = ln 2."""
    model = make_tiny_llama(tokenizer, seed=0, attention_dropout=0.1, **TINY)
    data = _pairs_file(tmp_path / "pairs.jsonl")
    batch = _batch(data, tokenizer_dir)
    model.train()
    with torch.no_grad():
        noisy = pair_logprobs(model, batch).chosen_sum
        model.eval()
        clean = pair_logprobs(model, batch).chosen_sum
    assert (noisy - clean).abs().max().item() > 1e-3  # dropout is really active in train mode

    if source == "tiny_spec":
        policy = TinyLlama(tokenizer=str(tokenizer_dir), attention_dropout=0.1, seed=0, **TINY)
        module = DPOModule(policy, precompute_reference=False, optim=Optim(lr=1e-3, warmup_steps=1))
    else:
        policy = tmp_path / "policy"
        export_pretrained(model, tokenizer, policy, stage="init")
        assert json.loads((policy / "config.json").read_text())["attention_dropout"] == 0.1
        module = DPOModule(str(policy), optim=Optim(lr=1e-3, warmup_steps=1))
    L.seed_everything(0)
    loss = _first_step_loss(module, _dm(data, val_fraction=0.0))
    assert loss == pytest.approx(math.log(2), abs=1e-6)
    assert module.reference_cache_status == (None if source == "tiny_spec" else "miss")


def test_reference_free_loss_builds_no_reference_and_no_cache(tmp_path, tiny_policy_dir, tokenizer_dir):
    """SimPO: no reference model, no cache written even with precompute_reference (the default); the
    module's loss is -log σ(β(ℓ_w/|y_w| - ℓ_l/|y_l|) - γ) from unpadded forwards and response lengths."""
    data = _pairs_file(tmp_path / "data" / "pairs.jsonl")
    batch = _batch(data, tokenizer_dir)
    module = DPOModule(str(tiny_policy_dir), loss_type="simpo", loss_args={"beta": 2.0, "gamma": 0.5})
    assert module.reference_source is None and module.reference_model is None
    with torch.no_grad():
        loss, _ = module.preference_loss(batch)
    logps = _naive_sequence_logps(load_policy(tiny_policy_dir)[0], batch)
    lengths = batch.loss_mask[:, 1:].sum(-1).double()  # response tokens + EOS of each row
    b = len(batch)
    means = logps.double() / lengths
    expected = torch.nn.functional.softplus(-(2.0 * (means[:b] - means[b:]) - 0.5)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)

    module = DPOModule(str(tiny_policy_dir), loss_type="slic", reference="none")
    _first_step_loss(module, _dm(data))
    assert module.reference_cache is None and module.reference_model is None
    assert not (tmp_path / "data" / ".alignlit_cache").exists()


def test_registered_custom_loss_keeps_the_sft_term(tiny_policy_dir, tmp_path, tokenizer_dir):
    """A loss registered from outside (the mean rejected log-prob per token, reference-free) with
    sft_weight α = 0.5: the module's loss is that loss plus α·mean(-ℓ_w/|y_w|), which the loss itself
    never sees."""
    from alignlit.losses import PREFERENCE_LOSSES, register_preference_loss

    @register_preference_loss("test_rejected_mean", needs_reference=False)
    def rejected_mean(policy, reference, *, scale: float = 1.0):
        return scale * policy.rejected_mean.mean(), {}

    try:
        batch = _batch(_pairs_file(tmp_path / "pairs.jsonl"), tokenizer_dir)
        module = DPOModule(
            str(tiny_policy_dir), loss_type="test_rejected_mean", loss_args={"scale": 2.0}, sft_weight=0.5
        )
        with torch.no_grad():
            loss, metrics = module.preference_loss(batch)
            logps = pair_logprobs(module.policy, batch)
        custom = 2.0 * logps.rejected_mean.mean().item()
        sft = (-logps.chosen_sum / logps.chosen_length).mean().item()
        assert metrics["preference_loss"].item() == pytest.approx(custom, rel=1e-6)
        assert metrics["sft_loss"].item() == pytest.approx(sft, rel=1e-6)
        assert loss.item() == pytest.approx(custom + 0.5 * sft, rel=1e-6)
        assert metrics["loss"].item() == pytest.approx(loss.item())
    finally:
        del PREFERENCE_LOSSES["test_rejected_mean"]


class MarginDPO:
    """A loss object for a YAML class_path: DPO with a target margin, -log σ(h - margin)."""

    def __init__(self, beta: float = 0.1, margin: float = 0.0):
        self.beta, self.margin = beta, margin

    def __call__(self, policy, reference):
        h = self.beta * (
            (policy.chosen_sum - reference.chosen_sum) - (policy.rejected_sum - reference.rejected_sum)
        )
        loss = torch.nn.functional.softplus(-(h - self.margin)).mean()
        return loss, {"rewards/margin": h.mean()}


def test_class_path_loss_from_the_command_line(tmp_path, tiny_policy_dir, tokenizer_dir, capsys):
    """`loss_type: {class_path, init_args}` builds the object; at h = 0 the loss is softplus(margin):
    margin 1 -> log(1 + e) = 1.3132617. `reference: none` with a loss that needs one is refused."""
    from alignlit.cli import AlignCLI

    data = _pairs_file(tmp_path / "pairs.jsonl")
    args = [
        "--config",
        "configs/quickstart/dpo.yaml",
        f"--model.init_args.policy={tiny_policy_dir}",
        f"--data.init_args.train_file={data}",
        "--model.init_args.loss_args=null",
        "--model.init_args.sft_weight=0",
        "--model.init_args.precompute_reference=false",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    loss_type = (
        "--model.init_args.loss_type={class_path: tests.modules.test_dpo.MarginDPO, init_args: {margin: 1.0}}"
    )
    cli = AlignCLI(args=[*args, loss_type], run=False)
    module = cli.model
    assert (
        isinstance(module.objective.loss.fn, MarginDPO)
        and module.objective.name == "tests.modules.test_dpo.MarginDPO"
    )
    assert module.objective.loss.fn.margin == 1.0 and module.reference_model is not None
    with torch.no_grad():
        loss, _ = module.preference_loss(_batch(data, tokenizer_dir))
    assert loss.item() == pytest.approx(1.3132617, rel=1e-5)
    with pytest.raises(SystemExit):
        AlignCLI(args=[*args, "--model.init_args.reference=none"], run=False)
    assert "preference loss 'dpo' needs a reference policy" in capsys.readouterr().err
    cli = AlignCLI(
        args=[*args, "--model.init_args.loss_type=simpo", "--model.init_args.reference=none"], run=False
    )
    assert cli.model.reference_source is None


def test_cache_dir_is_configurable_and_foreign_files_are_kept(tmp_path, tiny_policy_dir, tokenizer_dir):
    """With reference_cache_dir the cache goes there. On invalidation only the stale cache this class
    wrote is removed: a file with a similar name, one with the exact name pattern but other content, and
    an unrelated file all stay."""
    data = _pairs_file(tmp_path / "data" / "pairs.jsonl")
    cache_dir = tmp_path / "caches"
    cache_dir.mkdir()
    foreign = [cache_dir / "ref_logps-pairs.jsonl-notes.pt", cache_dir / "notes.txt"]
    for path in foreign:
        path.write_text("not a cache")
    lookalike = cache_dir / f"ref_logps-pairs.jsonl-{'0' * 20}.pt"
    torch.save({"keys": ["a"], "logps": torch.zeros(1)}, lookalike)  # no alignlit marker
    foreign.append(lookalike)

    def prepare() -> DPOModule:
        module = DPOModule(str(tiny_policy_dir), reference_cache_dir=str(cache_dir))
        dm = _dm(data, tokenizer_dir)
        dm.setup()
        module.prepare_reference(dm)
        return module

    first = prepare()
    assert first.reference_cache_status == "miss" and first.reference_cache_path.parent == cache_dir
    _pairs_file(data, ROWS[:-1])  # the data changes
    second = prepare()
    assert second.reference_cache_status == "miss" and not first.reference_cache_path.exists()
    assert sorted(cache_dir.iterdir()) == sorted([*foreign, second.reference_cache_path])
    assert not (tmp_path / "data" / ".alignlit_cache").exists()
    with pytest.raises(
        ValueError, match=r"cannot read the reference log-prob cache .*notes\.txt \(.*\); delete it"
    ):
        ReferenceCache.load(cache_dir / "notes.txt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other\.pt is not an alignlit reference log-prob cache"):
        ReferenceCache.load(tmp_path / "other.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cdpo", "ipo", "simpo", "orpo"])
def test_loss_variant_configs_fit(tmp_path, tiny_policy_dir, name):
    """configs/dpo/{cdpo,ipo,simpo,orpo}.yaml on configs/quickstart/dpo.yaml run 2 steps through the command
    line on a tiny policy and export a policy; the reference-free SimPO and ORPO write no reference cache."""
    from alignlit.cli import main

    data = _pairs_file(tmp_path / "data" / "pairs.jsonl")
    out = tmp_path / name
    main(
        [
            "fit",
            "--config",
            "configs/quickstart/dpo.yaml",
            "--config",
            f"configs/dpo/{name}.yaml",
            f"--model.init_args.policy={tiny_policy_dir}",
            f"--model.init_args.export_dir={out}",
            f"--data.init_args.train_file={data}",
            "--data.init_args.val_fraction=0.25",
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=2",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    meta = read_metadata(out)
    assert meta["stage"] == "dpo" and meta["config"]["model"]["init_args"]["loss_type"] == name.removeprefix(
        "c"
    )
    assert math.isfinite(meta["metrics"]["val/loss"])
    assert (tmp_path / "data" / ".alignlit_cache").exists() == (name not in ("simpo", "orpo"))


class _Killed(Exception):
    pass


class _Record(L.Callback):
    def __init__(self, crash_at=None):
        self.losses, self.crash_at = [], crash_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append((trainer.global_step, outputs["loss"].item()))
        if self.crash_at is not None and trainer.global_step == self.crash_at:
            raise _Killed  # the process dies here, mid-epoch


def test_dpo_resume_is_exact(tmp_path, tiny_policy_dir):
    """DPO + SFT term with the cached reference, 4 batches an epoch: killed after the step-2 checkpoint and
    resumed from it, the loss curve from step 3 on (across the epoch boundary) and the final weights are
    bit-identical to an uninterrupted run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = _pairs_file(tmp_path / "data" / "pairs.jsonl")

    def run(ckpt_dir, record, ckpt_path=None) -> DPOModule:
        L.seed_everything(0)
        module = DPOModule(
            str(tiny_policy_dir), beta=0.5, sft_weight=0.5, optim=Optim(lr=1e-3, warmup_steps=2)
        )
        trainer = L.Trainer(
            max_steps=6,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            gradient_clip_val=1.0,
            limit_val_batches=0,
            callbacks=[record, ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)],
        )
        trainer.fit(module, _dm(data, val_fraction=0.0, batch_size=2), ckpt_path=ckpt_path)
        return module

    full = _Record()
    straight = run(tmp_path / "a", full)
    with pytest.raises(_Killed):
        run(tmp_path / "b", _Record(crash_at=3))
    resumed_record = _Record()
    resumed = run(tmp_path / "b", resumed_record, ckpt_path=str(tmp_path / "b" / "epoch=0-step=2.ckpt"))
    assert resumed.reference_cache_status == "hit"
    assert [step for step, _ in full.losses] == [1, 2, 3, 4, 5, 6]
    assert resumed_record.losses == full.losses[2:]
    for p, q in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(p, q)
