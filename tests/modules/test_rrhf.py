"""RRHFModule and RankingDataModule: the module's loss against a per-sequence naive reference for
several batch sizes and k, the batch layout, record errors, and a config fit."""

from __future__ import annotations

import json

import pytest
import torch

from alignlit.data import DataError, RankingDataModule
from alignlit.data.ranking import collate_ranking
from alignlit.models import load_policy, read_metadata
from alignlit.modules import Optim, RRHFModule

PROMPTS = ["sort c a d", "reverse a b", "copy h g f", "dedupe a a b"]
RESPONSES = [" a c d", " d a c ok done", " a", " sure a c d ok", " c d a c d a"]


def _ranked_file(path, num_prompts, k):
    """``num_prompts`` records of ``k`` responses of different lengths; scores ``((7b + 3i) % 5) // 2`` tie
    on purpose (b=0, k=3: 0, 1, 0; b=1: 1, 0, 1, a tie for the best)."""
    rows = []
    for b in range(num_prompts):
        responses = [RESPONSES[(b + i) % len(RESPONSES)] for i in range(k)]
        row_scores = [float(((b * 7 + i * 3) % 5) // 2) for i in range(k)]
        rows.append(
            {"prompt": f"\n\nHuman: {PROMPTS[b]}\n\nAssistant:", "responses": responses, "scores": row_scores}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dm(path, tokenizer_dir, **kwargs):
    args = dict(tokenizer=str(tokenizer_dir), val_fraction=0.0, max_length=32, max_prompt_length=16, seed=0)
    args.update(kwargs)
    dm = RankingDataModule(str(path), **args)
    dm.setup()
    return dm


def _naive_rrhf(model, batch, rank_weight, sft_weight) -> float:
    """Loops over prompts, responses and pairs, each response run alone without padding:
    p_i = mean over response tokens of log π; rank = Σ_{r_i<r_j} max(0, p_i - p_j);
    sft = -Σ_t log π of the first best response; both averaged over prompts."""
    num_prompts, k = batch.rewards.shape
    total = 0.0
    for b in range(num_prompts):
        sums, means = [], []
        for i in range(k):
            row = b * k + i
            attn = batch.attention_mask[row]
            ids, loss_mask = batch.input_ids[row][attn], batch.loss_mask[row][attn]
            with torch.no_grad():
                logits = model(input_ids=ids[None]).logits[0]
            logps = torch.log_softmax(logits[:-1].double(), -1).gather(-1, ids[1:, None]).squeeze(-1)
            response = logps[loss_mask[1:]]
            sums.append(response.sum().item())
            means.append(response.mean().item())
        rewards = batch.rewards[b].tolist()
        rank = sum(
            max(0.0, means[i] - means[j]) for i in range(k) for j in range(k) if rewards[i] < rewards[j]
        )
        best = max(range(k), key=lambda i: (rewards[i], -i))
        total += rank_weight * rank + sft_weight * -sums[best]
    return total / num_prompts


@pytest.mark.parametrize("num_prompts", [1, 3])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_module_loss_equals_naive_reference(tmp_path, tiny_policy_dir, tokenizer_dir, num_prompts, k):
    """One padded (B·k, T) forward + rrhf_loss equals the per-sequence unpadded computation."""
    dm = _dm(_ranked_file(tmp_path / "ranked.jsonl", num_prompts, k), tokenizer_dir, batch_size=num_prompts)
    batch = next(iter(dm.train_dataloader()))
    assert batch.input_ids.shape[0] == num_prompts * k and batch.rewards.shape == (num_prompts, k)
    module = RRHFModule(str(tiny_policy_dir), rank_weight=2.0, sft_weight=0.5)
    with torch.no_grad():
        loss, metrics = module.rrhf(batch)
    expected = _naive_rrhf(module.policy, batch, rank_weight=2.0, sft_weight=0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["loss"].item() == pytest.approx(expected, rel=1e-5)


def test_batch_of_three_is_the_mean_of_three_batches_of_one(tmp_path, tiny_policy_dir, tokenizer_dir):
    """Padding to the longest of 3·k sequences changes nothing: loss(B=3) = mean of loss(B=1) per prompt."""
    path = _ranked_file(tmp_path / "ranked.jsonl", 3, 4)
    module = RRHFModule(str(tiny_policy_dir))
    with torch.no_grad():
        joint = module.rrhf(next(iter(_dm(path, tokenizer_dir, batch_size=3).train_dataloader())))[0]
        alone = [module.rrhf(batch)[0] for batch in _dm(path, tokenizer_dir, batch_size=1).train_dataloader()]
    assert len(alone) == 3
    assert joint.item() == pytest.approx(torch.stack(alone).mean().item(), rel=1e-5)


def test_ranking_batch_layout(tmp_path, tokenizer_dir, tokenizer):
    """Row b·k + i is prompt b followed by response i and EOS; the loss mask covers response + EOS only."""
    path = _ranked_file(tmp_path / "ranked.jsonl", 2, 3)
    dm = _dm(path, tokenizer_dir, batch_size=2)
    batch = collate_ranking(dm.train_set, tokenizer.pad_token_id)  # records in file order
    for b in range(2):
        for i in range(3):
            row = b * 3 + i
            ids = batch.input_ids[row][batch.attention_mask[row]].tolist()
            response = batch.input_ids[row][batch.loss_mask[row]].tolist()
            assert tokenizer.decode(ids[: len(ids) - len(response)]) == batch.prompts[b]
            assert response == [
                *tokenizer(batch.responses[b][i], add_special_tokens=False).input_ids,
                tokenizer.eos_token_id,
            ]
    assert batch.rewards.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]]


def test_ranking_record_errors_and_short_records(tmp_path, tokenizer_dir):
    """k defaults to the most responses any record has: a record with fewer is dropped and counted; with
    num_responses=2 a record of 3 is an error naming its row; k < 2 and bad scores are errors too."""
    path = tmp_path / "ranked.jsonl"
    rows = [
        {"prompt": "\n\nHuman: copy a\n\nAssistant:", "responses": [" a", " b"], "scores": [1.0, 0.0]},
        {"prompt": "\n\nHuman: copy b\n\nAssistant:", "responses": [" a", " b", " c"], "scores": [1, 0, 2]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = _dm(path, tokenizer_dir)
    assert dm.k == 3 and len(dm.train_set) == 1 and dm.counts["dropped_fewer_than_k_responses"] == 1
    with pytest.raises(
        DataError, match=r"ranked\.jsonl:2, field 'responses': has 3 responses, more than num_"
    ):
        _dm(path, tokenizer_dir, num_responses=2)
    path.write_text(json.dumps({**rows[0], "responses": [" a"], "scores": [1.0]}) + "\n")
    with pytest.raises(DataError, match=r"RRHF needs at least 2 responses per prompt, got num_responses=1"):
        _dm(path, tokenizer_dir)
    path.write_text(json.dumps({**rows[0], "scores": [1.0, "x"]}) + "\n")
    with pytest.raises(DataError, match=r"ranked\.jsonl:1, field 'scores': item 1 is 'x'"):
        _dm(path, tokenizer_dir)


def test_blank_response_drops_the_record_and_is_counted(tmp_path, tokenizer_dir):
    path = tmp_path / "ranked.jsonl"
    rows = [
        {"prompt": "\n\nHuman: copy a\n\nAssistant:", "responses": [" a", " b"], "scores": [1.0, 0.0]},
        {"prompt": "\n\nHuman: copy b\n\nAssistant:", "responses": [" b", "  "], "scores": [1.0, 0.0]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = _dm(path, tokenizer_dir)
    assert len(dm.train_set) == 1 and dm.counts["dropped_blank_response"] == 1


def test_rrhf_config_fits(tmp_path, tiny_policy_dir):
    """configs/quickstart/rrhf.yaml runs end to end (2 steps) on a tiny policy and exports an RRHF policy."""
    from alignlit.cli import main

    data = _ranked_file(tmp_path / "ranked.jsonl", 4, 4)
    out = tmp_path / "rrhf"
    main(
        [
            "fit",
            "--config",
            "configs/quickstart/rrhf.yaml",
            f"--model.init_args.policy={tiny_policy_dir}",
            f"--model.init_args.export_dir={out}",
            f"--data.init_args.train_file={data}",
            "--data.init_args.val_fraction=0.25",
            "--data.init_args.batch_size=2",
            "--trainer.max_steps=2",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    meta = read_metadata(out)
    assert meta["stage"] == "rrhf" and meta["data"]["train_file"] == str(data)
    assert load_policy(out)[0].num_parameters() == load_policy(tiny_policy_dir)[0].num_parameters()


def test_rrhf_learns_the_ranking(tmp_path, tiny_policy_dir, tokenizer_dir):
    """40 steps on 4 prompts x 3 responses: the length-normalised log-probs end up ordered as the
    rewards for every pair with r_i < r_j (ranking accuracy 1)."""
    import lightning as L

    path = _ranked_file(tmp_path / "ranked.jsonl", 4, 3)
    L.seed_everything(0)
    module = RRHFModule(str(tiny_policy_dir), optim=Optim(lr=3e-3, warmup_steps=1))
    trainer = L.Trainer(
        max_steps=40,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    dm = _dm(path, tokenizer_dir, batch_size=2)
    before = module.rrhf(collate_ranking(dm.train_set, 0))[1]["ranking_accuracy"].item()
    trainer.fit(module, dm)
    with torch.no_grad():
        _, metrics = module.rrhf(collate_ranking(dm.train_set, module.tokenizer.pad_token_id))
    assert before < 1.0
    assert metrics["ranking_accuracy"].item() == 1.0
