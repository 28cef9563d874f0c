"""Pairwise preference model: A/B format, both-order probability, metrics, export and the loading API."""

import json
import math

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from alignlit.data.preference import PreferenceDataModule
from alignlit.models import ABFormat, load_preference_model
from alignlit.modules import PairwisePrefModule

H, A = "\n\nHuman:", "\n\nAssistant:"
FMT = ABFormat(max_length=128, max_prompt_length=24)
ROWS = [
    {"prompt": f"{H} copy a b{A}", "chosen": " a b", "rejected": " b a ok done"},
    {"prompt": f"{H} sort c a b d{A}", "chosen": " a b c d", "rejected": " d"},
    {"prompt": f"{H} reverse e f g{A}", "chosen": " g f e", "rejected": " e f g g g g"},
    {"prompt": f"{H} dedupe a a h{A}", "chosen": " a h", "rejected": " a a h ok"},
    {"prompt": f"{H} copy h{A}", "chosen": " h", "rejected": " hh"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_policy_dir):
    module = PairwisePrefModule(str(tiny_policy_dir), ab_format=FMT)
    out = tmp_path_factory.mktemp("pp") / "pp"
    module.export(out)
    return module, out


def p_a(lm, tok, prompt, y1, y2):
    """Independent reference: P(A) = softmax(logit_A, logit_B)[A] after the unpadded prompt
    ``[CONTEXT] x [RESPONSE A] y1 [RESPONSE B] y2 [PREFERRED] ``, each piece tokenised alone."""

    def enc(text):
        return tok(text, add_special_tokens=False).input_ids

    ids = enc("[CONTEXT] ") + enc(prompt) + enc(" [RESPONSE A] ") + enc(y1) + enc(" [RESPONSE B] ") + enc(y2)
    ids += enc(" [PREFERRED] ")
    with torch.no_grad():
        last = lm(input_ids=torch.tensor([ids])).logits[0, -1].double()
    la, lb = last[enc("A")[0]], last[enc("B")[0]]
    return float(torch.exp(la) / (torch.exp(la) + torch.exp(lb)))


def reference(lm, tok):
    fwd = [p_a(lm, tok, r["prompt"], r["chosen"], r["rejected"]) for r in ROWS]
    swp = [p_a(lm, tok, r["prompt"], r["rejected"], r["chosen"]) for r in ROWS]
    avg = [0.5 * (f + 1 - s) for f, s in zip(fwd, swp)]
    consistent = [(f > 0.5) == (s < 0.5) for f, s in zip(fwd, swp)]
    return fwd, swp, avg, consistent


def test_both_order_probability_matches_independent_computation(exported):
    module, out = exported
    lm = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    _, _, avg, consistent = reference(lm, module.tokenizer)
    pm = load_preference_model(out, batch_size=2)  # batches mix lengths: left padding must not matter
    prob, cons = pm.prob_both_orders(
        [r["prompt"] for r in ROWS], [r["chosen"] for r in ROWS], [r["rejected"] for r in ROWS]
    )
    torch.testing.assert_close(prob.double(), torch.tensor(avg, dtype=torch.float64), atol=1e-6, rtol=0)
    assert cons.tolist() == consistent
    # swapping the arguments gives 1 - P exactly (the average is symmetric by construction)
    back = pm.prob([r["prompt"] for r in ROWS], [r["rejected"] for r in ROWS], [r["chosen"] for r in ROWS])
    torch.testing.assert_close(back.double(), 1 - torch.tensor(avg, dtype=torch.float64), atol=1e-6, rtol=0)


def test_validation_metrics(exported, tmp_path):
    """val/accuracy = mean(avg > ½); val/position_consistency; val/prob_chosen = mean(avg); val/loss =
    mean over both orders of -log P(correct answer) = mean(-log fwd, -log (1 - swp))."""
    module, out = exported
    lm = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    fwd, swp, avg, consistent = reference(lm, module.tokenizer)
    path = write_jsonl(tmp_path / "v.jsonl", ROWS)
    dm = PreferenceDataModule(path, val_file=path, max_length=48, max_prompt_length=24, batch_size=2)
    tr = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    got = tr.validate(module, dm, verbose=False)[0]
    assert got["val/accuracy"] == pytest.approx(sum(a > 0.5 for a in avg) / 5, abs=1e-7)
    assert got["val/position_consistency"] == pytest.approx(sum(consistent) / 5, abs=1e-7)
    assert got["val/prob_chosen"] == pytest.approx(sum(avg) / 5, abs=1e-6)
    loss = sum(-math.log(f) - math.log(1 - s) for f, s in zip(fwd, swp)) / 10
    assert got["val/loss"] == pytest.approx(loss, abs=1e-5)


def test_vocab_loss_is_full_softmax_cross_entropy(exported):
    """Row i: -log softmax(all logits)[A or B]; mean over rows."""
    module, out = exported
    lm = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = module.tokenizer
    chosen_is_a = torch.tensor([True, False, True, False, False])
    first = [r["chosen"] if a else r["rejected"] for r, a in zip(ROWS, chosen_is_a)]
    second = [r["rejected"] if a else r["chosen"] for r, a in zip(ROWS, chosen_is_a)]
    expected = 0.0
    for r, y1, y2, a in zip(ROWS, first, second, chosen_is_a):
        ids = FMT.encode(tok, r["prompt"], y1, y2)
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
        expected -= float(logp[module.answer_ids[0] if a else module.answer_ids[1]]) / 5
    with torch.no_grad():
        loss, metrics = module.vocab_loss([r["prompt"] for r in ROWS], first, second, chosen_is_a)
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    assert set(metrics) == {"ab_loss", "accuracy", "prob_a"}


def test_training_order_is_random_and_seeded(tiny_policy_dir):
    module = PairwisePrefModule(str(tiny_policy_dir), ab_format=FMT, seed=3)
    draw = module.order_draw(64)
    assert torch.equal(draw, module.order_draw(64))  # same (seed, step): same orders (exact resume)
    assert 16 < int(draw.sum()) < 48  # both orders occur
    fixed = PairwisePrefModule(str(tiny_policy_dir), ab_format=FMT, randomize_order=False)
    assert fixed.order_draw(8).all()


def test_format_checks_and_export(exported, tiny_policy_dir, tokenizer):
    _, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["alignlit_ab_format"] == FMT.to_dict()
    with pytest.raises(ValueError, match="not a pairwise preference model"):
        load_preference_model(tiny_policy_dir)
    n = len(tokenizer("copy a", add_special_tokens=False).input_ids)
    with pytest.raises(ValueError, match=f"token_a='copy a' is {n} tokens for this tokenizer; it must be 1"):
        ABFormat(token_a="copy a").token_ids(tokenizer)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        PairwisePrefModule(str(tiny_policy_dir), ab_format=ABFormat(max_length=100_000))
    with pytest.raises(ValueError, match="leaves no room for the responses"):
        ABFormat(max_length=60, max_prompt_length=16).encode(tokenizer, "x " * 40, "a", "b")
    ids = FMT.encode(tokenizer, "x " * 100, "a " * 100, "b " * 100)
    assert len(ids) <= FMT.max_length - 1  # room left for the answer token


def test_quickstart_pairpref_config_small_run(tmp_path, tiny_policy_dir):
    """configs/quickstart/pairpref.yaml through `alignlit fit`, on a tiny policy and a few pairs."""
    from pathlib import Path

    from alignlit.cli import main

    config = Path(__file__).resolve().parents[2] / "configs/quickstart/pairpref.yaml"
    path = write_jsonl(tmp_path / "p.jsonl", ROWS * 2)
    main(
        ["fit", "--config", str(config),
         "--model.init_args.policy", str(tiny_policy_dir), "--model.init_args.export_dir", str(tmp_path / "pp"),
         "--data.init_args.train_file", path, "--data.init_args.val_file", path,
         "--data.init_args.batch_size", "4", "--data.init_args.length_balance", "false",
         "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), "--trainer.enable_progress_bar", "false"]
    )  # fmt: skip
    pm = load_preference_model(tmp_path / "pp")
    assert pm.format.max_length == 128 and pm.format.max_prompt_length == 32
    p = pm.prob([ROWS[0]["prompt"]], [ROWS[0]["chosen"]], [ROWS[0]["rejected"]])
    assert p.shape == (1,) and 0.0 < float(p) < 1.0
