"""OnlineRRHFModule: the KL-penalised reward by hand and against naive forwards, the RRHF loss against
alignlit.losses.rrhf_loss (equal and unequal numbers of responses), the resample cadence, responses from
other sources, exact resume, the config through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignlit.data.encoding import Truncation
from alignlit.data.ranking import RankingExample, collate_ranking
from alignlit.losses import rrhf_loss
from alignlit.models import export_pretrained, make_tiny_llama
from alignlit.models.forward import token_logprobs
from alignlit.modules import KLPenalty, Minibatches, OnlineRRHFModule, Optim
from alignlit.modules.online_rrhf import read_extra_responses
from alignlit.rollout import RolloutLoop, SamplingParams
from tests.conftest import TINY
from tests.modules.test_online_dpo import PROMPTS, TIMING, char_reward, fit, scripted, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("online_rrhf_data")
    write_jsonl(d / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    write_jsonl(d / "three_prompts.jsonl", [{"prompt": p} for p in PROMPTS[:3]])
    extras = [
        {"prompt": PROMPTS[0], "responses": [" a b", " c"], "scores": [1.0, 0.0]},
        {"prompt": PROMPTS[0], "chosen": " c", "rejected": " h h"},
        {"prompt": PROMPTS[1], "response": " a"},
    ]
    write_jsonl(d / "extras.jsonl", extras)
    return d


def make_module(policy_dir, **kwargs):
    kwargs.setdefault("reward", char_reward)
    kwargs.setdefault(
        "rollout",
        RolloutLoop(sampling=SamplingParams(max_new_tokens=4), samples_per_prompt=3),
    )
    kwargs.setdefault("minibatches", Minibatches(size=2, steps=8))
    kwargs.setdefault("optim", Optim(lr=1e-3, min_lr_ratio=1.0))
    return OnlineRRHFModule(policy=str(policy_dir), train_max_length=40, train_max_prompt_length=24, **kwargs)


def sample_script(t, prompt, j):
    """Prompt 0 rewards 1, 2, 3; other prompts 0, 0, 0 (texts ' a', ' b', ' c')."""
    return f" {'abc'[j]}", 1, float(j + 1) if prompt == PROMPTS[0] else 0.0


# ---------------------------------------------------------------------- the KL-penalised reward
def test_kl_penalised_rewards_by_hand(tiny_policy_dir, data_dir):
    """β = 0.1. Samples of prompt 0: r = [1, 2, 3], KL = [0.5, 1, 2] -> [0.95, 1.9, 2.8]; prompt 1:
    r = [0, 0, 0], KL = [4, 0, -1] -> [-0.4, 0, 0.1]. Prompt 0's extra responses ' a b', ' c', ' h h'
    (the pair record's ' c' repeats and is kept once; prompt 1's ' a' too) get r = count('a') - 0.1·len
    and their teacher-forced KL [3, 1, 0.5, 2] (prompt 0's three, then prompt 1's):
    ' a b' 1 - 0.4 - 0.3 = 0.3, ' c' -0.2 - 0.1 = -0.3, ' h h' -0.4 - 0.05 = -0.45, ' a' 0.8 - 0.2 = 0.6."""
    module = make_module(
        tiny_policy_dir, kl=KLPenalty(coef=0.1), extra_responses=str(data_dir / "extras.jsonl")
    )
    module.rollout.setup(module.policy, module.tokenizer)
    scripted(module, sample_script)
    exp = module.rollout.collect(PROMPTS[:2], char_reward)
    trajectory, built = module.make_trajectory(exp)
    trajectory.kl = torch.zeros_like(trajectory.old_logprobs)
    trajectory.kl[:, 0] = torch.tensor([0.5, 1.0, 2.0, 4.0, 0.0, -1.0])  # Σ_t kl_t of each sample
    module.extra_kl = lambda encoded: torch.tensor([3.0, 1.0, 0.5, 2.0])[: len(encoded)]
    sets, scores, metrics = module.response_sets(trajectory)
    assert [len(s) for s in sets] == [6, 4]
    torch.testing.assert_close(scores[0], torch.tensor([0.95, 1.9, 2.8, 0.3, -0.3, -0.45]))
    torch.testing.assert_close(scores[1], torch.tensor([-0.4, 0.0, 0.1, 0.6]))
    assert metrics["set/extra_responses"] == 4.0 and built["kl/coef"] == 0.1


def test_sequence_kl_matches_naive_forwards(tiny_policy_dir, reference_dir):
    """Σ_t (log π - log π_0) over each sample's own tokens (k1), and over each extra response's
    re-tokenised tokens, equal per-sequence unpadded forwards of both models."""
    module = make_module(
        tiny_policy_dir, reference=str(reference_dir), kl=KLPenalty(coef=0.1, estimator="k1")
    )
    module.rollout.setup(module.policy, module.tokenizer)
    exp = module.rollout.collect(PROMPTS[:2], char_reward)
    trajectory, metrics = module.make_trajectory(exp)
    kl = trajectory.kl.sum(-1)
    r = exp.rollout

    def logp(model, ids, start):
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].log_softmax(-1)
        return logits[start - 1 : -1].gather(-1, ids[start:, None]).sum().item()

    naive = []
    for j in range(len(r)):
        prompt, response = r.prompt_ids[j][r.prompt_mask[j]], r.response_ids[j][r.response_mask[j]]
        ids = torch.cat([prompt, response])
        naive.append(logp(module.policy, ids, len(prompt)) - logp(module.reference, ids, len(prompt)))
    torch.testing.assert_close(kl, torch.tensor(naive), atol=1e-4, rtol=0)
    assert metrics["kl/ref"] == pytest.approx(sum(naive) / len(naive), abs=1e-4)
    assert abs(sum(naive)) > 0.1  # a real KL term

    encoded = [module.encode(PROMPTS[0], " a b", "x"), module.encode(PROMPTS[1], " c c c", "y")]
    expected = [
        logp(module.policy, torch.tensor(e.input_ids), e.prompt_length)
        - logp(module.reference, torch.tensor(e.input_ids), e.prompt_length)
        for e in encoded
    ]
    torch.testing.assert_close(module.extra_kl(encoded), torch.tensor(expected), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- the loss
def test_loss_matches_rrhf_loss(tiny_policy_dir, tokenizer):
    """Two prompts with 3 responses each: the module's loss is rrhf_loss on the collate_ranking batch.
    With 3 and 2 responses, it is the mean over prompts of rrhf_loss on each prompt alone."""
    module = make_module(tiny_policy_dir, rank_weight=0.7, sft_weight=0.3)
    truncation = Truncation(tokenizer, max_length=40, max_prompt_length=24)
    texts = [[" a b", " c", " d d d"], [" h", " a b c", " g"]]
    rewards = [[0.5, 1.0, -1.0], [2.0, 0.0, 1.0]]
    encoded = [[truncation.encode(PROMPTS[i], t, "t") for t in texts[i]] for i in range(2)]
    loss, metrics = module.rrhf(encoded, [torch.tensor(r) for r in rewards])

    def reference(ids):
        batch = collate_ranking(
            [RankingExample(encoded[i], rewards[i], PROMPTS[i], texts[i]) for i in ids],
            tokenizer.pad_token_id,
        )
        scored = token_logprobs(module.policy, batch.input_ids, batch.attention_mask, batch.loss_mask)
        width = scored.logprobs.shape[-1]
        return rrhf_loss(
            scored.logprobs.view(len(ids), batch.k, width),
            scored.mask.view(len(ids), batch.k, width),
            batch.rewards,
            rank_weight=0.7,
            sft_weight=0.3,
        )

    expected, expected_metrics = reference([0, 1])
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(metrics["ranking_accuracy"], expected_metrics["ranking_accuracy"])

    encoded[1], rewards[1], texts[1] = encoded[1][:2], rewards[1][:2], texts[1][:2]
    loss, _ = module.rrhf(encoded, [torch.tensor(r) for r in rewards])
    torch.testing.assert_close(loss, (reference([0])[0] + reference([1])[0]) / 2, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- resampling and other sources
def test_resample_every_updates_on_one_set(tiny_policy_dir, data_dir, tmp_path):
    """minibatches.steps = 3 on 3 prompts in minibatches of 2: each resample takes 3 optimizer steps on
    its own set, shuffled passes of 2 + 1 prompts then 2 of the next pass; 2 resamples = 6 steps."""
    module = make_module(tiny_policy_dir, minibatches=Minibatches(size=2, steps=3))
    scripted(module, sample_script)
    updates = []
    rrhf = module.rrhf

    def record(sets, scores):
        updates.append((module.rollout.rollouts, [len(s) for s in sets]))
        return rrhf(sets, scores)

    module.rrhf = record
    trainer = fit(module, data_dir / "three_prompts.jsonl", tmp_path, batches=1, epochs=2, batch_size=3)
    assert trainer.global_step == 6 and module.rollout.rollouts == 2
    assert [(t, len(sizes)) for t, sizes in updates] == [(1, 2), (1, 1), (1, 2), (2, 2), (2, 1), (2, 2)]
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert len(train) == 2 and all("rrhf/loss" in h and "kl/ref" in h for h in train)
    assert "length/corr_excluded" in train[0]


def test_extra_responses_file(data_dir, tmp_path):
    extras = read_extra_responses(str(data_dir / "extras.jsonl"))
    assert extras == {PROMPTS[0]: [" a b", " c", " h h"], PROMPTS[1]: [" a"]}
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"prompt": "x", "responses": [" a"]}, {"prompt": "y", "score": 1}]
    )
    with pytest.raises(Exception, match=r"bad.jsonl:2.*expected 'responses'"):
        read_extra_responses(str(bad))
    bad = write_jsonl(tmp_path / "bad2.jsonl", [{"prompt": "x", "responses": [" a", ""]}])
    with pytest.raises(Exception, match=r"bad2.jsonl:1.*responses"):
        read_extra_responses(str(bad))


def test_bad_arguments_name_the_field(tiny_policy_dir, data_dir):
    with pytest.raises(ValueError, match=r"minibatches.steps must be >= 1"):
        Minibatches(steps=0)
    with pytest.raises(ValueError, match=r"samples_per_prompt 1 and no extra_responses"):
        make_module(tiny_policy_dir, rollout=RolloutLoop(samples_per_prompt=1))
    make_module(  # with responses from other sources, one sample per prompt is still a ranking
        tiny_policy_dir,
        rollout=RolloutLoop(samples_per_prompt=1),
        extra_responses=str(data_dir / "extras.jsonl"),
    )
    with pytest.raises(ValueError, match="tis_cap"):
        make_module(tiny_policy_dir, tis_cap=2.0)

    class RolloutOnly:
        def score_rollout(self, rollout):
            return torch.zeros(len(rollout))

    with pytest.raises(ValueError, match="scores texts"):
        make_module(tiny_policy_dir, reward=RolloutOnly(), extra_responses=str(data_dir / "extras.jsonl"))


# ---------------------------------------------------------------------- exact resume
@pytest.mark.slow
def test_exact_resume(tmp_path, tiny_policy_dir, reference_dir, data_dir):
    """4 resamples straight vs resumed from the checkpoint written after resample 3 (mid-epoch: 6 training
    prompts in batches of 2): same weights, adaptive β and history (timings aside)."""

    def build():
        return make_module(
            tiny_policy_dir,
            reference=str(reference_dir),
            kl=KLPenalty(coef=0.1, target=1.0, horizon=20),
            extra_responses=str(data_dir / "extras.jsonl"),
            minibatches=Minibatches(size=2, steps=2),
            gold=char_reward,
        )

    straight = build()
    fit(
        straight,
        data_dir / "prompts.jsonl",
        tmp_path / "a",
        batches=2,
        epochs=2,
        checkpoint=True,
        val_batches=1,
    )
    by_resample = {}
    for path in (tmp_path / "a" / "ckpt").iterdir():
        saved = torch.load(path, weights_only=True)
        by_resample[saved["online_rrhf_state"]["rollout"]["rollouts"]] = (path, saved)
    path, saved = by_resample[3]
    assert not any(k.startswith("reference.") for k in saved["state_dict"])
    resumed = build()
    fit(
        resumed, data_dir / "prompts.jsonl", tmp_path / "b", batches=2, epochs=2, ckpt_path=str(path),
        val_batches=1,
    )  # fmt: skip
    for (key, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), f"policy.{key} differs after resume"
    assert resumed.kl_ctl.value == straight.kl_ctl.value != 0.1
    strip = [{k: v for k, v in h.items() if not k.startswith(TIMING)} for h in straight.progress.history]
    assert [
        {k: v for k, v in h.items() if not k.startswith(TIMING)} for h in resumed.progress.history
    ] == strip


# ---------------------------------------------------------------------- configs
@pytest.mark.slow
def test_config_tiny_fit(tmp_path, monkeypatch, tiny_policy_dir, rm_dir, data_dir):
    """The shipped config runs two resamples on the tiny model through the CLI against a reward-model
    export, with its own logger and checkpoint callback."""
    from alignlit.cli import main

    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit", "--config", str(ROOT / "configs/quickstart/online-rrhf.yaml"),
            f"--model.init_args.policy={tiny_policy_dir}",
            f"--model.init_args.reward={rm_dir}",
            "--model.init_args.gold=null",
            "--model.init_args.rollout.sampling.max_new_tokens=6",
            "--model.init_args.minibatches.size=2",
            "--model.init_args.minibatches.steps=2",
            f"--model.init_args.extra_responses={data_dir / 'extras.jsonl'}",
            "--model.init_args.export_dir=export",
            f"--data.init_args.train_file={data_dir / 'prompts.jsonl'}",
            f"--data.init_args.val_file={data_dir / 'prompts.jsonl'}",
            "--data.init_args.batch_size=4",
            "--data.init_args.eval_batch_size=4",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.val_check_interval=2",
        ]
    )  # fmt: skip
    assert (tmp_path / "export" / "config.json").exists()
    logs = tmp_path / "out" / "quickstart" / "logs"
    history = json.loads(next(logs.rglob("online_rrhf_curves.json")).read_text())
    assert len([h for h in history if "rrhf/loss" in h]) == 2
    assert [h["rollout"] for h in history if "val/reward" in h] == [0.0, 2.0]
    last = torch.load(tmp_path / "out/quickstart/checkpoints/online-rrhf/last.ckpt", weights_only=True)
    assert last["online_rrhf_state"]["rollout"]["rollouts"] == 2 and last["global_step"] == 4


# ---------------------------------------------------------------------- vLLM
@pytest.mark.vllm
def test_online_rrhf_with_vllm_engine(tmp_path, tokenizer, data_dir):
    """Two resamples with `rollout.engine: vllm`: synced after the first resample's updates, parity holds."""
    policy_dir = tmp_path / "policy"
    export_pretrained(make_tiny_llama(tokenizer, seed=0, **TINY), tokenizer, policy_dir, stage="init")
    module = make_module(
        policy_dir,
        kl=KLPenalty(coef=0.1),
        rollout=RolloutLoop(
            engine="vllm", sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=3,
            parity_every=1, parity_tol=1e-3, vllm_args={"max_model_len": 128},
        ),
        minibatches=Minibatches(size=2, steps=8),
    )  # fmt: skip
    fit(module, data_dir / "prompts.jsonl", tmp_path, batches=2, batch_size=4)
    assert module.rollout.engine.weight_pushes == 2
    parity = [
        h["rollout/parity_max_abs_diff"]
        for h in module.progress.history
        if "rollout/parity_max_abs_diff" in h
    ]
    assert len(parity) == 2 and max(parity) < 1e-3
