"""OnlineDPOModule: pairing and length penalty by hand (tokens and characters), the per-iteration JSONL,
pair accumulation (all vs newest, hybrid offline slices), the reference switch, degenerate iterations,
exact resume, the length diagnostics, ranking with a pairwise preference model, configs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from alignlit.data import PromptDataModule, RankedGroup, parse_pairs, read_ranked, read_records
from alignlit.models import (
    ABFormat,
    export_pretrained,
    load_preference_model,
    make_tiny_llama,
)
from alignlit.models.reward_model import PreferenceModel
from alignlit.modules import KLPenalty, Minibatches, OnlineDPOModule, Optim, PairwisePrefModule, PtxMix
from alignlit.rewards import PreferenceRanking
from alignlit.rollout import Experience, Rollout, RolloutLoop, SamplingParams
from tests.conftest import TINY
from tests.helpers import OP_PROMPTS as PROMPTS
from tests.helpers import TIMING, char_reward, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("online_dpo_data")
    write_jsonl(d / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    write_jsonl(d / "two_prompts.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    write_jsonl(
        d / "sft.jsonl", [{"prompt": p, "response": " a b" if i % 2 else " c"} for i, p in enumerate(PROMPTS)]
    )
    offline = [{"prompt": PROMPTS[i], "chosen": f" {'abc'[i]} ok", "rejected": " h h"} for i in range(3)]
    write_jsonl(d / "offline.jsonl", offline)
    return d


@pytest.fixture(scope="module")
def pairpref_dir(tmp_path_factory, tiny_policy_dir):
    """An (untrained) pairwise-preference-model export."""
    out = tmp_path_factory.mktemp("online_dpo_pp") / "pp"
    PairwisePrefModule(str(tiny_policy_dir), ab_format=ABFormat(max_length=96, max_prompt_length=24)).export(
        out
    )
    return out


def make_module(policy_dir, **kwargs):
    kwargs.setdefault("reward", char_reward)
    kwargs.setdefault(
        "rollout",
        RolloutLoop(sampling=SamplingParams(max_new_tokens=4), samples_per_prompt=3),
    )
    kwargs.setdefault("minibatches", Minibatches(size=2, epochs=2))
    kwargs.setdefault("optim", Optim(lr=1e-3, min_lr_ratio=1.0))
    return OnlineDPOModule(policy=str(policy_dir), train_max_length=40, train_max_prompt_length=24, **kwargs)


def fit(
    module,
    prompts_file,
    tmp_path,
    *,
    batches,
    epochs=1,
    batch_size=2,
    ckpt_path=None,
    checkpoint=False,
    val_batches=0,
):
    """``epochs`` x ``batches`` iterations; with validation a quarter of the prompts is held out."""
    callbacks = []
    if checkpoint:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, save_last=False
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        limit_train_batches=batches,
        limit_val_batches=val_batches,
        val_check_interval=1.0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=tmp_path,
    )
    held_out = 0.25 if val_batches else 0.0
    dm = PromptDataModule(train_file=str(prompts_file), batch_size=batch_size, val_fraction=held_out)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def scripted(module, script):
    """Make each rollout's samples those of ``script(t, prompt, j) -> (text, tokens, reward)`` for sample
    ``j`` of ``prompt`` in iteration ``t`` (texts, token lengths and rewards; the ids are padding)."""
    collect = module.rollout.collect

    def fake(prompts, reward, **kwargs):
        exp = collect(prompts, reward, **kwargs)
        r, t = exp.rollout, module.rollout.rollouts
        rows = [script(t, r.prompts[i], i % r.n) for i in range(len(r))]
        width = max(tokens for _, tokens, _ in rows)
        mask = (
            torch.arange(width)[None, :] < torch.tensor([tokens for _, tokens, _ in rows])[:, None]
        )  # (N, T)
        rollout = Rollout(
            prompts=r.prompts, prompt_index=r.prompt_index, prompt_ids=r.prompt_ids, prompt_mask=r.prompt_mask,
            response_ids=torch.zeros_like(mask, dtype=torch.long), response_mask=mask,
            logprobs=torch.zeros(mask.shape), texts=[text for text, _, _ in rows],
            finish_reasons=["stop"] * len(rows), n=r.n,
        )  # fmt: skip
        return Experience(rollout, torch.tensor([reward for _, _, reward in rows]))

    module.rollout.collect = fake


# ---------------------------------------------------------------------- pure parts
# ---------------------------------------------------------------------- pairing, penalty, JSONL, skip
def hand_script(t, prompt, j):
    """Prompt 0: texts x / yyyyyyyy / zzzz with 5 / 1 / 2 tokens, 1 / 8 / 4 characters, rewards
    1.0 / 1.5 / 0.75 (exact in float32). Prompt 1: three identical responses (never a pair)."""
    if prompt == PROMPTS[0]:
        return [("x", 5, 1.0), ("yyyyyyyy", 1, 1.5), ("zzzz", 2, 0.75)][j]
    return (" a b", 2, 0.125 * j)


@pytest.mark.parametrize(
    ("unit", "penalty", "min_gap", "expected"),
    [
        ("tokens", 0.0, 0.0, ("yyyyyyyy", "zzzz", 1.5, 0.75)),  # raw: best 1.5, worst 0.75
        ("tokens", 0.125, 0.0, ("yyyyyyyy", "x", 1.375, 0.375)),  # 1.0-0.625, 1.5-0.125, 0.75-0.25
        ("characters", 0.125, 0.0, ("x", "zzzz", 0.875, 0.25)),  # 1.0-0.125, 1.5-1.0, 0.75-0.5
        ("characters", 0.125, 0.7, None),  # gap 0.625 <= 0.7: dropped, and the iteration has no pair
    ],
    ids=["raw", "tokens", "characters", "min-gap"],
)
def test_pairing_and_length_penalty_by_hand(
    tiny_policy_dir, data_dir, tmp_path, unit, penalty, min_gap, expected
):
    module = make_module(
        tiny_policy_dir,
        length_penalty=penalty,
        length_unit=unit,
        min_gap=min_gap,
        data_dir=str(tmp_path / "data"),
    )
    scripted(module, hand_script)
    trainer = fit(module, data_dir / "two_prompts.jsonl", tmp_path, batches=1)
    (metrics,) = [h for h in module.progress.history if "time/train_s" in h]
    assert metrics["pairs/identical"] == 1.0
    pairs = [
        json.loads(line) for line in (tmp_path / "data" / "iter_0001.pairs.jsonl").read_text().splitlines()
    ]
    ranked = read_ranked(tmp_path / "data" / "iter_0001.ranked.jsonl")
    first = next(g for g in ranked if g.prompt == PROMPTS[0])
    assert first.responses == ["yyyyyyyy", "x", "zzzz"] and first.scores == [1.5, 1.0, 0.75]
    assert first.lengths == [1, 5, 2]  # the file's lengths are tokens, whatever the penalty's unit
    if expected is None:
        assert pairs == [] and metrics["pairs/gap"] == 1.0 and metrics["rollout/skipped"] == 1.0
        assert module.progress.skipped_rollouts == 1 and trainer.global_step == 0
        assert module.iteration_pairs == [[]]
        return
    chosen, rejected, chosen_score, rejected_score = expected
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [(PROMPTS[0], chosen, rejected)]
    assert pairs[0]["chosen_score"] == pytest.approx(chosen_score)
    assert pairs[0]["rejected_score"] == pytest.approx(rejected_score)
    assert metrics["pairs/new"] == metrics["pairs/train"] == 1.0 and "rollout/skipped" not in metrics
    assert trainer.global_step == 2  # minibatches.epochs = 2 passes of one minibatch
    # the files are in formats alignlit reads: generic pairs and ranked groups
    (pair,), _ = parse_pairs(read_records(tmp_path / "data" / "iter_0001.pairs.jsonl")[0])
    assert (pair.chosen, pair.rejected) == (chosen, rejected)
    assert isinstance(first, RankedGroup)


def test_degenerate_iteration_is_skipped_then_training_continues(tiny_policy_dir, data_dir, tmp_path):
    """Iteration 1: every sample of a prompt is the same text (no pair); iteration 2 has pairs. The first
    is skipped and counted, no optimizer or LR-schedule step; the second trains."""

    def script(t, prompt, j):
        return (" a b", 2, 0.5) if t == 1 else (f" {'abc'[j]}", 1, float(j))

    module = make_module(tiny_policy_dir)
    scripted(module, script)
    trainer = fit(module, data_dir / "prompts.jsonl", tmp_path, batches=2)
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert train[0]["rollout/skipped"] == 1.0 and train[0]["pairs/identical"] == 2.0
    assert "dpo/loss" not in train[0] and "dpo/loss" in train[1]
    assert module.progress.skipped_rollouts == 1 and train[1]["rollout/skipped_total"] == 1.0
    assert trainer.global_step == 2  # 2 pairs, minibatches of 2, 2 passes
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 1
    assert (tmp_path / "online_dpo_data" / "iter_0001.pairs.jsonl").read_text() == ""


# ---------------------------------------------------------------------- accumulation and hybrid data
def step_script(t, prompt, j):
    """Iteration t, sample j: the text ' <t-th symbol> <j-th symbol>' with reward j (best j = n-1, worst 0)."""
    return f" {'abcdefgh'[t]} {'abcdefgh'[j]}", 2, float(j)


@pytest.mark.parametrize("pairs_from", ["all", "newest"])
def test_training_pairs_accumulate_or_not_with_offline_slices(
    tiny_policy_dir, data_dir, tmp_path, pairs_from
):
    """3 iterations of 2 prompts: 2 new pairs each. 'all' trains on 2, 4, 6 online pairs, 'newest' on
    2, 2, 2; both add offline slice t of 2 of the 3 offline pairs: positions 0-1, 2-0, 1-2 of the seeded
    permutation (seed = rollout.seed = 0)."""
    module = make_module(
        tiny_policy_dir,
        pairs_from=pairs_from,
        offline_pairs=str(data_dir / "offline.jsonl"),
        offline_pairs_per_iteration=2,
    )
    scripted(module, step_script)
    trained = []
    encode = module.encode

    def record(pairs):
        trained.append([(p.prompt, p.chosen, p.rejected) for p in pairs])
        return encode(pairs)

    module.encode = record
    fit(module, data_dir / "prompts.jsonl", tmp_path, batches=3)
    offline = [
        (r["prompt"], r["chosen"], r["rejected"])
        for r in map(json.loads, (data_dir / "offline.jsonl").open())
    ]
    order = torch.randperm(3, generator=torch.Generator().manual_seed(0)).tolist()
    new = [[(p["prompt"], p["chosen"], p["rejected"]) for p in it] for it in module.iteration_pairs]
    assert [len(it) for it in new] == [2, 2, 2]
    assert all(chosen == f" {'abcdefgh'[t + 1]} c" for t, it in enumerate(new) for _, chosen, _ in it)
    for t in range(3):
        online = [p for it in new[: t + 1] for p in it] if pairs_from == "all" else new[t]
        slice_t = [offline[order[(2 * t + i) % 3]] for i in range(2)]
        assert trained[t] == online + slice_t
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert [h["pairs/train"] for h in train] == ([4.0, 6.0, 8.0] if pairs_from == "all" else [4.0, 4.0, 4.0])
    assert all(h["pairs/offline"] == 2.0 for h in train)


# ---------------------------------------------------------------------- the reference switch
@pytest.mark.parametrize("update", ["initial", "last_iterate"])
def test_reference_stays_or_follows_the_last_iterate(tiny_policy_dir, data_dir, tmp_path, update):
    module = make_module(tiny_policy_dir, reference_update=update)
    scripted(module, step_script)
    pi0 = {k: v.clone() for k, v in module.policy.state_dict().items()}
    seen = []
    train_on = module.train_on

    def spy(experience):
        policy = {k: v.clone() for k, v in module.policy.state_dict().items()}
        metrics = train_on(experience)
        seen.append((policy, {k: v.clone() for k, v in module.reference.state_dict().items()}))
        return metrics

    module.train_on = spy
    trainer = fit(module, data_dir / "prompts.jsonl", tmp_path, batches=2)
    (_, reference_1), (start_2, reference_2) = seen
    assert all(torch.equal(reference_1[k], pi0[k]) for k in pi0)  # iteration 1: the reference is π0
    expected = start_2 if update == "last_iterate" else pi0  # iteration 2: the last iterate, or still π0
    assert all(torch.equal(reference_2[k], expected[k]) for k in pi0)
    assert not all(torch.equal(start_2[k], pi0[k]) for k in pi0)  # iteration 1 moved the policy

    trainer.save_checkpoint(tmp_path / "x.ckpt")
    saved = torch.load(tmp_path / "x.ckpt", weights_only=True)
    assert any(k.startswith("reference.") for k in saved["state_dict"]) == (update == "last_iterate")
    fresh = make_module(tiny_policy_dir, reference_update=update)
    fresh.on_load_checkpoint(saved)
    fresh.load_state_dict(saved["state_dict"])
    assert all(torch.equal(fresh.reference.state_dict()[k], reference_2[k]) for k in pi0)
    assert fresh.iteration_pairs == module.iteration_pairs


# ---------------------------------------------------------------------- exact resume
@pytest.mark.slow
def test_exact_resume(tmp_path, tiny_policy_dir, data_dir):
    """4 iterations straight vs resumed from the checkpoint written after iteration 3 (mid-epoch: 6 training
    prompts in batches of 2, so 3 iterations an epoch): same policy and reference weights, same gathered
    pairs, same history (timings aside). Real samples and a real reward; all pairs so far, the moving
    reference, hybrid offline slices, the length penalty and ptx are on."""

    def build():
        return make_module(
            tiny_policy_dir,
            pairs_from="all",
            reference_update="last_iterate",
            offline_pairs=str(data_dir / "offline.jsonl"),
            offline_pairs_per_iteration=1,
            length_penalty=0.05,
            gold=char_reward,
            ptx=PtxMix(file=str(data_dir / "sft.jsonl"), val_file=str(data_dir / "sft.jsonl"), coef=0.1,
                       batch_size=3, max_length=32, max_prompt_length=20),
        )  # fmt: skip

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
    by_iteration = {}
    for path in (tmp_path / "a" / "ckpt").iterdir():
        saved = torch.load(path, weights_only=True)
        by_iteration[saved["online_dpo_state"]["rollout"]["rollouts"]] = path
    assert sum(len(it) for it in straight.iteration_pairs) > 4
    resumed = build()
    fit(
        resumed, data_dir / "prompts.jsonl", tmp_path / "b", batches=2, epochs=2, ckpt_path=str(by_iteration[3]),
        val_batches=1,
    )  # fmt: skip
    for name in ("policy", "reference"):
        for (key, a), b in zip(
            getattr(straight, name).state_dict().items(), getattr(resumed, name).state_dict().values()
        ):
            assert torch.equal(a, b), f"{name}.{key} differs after resume"
    assert resumed.iteration_pairs == straight.iteration_pairs
    strip = [{k: v for k, v in h.items() if not k.startswith(TIMING)} for h in straight.progress.history]
    assert [
        {k: v for k, v in h.items() if not k.startswith(TIMING)} for h in resumed.progress.history
    ] == strip
    assert any("val/gold" in h for h in strip)


# ---------------------------------------------------------------------- ranking with a preference model
class LengthJudge(torch.nn.Module):
    """A stand-in preference model whose answer logits are ``logit_A = w·|y_1|`` and
    ``logit_B = w·|y_2| + b`` (token counts between the template's markers), so ``b`` is a position bias."""

    def __init__(self, tokenizer, fmt: ABFormat, w: float, b: float):
        super().__init__()
        enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        self.markers = enc(fmt.response_a), enc(fmt.response_b), enc(fmt.question)
        self.answers = fmt.token_ids(tokenizer)
        self.vocab, self.w, self.b = len(tokenizer), w, b
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @staticmethod
    def find(seq: list[int], marker: list[int]) -> int:
        return next(i for i in range(len(seq)) if seq[i : i + len(marker)] == marker)

    def forward(self, input_ids, attention_mask, position_ids=None, logits_to_keep=None):
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        for row, (ids, mask) in enumerate(zip(input_ids, attention_mask)):
            seq = ids[mask.bool()].tolist()
            a, b, q = (self.find(seq, m) for m in self.markers)
            logits[row, 0, self.answers[0]] = self.w * (b - a - len(self.markers[0]))
            logits[row, 0, self.answers[1]] = self.w * (q - b - len(self.markers[1])) + self.b
        return SimpleNamespace(logits=logits)


def test_rank_round_robin_and_reference_by_hand(tokenizer):
    """Token lengths 1, 2, 4, w = 1, position bias b = 0.5: P(A | y_i, y_j) = σ(d - b), d = |y_i| - |y_j|,
    averaged over both orders P(y_i ≻ y_j) = ½(σ(d - b) + σ(d + b)):
    P(1≻2) = ½(σ(-1.5) + σ(-0.5)) = 0.279983, P(1≻3) = ½(σ(-3.5) + σ(-2.5)) = 0.052585,
    P(2≻3) = ½(σ(-2.5) + σ(-1.5)) = 0.129142. Round robin (mean win probability):
    s1 = (0.279983 + 0.052585)/2 = 0.166284, s2 = (0.720017 + 0.129142)/2 = 0.424580,
    s3 = (0.947415 + 0.870858)/2 = 0.909137 (sum n/2 = 1.5). Against the reference ' a b' (2 tokens):
    P(y ≻ ref) = ½(σ(d - 0.5) + σ(d + 0.5)) for d = -1, 0, 2: 0.279983, 0.5, 0.870858."""
    fmt = ABFormat(max_length=96, max_prompt_length=24)
    responses = [" a", " a b", " a b c d"]
    assert [len(tokenizer(r, add_special_tokens=False).input_ids) for r in responses] == [1, 2, 4]
    judge = PreferenceModel(LengthJudge(tokenizer, fmt, w=1.0, b=0.5), tokenizer, fmt, batch_size=2)
    scores = judge.rank([PROMPTS[0], PROMPTS[1]], [responses, [" c"]])
    torch.testing.assert_close(scores[0], torch.tensor([0.166284, 0.424580, 0.909137]), atol=1e-6, rtol=0)
    torch.testing.assert_close(scores[1], torch.tensor([0.5]))  # a lone response
    against = judge.rank([PROMPTS[0]], [responses], mode="reference", reference_responses=[" a b"])
    torch.testing.assert_close(against[0], torch.tensor([0.279983, 0.5, 0.870858]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="needs reference_responses"):
        judge.rank([PROMPTS[0]], [responses], mode="reference")
    with pytest.raises(ValueError, match="rank mode must be"):
        judge.rank([PROMPTS[0]], [responses], mode="pairs")


def test_rank_matches_pairwise_probabilities_of_a_tiny_model(pairpref_dir):
    """A real (tiny) preference model: the round-robin scores equal the mean of prob() over the other
    responses, computed pair by pair in both directions."""
    pm = load_preference_model(pairpref_dir, batch_size=3)
    groups = [[" a b", " c", " d d d"], [" h", " a b c"]]
    scores = pm.rank(PROMPTS[:2], groups)
    for prompt, responses, got in zip(PROMPTS, groups, scores):
        for i, yi in enumerate(responses):
            others = [yj for j, yj in enumerate(responses) if j != i]
            expected = pm.prob([prompt] * len(others), [yi] * len(others), others).mean()
            assert got[i].item() == pytest.approx(expected.item(), abs=1e-5)
        assert got.sum().item() == pytest.approx(len(responses) / 2, abs=1e-5)


def test_preference_model_as_online_reward(tiny_policy_dir, pairpref_dir, data_dir, tmp_path):
    """PreferenceRanking scores the n samples of each prompt with rank(); online DPO then pairs the
    highest and lowest mean win probability. Reference mode reads each prompt's reference response."""
    ranking = PreferenceRanking(str(pairpref_dir))
    module = make_module(tiny_policy_dir, reward=ranking)
    module.rollout.setup(module.policy, module.tokenizer)
    assert module.reward_model is ranking.model and not any(
        p.requires_grad for p in ranking.model.parameters()
    )
    exp = module.rollout.collect(PROMPTS[:2], module.reward)
    expected = ranking.ranker.rank(PROMPTS[:2], [exp.rollout.texts[:3], exp.rollout.texts[3:]])
    torch.testing.assert_close(exp.rewards, torch.cat(expected))

    refs = PreferenceRanking(str(pairpref_dir), mode="reference", references=str(data_dir / "sft.jsonl"))
    got = refs.score_rollout(exp.rollout)
    manual = refs.ranker.prob(exp.rollout.prompts, exp.rollout.texts, [" c"] * 3 + [" a b"] * 3)
    torch.testing.assert_close(got, manual)
    missing = module.rollout.generate([PROMPTS[0], "\n\nHuman: unseen\n\nAssistant:"], n=2)
    with pytest.raises(KeyError, match="no reference response for prompt"):
        refs.score_rollout(missing)
    with pytest.raises(ValueError, match="needs `references`"):
        PreferenceRanking(str(pairpref_dir), mode="reference")


# ---------------------------------------------------------------------- arguments
def test_bad_arguments_name_the_field(tiny_policy_dir, data_dir):
    loop = RolloutLoop(samples_per_prompt=2)
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 2, got 1"):
        OnlineDPOModule(policy=str(tiny_policy_dir), reward=char_reward)
    with pytest.raises(ValueError, match="minibatches: give epochs"):
        Minibatches(epochs=2, steps=3)
    with pytest.raises(ValueError, match="KL control is its β"):
        OnlineDPOModule(policy=str(tiny_policy_dir), reward=char_reward, rollout=loop, kl=KLPenalty())
    with pytest.raises(ValueError, match="length_unit must be one of"):
        OnlineDPOModule(policy=str(tiny_policy_dir), reward=char_reward, rollout=loop, length_unit="words")
    with pytest.raises(ValueError, match="pairs_from must be one of"):
        OnlineDPOModule(policy=str(tiny_policy_dir), reward=char_reward, rollout=loop, pairs_from="last")
    with pytest.raises(ValueError, match="length_penalty and min_gap must be >= 0"):
        OnlineDPOModule(policy=str(tiny_policy_dir), reward=char_reward, rollout=loop, length_penalty=-1.0)
    with pytest.raises(ValueError, match="needs offline_pairs"):
        OnlineDPOModule(
            policy=str(tiny_policy_dir), reward=char_reward, rollout=loop, offline_pairs_per_iteration=3
        )
    with pytest.raises(ValueError, match="tis_cap"):
        OnlineDPOModule(policy=str(tiny_policy_dir), reward=char_reward, rollout=loop, tis_cap=2.0)
    with pytest.raises(ValueError, match="no argument 'gamma'"):
        OnlineDPOModule(
            policy=str(tiny_policy_dir), reward=char_reward, rollout=loop, loss_args={"gamma": 1.0}
        )
    bad = write_jsonl(Path(data_dir / "bad_offline.jsonl"), [{"prompt": "x", "chosen": " a"}])
    with pytest.raises(Exception, match=r"bad_offline.jsonl:1.*rejected"):
        OnlineDPOModule(policy=str(tiny_policy_dir), reward=char_reward, rollout=loop, offline_pairs=str(bad))


# ---------------------------------------------------------------------- configs
CONFIG = ROOT / "configs/quickstart/online-dpo.yaml"


def test_config_takes_a_preference_model_as_reward():
    """The README's override: `reward` as a PreferenceRanking class_path parses against the stage."""
    from tests.test_configs import ParseOnly

    cli = ParseOnly(
        args=[
            "--config", str(CONFIG), "--model.init_args.reward.class_path=alignlit.rewards.PreferenceRanking",
            "--model.init_args.reward.init_args.model=out/quickstart/pairpref",
            "--model.init_args.reward.init_args.mode=reference",
            "--model.init_args.reward.init_args.references=data/sim/sft_val.jsonl",
        ],
        run=False,
    )  # fmt: skip
    reward = cli.config.model.init_args.reward
    assert reward.class_path == "alignlit.rewards.PreferenceRanking" and reward.init_args.mode == "reference"


@pytest.mark.slow
def test_config_tiny_fit(tmp_path, monkeypatch, tiny_policy_dir, rm_dir, data_dir):
    """The shipped config runs two iterations on the tiny model through the CLI against a reward-model
    export, with its own logger and checkpoint callback: per-iteration JSONL, curves and the export."""
    from alignlit.cli import main

    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit", "--config", str(CONFIG),
            f"--model.init_args.policy={tiny_policy_dir}",
            f"--model.init_args.reward={rm_dir}",
            "--model.init_args.gold=null",
            "--model.init_args.rollout.sampling.max_new_tokens=6",
            "--model.init_args.length_penalty=0.01",
            "--model.init_args.export_dir=export",
            f"--data.init_args.train_file={data_dir / 'prompts.jsonl'}",
            f"--data.init_args.val_file={data_dir / 'prompts.jsonl'}",
            "--data.init_args.batch_size=4",
            "--data.init_args.eval_batch_size=4",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
        ]
    )  # fmt: skip
    assert (tmp_path / "export" / "config.json").exists()
    logs = tmp_path / "out" / "quickstart" / "logs"
    history = json.loads(next(logs.rglob("online_dpo_curves.json")).read_text())
    assert len([h for h in history if "pairs/new" in h]) == 2
    assert [h["rollout"] for h in history if "val/reward" in h] == [0.0, 1.0, 2.0]
    assert next(logs.rglob("online_dpo_curves.png")).stat().st_size > 0
    data = next(logs.rglob("online_dpo_data"))
    assert sorted(p.name for p in data.iterdir()) == [
        "iter_0001.pairs.jsonl", "iter_0001.ranked.jsonl", "iter_0002.pairs.jsonl", "iter_0002.ranked.jsonl",
    ]  # fmt: skip
    assert len(read_ranked(data / "iter_0002.ranked.jsonl")) == 4
    last = torch.load(tmp_path / "out/quickstart/checkpoints/online-dpo/last.ckpt", weights_only=True)
    assert last["online_dpo_state"]["rollout"]["rollouts"] == 2
    assert len(last["online_dpo_state"]["stage"]["iteration_pairs"]) == 2


# ---------------------------------------------------------------------- vLLM
@pytest.mark.vllm
def test_online_dpo_with_vllm_engine(tmp_path, tokenizer, data_dir):
    """Two iterations with `rollout.engine: vllm`: the engine is synced after the first iteration's updates
    and the parity check (every sync) passes, so the second iteration samples the updated policy."""
    policy_dir = tmp_path / "policy"
    export_pretrained(make_tiny_llama(tokenizer, seed=0, **TINY), tokenizer, policy_dir, stage="init")
    module = make_module(
        policy_dir,
        rollout=RolloutLoop(
            engine="vllm", sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=4,
            parity_every=1, parity_tol=1e-3, vllm_args={"max_model_len": 128},
        ),
        minibatches=Minibatches(size=4, epochs=2),
    )  # fmt: skip
    fit(module, data_dir / "prompts.jsonl", tmp_path, batches=2, batch_size=4)
    assert module.rollout.engine.weight_pushes == 2
    parity = [
        h["rollout/parity_max_abs_diff"]
        for h in module.progress.history
        if "rollout/parity_max_abs_diff" in h
    ]
    assert len(parity) == 2 and max(parity) < 1e-3
    assert (tmp_path / "online_dpo_data" / "iter_0002.pairs.jsonl").exists()
