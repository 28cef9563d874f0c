"""PolicyGradientModule: no critic, advantages and loss against naive references and the pure functions,
DAPO dynamic sampling (drop, refill within the bound, skip) and overlong shaping, TIS, exact resume,
the shipped configs through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from alignlit.losses import masked_nll, policy_gradient_loss, shift_for_next_token
from alignlit.models import ScalarHeadModel, export_pretrained, make_tiny_llama
from alignlit.models.forward import response_logprobs
from alignlit.modules import KLPenalty, Minibatches, Optim, PolicyGradientModule, PtxMix
from alignlit.ops import DynamicSampling, Overlong, entropy_from_logits, group_advantages, overlong_penalty
from alignlit.rollout import Experience, RolloutLoop, SamplingParams
from alignlit.rollout.base import select_groups
from tests.conftest import TINY
from tests.helpers import OP_PROMPTS as PROMPTS
from tests.helpers import TIMING, char_reward
from tests.helpers import fit_on_prompts as fit

ROOT = Path(__file__).resolve().parents[2]


def copy_constant_reward(prompts, responses):
    """1.0 on every 'copy'/'dedupe' prompt (all-equal groups); the sample's position in the call elsewhere
    (all different within a group): exactly the sort/reverse groups are informative."""
    return [1.0 if ("copy" in p or "dedupe" in p) else float(j) for j, p in enumerate(prompts)]


def constant_reward(prompts, responses):
    return [0.5] * len(responses)


def doubled_dr_grpo(rewards, *, eps):
    """An estimator given to the module by dotted path: 2·(r - mean_j r)."""
    return 2 * (rewards - rewards.mean(dim=1, keepdim=True))


def make_module(tiny_policy_dir, *, n=4, max_new_tokens=5, **kwargs):
    kwargs.setdefault("reward", char_reward)
    kwargs.setdefault(
        "rollout",
        RolloutLoop(sampling=SamplingParams(max_new_tokens=max_new_tokens), samples_per_prompt=n),
    )
    kwargs.setdefault("minibatches", Minibatches(size=8))
    module = PolicyGradientModule(policy=str(tiny_policy_dir), **kwargs)
    module.rollout.setup(module.policy, module.tokenizer)
    return module


def collect(module, prompts, rewards: list[float] | None = None):
    """A rollout of the module's policy; with ``rewards``, those hand-built values replace the scores."""
    exp = module.rollout.collect(prompts, module.reward)
    if rewards is not None:
        exp = Experience(exp.rollout, torch.tensor(rewards, dtype=torch.float32))
    return exp


def make_batch(module, rollout, rewards):
    """The batch a training step updates on: the trajectory built by the base, the module's advantages,
    the samples without a loss token dropped (one process)."""
    trajectory, metrics = module.make_trajectory(Experience(rollout, rewards))
    metrics.update(module.advantages(trajectory))
    return module.trainable(trajectory), metrics


def ids_of(rollout):
    return rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask


# ---------------------------------------------------------------------- structure and arguments
def test_no_critic_one_optimizer(tiny_policy_dir, rm_dir):
    """Only the policy is trained: no critic attribute or submodule, one optimizer, the trainable parameters
    are exactly the policy's; the only scalar-head model is the frozen reward model (none with a reward
    function)."""
    module = make_module(tiny_policy_dir, reward=str(rm_dir))
    assert not hasattr(module, "critic")
    assert not any("critic" in name for name, _ in module.named_modules())
    assert [m for m in module.modules() if isinstance(m, ScalarHeadModel)] == [module.reward_model]
    assert not any(p.requires_grad for p in module.reward_model.parameters())
    assert [t.name for t in module.trained_models()] == ["policy"]
    assert len(module.configure_optimizers()) == 1
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in module.policy.parameters()}
    module = make_module(tiny_policy_dir)
    assert not any(isinstance(m, ScalarHeadModel) for m in module.modules())


def test_bad_arguments_name_the_field(tiny_policy_dir):
    with pytest.raises(ValueError, match=r"samples_per_prompt is 1, but advantage 'grpo'"):
        make_module(tiny_policy_dir, n=1)
    with pytest.raises(ValueError, match="dynamic_sampling compares the rewards of a prompt's samples"):
        make_module(tiny_policy_dir, n=1, advantage="reinforce_pp", dynamic_sampling=DynamicSampling())
    with pytest.raises(ValueError, match="advantage 'gae' needs a critic's values"):
        make_module(tiny_policy_dir, advantage="gae")
    with pytest.raises(ValueError, match="unknown advantage estimator 'gpro'"):
        make_module(tiny_policy_dir, advantage="gpro")
    with pytest.raises(ValueError, match="unknown policy loss 'clip'"):
        make_module(tiny_policy_dir, policy_loss="clip")
    with pytest.raises(
        ValueError, match=r"advantage estimator 'no\.such\.fn' is neither registered nor importable"
    ):
        make_module(tiny_policy_dir, advantage="no.such.fn")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        make_module(tiny_policy_dir, aggregation="sum")
    with pytest.raises(
        ValueError, match=r"overlong.buffer \(8\) must be <= rollout.sampling.max_new_tokens \(5\)"
    ):
        make_module(tiny_policy_dir, overlong=Overlong(mode="penalty", buffer=8))
    with pytest.raises(ValueError, match=r"overlong\.mode must be"):
        Overlong(mode="drop")
    with pytest.raises(ValueError, match=r"dynamic_sampling\.max_tries must be >= 0"):
        DynamicSampling(max_tries=-1)
    with pytest.raises(ValueError, match="clip_low must be in"):
        make_module(tiny_policy_dir, clip_low=0.0)
    make_module(tiny_policy_dir, n=1, advantage="reinforce_pp")  # REINFORCE++ needs no group


# ---------------------------------------------------------------------- advantages
def naive_group(rewards: list[float], estimator: str, n: int, eps: float = 1e-6) -> list[float]:
    """Per-group loops (algorithms.md §10), independent of alignlit.ops."""
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    out: list[float] = []
    centred_all = [r - sum(g) / n for g in groups for r in g]
    batch_std = math.sqrt(
        sum(c * c for c in centred_all) / len(centred_all) - (sum(centred_all) / len(centred_all)) ** 2
    )
    for g in groups:
        mean = sum(g) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in g) / n)
        for j, r in enumerate(g):
            if estimator == "grpo":
                out.append((r - mean) / (std + eps))
            elif estimator == "dr_grpo":
                out.append(r - mean)
            elif estimator == "rloo":
                out.append(r - (sum(g) - g[j]) / (n - 1))
            else:
                out.append((r - mean) / (batch_std + eps))
    return out


HAND_REWARDS = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0, 0.2, 0.4, 0.2, 0.9]
"""4 groups of n = 4, the second one all equal (advantages 0 under every estimator)."""


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_advantages_match_naive_reference(tiny_policy_dir, estimator):
    """A hand-built experience (fixed rewards on a real rollout): the batch's advantages equal per-group
    loops and group_advantages on the same tensor, row by row (rows without a response token dropped)."""
    module = make_module(tiny_policy_dir, advantage=estimator)
    exp = collect(module, PROMPTS[:4], HAND_REWARDS)
    batch, metrics = make_batch(module, exp.rollout, exp.rewards)
    keep = exp.rollout.response_mask.any(-1)
    expected = torch.tensor(naive_group(HAND_REWARDS, estimator, 4))
    torch.testing.assert_close(batch.advantages, expected[keep], atol=1e-5, rtol=0)
    pure = group_advantages(exp.rewards.view(4, 4), estimator=estimator).flatten()
    torch.testing.assert_close(batch.advantages, pure[keep], atol=0, rtol=0)
    assert batch.advantages.dim() == 1 and len(batch) == int(keep.sum())
    assert metrics["advantage/zero_frac"] >= 4 / 16 - 1e-9  # the all-equal group


def test_dotted_path_estimator(tiny_policy_dir):
    module = make_module(tiny_policy_dir, advantage="tests.modules.test_policy_gradient.doubled_dr_grpo")
    exp = collect(module, PROMPTS[:4], HAND_REWARDS)
    batch, _ = make_batch(module, exp.rollout, exp.rewards)
    keep = exp.rollout.response_mask.any(-1)
    expected = 2 * torch.tensor(naive_group(HAND_REWARDS, "dr_grpo", 4))
    torch.testing.assert_close(batch.advantages, expected[keep], atol=1e-5, rtol=0)


def test_kl_in_the_reward_of_a_group_estimator(tiny_policy_dir, reference_dir):
    """RLOO with β = 0.1 in the reward: R_ij = r_ij - β·Σ_t (log π_old - log π_0), then the leave-one-out baseline."""
    module = make_module(
        tiny_policy_dir,
        advantage="rloo",
        reference=str(reference_dir),
        kl=KLPenalty(coef=0.1, estimator="k1"),
    )
    exp = collect(module, PROMPTS[:4], HAND_REWARDS)
    batch, metrics = make_batch(module, exp.rollout, exp.rewards)
    r = exp.rollout
    with torch.no_grad():
        old = response_logprobs(module.policy, *ids_of(r))
        ref = response_logprobs(module.reference, *ids_of(r))
    seq_kl = ((old - ref) * r.response_mask).sum(-1)
    assert seq_kl.abs().max() > 0.01
    shaped = [h - 0.1 * k for h, k in zip(HAND_REWARDS, seq_kl.tolist())]
    keep = r.response_mask.any(-1)
    torch.testing.assert_close(
        batch.advantages, torch.tensor(naive_group(shaped, "rloo", 4))[keep], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(batch.ref_logprobs, ref[keep])
    assert metrics["kl/ref"] == pytest.approx(seq_kl.mean().item(), abs=1e-5)
    assert metrics["kl/coef"] == 0.1


def test_reinforce_pp_matches_naive_returns(tiny_policy_dir, reference_dir):
    """REINFORCE++ (γ = 0.9, β = 0.2, k1): r_t = -β·kl_t, R added on the last token, G_t = Σ_s γ^(s-t) r_s,
    whitened over all valid tokens with the unbiased variance: per-row loops."""
    module = make_module(
        tiny_policy_dir,
        n=2,
        advantage="reinforce_pp",
        gamma=0.9,
        reference=str(reference_dir),
        kl=KLPenalty(coef=0.2),
    )
    scores = [1.0, -0.5, 0.25, 2.0, 0.0, 0.75, -1.0, 0.5]
    exp = collect(module, PROMPTS[:4], scores)
    batch, _ = make_batch(module, exp.rollout, exp.rewards)
    r = exp.rollout
    with torch.no_grad():
        kl = response_logprobs(module.policy, *ids_of(r)) - response_logprobs(module.reference, *ids_of(r))
    returns = []
    for j in range(len(r)):
        n_tok = int(r.response_mask[j].sum())
        rewards = [-0.2 * kl[j, t].item() for t in range(n_tok)]
        if n_tok:
            rewards[-1] += scores[j]
        g, row = 0.0, [0.0] * n_tok
        for t in reversed(range(n_tok)):
            g = rewards[t] + 0.9 * g
            row[t] = g
        returns.append(row)
    flat = torch.tensor([g for row in returns for g in row], dtype=torch.float64)
    whitened = ((flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8)).tolist()
    keep = r.response_mask.any(-1)
    got = [batch.advantages[i, : int(batch.loss_mask[i].sum())].tolist() for i in range(len(batch))]
    expected, k = [], 0
    for row in (row for row, kept in zip(returns, keep) if kept):
        expected.append(whitened[k : k + len(row)])
        k += len(row)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a == pytest.approx(b, abs=1e-4)
    assert (batch.advantages * ~batch.loss_mask).abs().max() == 0


# ---------------------------------------------------------------------- loss
def test_loss_matches_policy_gradient_loss_with_tis(tiny_policy_dir, reference_dir, data_dir):
    """After the policy moves, the module's loss equals policy_gradient_loss (Dr. GRPO aggregation with
    L_max = max_new_tokens, asymmetric clip, k3 KL term, entropy bonus, TIS weights) + ptx on independently
    computed tensors. The engine's log-probs are shifted by a known amount (an off-policy batch), so the
    truncated IS weights are min(e^0.8, 1.5) = 1.5 and e^-0.3."""
    module = make_module(
        tiny_policy_dir,
        advantage="dr_grpo",
        aggregation="seq_mean_token_sum_norm",
        clip_low=0.1,
        clip_high=0.3,
        kl_loss_coef=0.05,
        entropy_coef=0.01,
        tis_cap=1.5,
        reference=str(reference_dir),
        ptx=PtxMix(
            file=str(data_dir / "sft.jsonl"), coef=0.5, batch_size=4, max_length=32, max_prompt_length=20
        ),
    )
    module.setup_ptx()
    exp = collect(module, PROMPTS[:4])
    mask = exp.rollout.response_mask
    shift = torch.where(torch.arange(mask.shape[1]) % 2 == 0, 0.8, -0.3).expand_as(mask) * mask
    exp.rollout.logprobs = exp.rollout.logprobs - shift  # the engine's μ: log π_old - log μ = shift
    batch, metrics = make_batch(module, exp.rollout, exp.rewards)
    keep = mask.any(-1)
    weights = (torch.where(shift > 0, 1.5, torch.exp(shift)) * mask)[keep]
    torch.testing.assert_close(batch.is_weights, weights.float(), rtol=1e-5, atol=1e-6)
    assert metrics["mismatch/abs_max"] == pytest.approx(0.8, rel=1e-4)
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.02 * torch.randn_like(p))

    ptx_batch = next(iter(module.ptx_mixer.data.train_dataloader()))
    loss, loss_metrics = module.policy_loss(batch)
    attention = torch.cat([batch.prompt_mask, batch.loss_mask], 1).long()
    logits = module.policy(
        input_ids=torch.cat([batch.prompt_ids, batch.response_ids], 1),
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
    ).logits[:, batch.prompt_ids.shape[1] - 1 : -1]
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None])[..., 0]
    expected, expected_metrics = policy_gradient_loss(
        logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
        clip_low=0.1, clip_high=0.3, aggregation="seq_mean_token_sum_norm", max_length=5,
        ref_logprobs=batch.ref_logprobs, kl_coef=0.05, kl_estimator="k3",
        entropy=entropy_from_logits(logits), entropy_coef=0.01, is_weights=weights,
    )  # fmt: skip
    ptx_logits = module.policy(input_ids=ptx_batch.input_ids, attention_mask=ptx_batch.attention_mask).logits
    nll, _ = masked_nll(*shift_for_next_token(ptx_logits, ptx_batch.input_ids, ptx_batch.loss_mask))
    torch.testing.assert_close(loss, expected + 0.5 * nll, atol=1e-5, rtol=0)
    for key in ("clip_frac_high", "clip_frac_low", "kl", "entropy", "is_weight_mean"):
        torch.testing.assert_close(loss_metrics[key], expected_metrics[key], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "name, args",
    [("icepop", {"low": 0.5, "high": 2.0}), ("seq_tis", {"cap": 1.2}), ("geo_mask", {"cap": 1.1})],
)
def test_rollout_correction_weights_reach_the_batch(tiny_policy_dir, name, args):
    """rollout_correction: the engine's log-probs shifted by +0.8 / -0.3 on alternating tokens; the batch's
    IS weights are the registry function's (by hand for IcePop: e^0.8 = 2.23 > 2 masked, e^-0.3 kept) and
    the masked/capped shares are logged."""
    from alignlit.ops import ROLLOUT_CORRECTIONS

    module = make_module(tiny_policy_dir, rollout_correction=name, rollout_correction_args=args)
    exp = collect(module, PROMPTS[:4])
    mask = exp.rollout.response_mask
    shift = torch.where(torch.arange(mask.shape[1]) % 2 == 0, 0.8, -0.3).expand_as(mask) * mask
    exp.rollout.logprobs = exp.rollout.logprobs - shift
    batch, metrics = make_batch(module, exp.rollout, exp.rewards)
    keep = mask.any(-1)
    old = batch.old_logprobs
    want = ROLLOUT_CORRECTIONS[name](old, old - shift[keep].to(old.dtype), mask[keep], **args)
    torch.testing.assert_close(batch.is_weights, want.to(batch.is_weights.dtype), rtol=1e-5, atol=1e-6)
    if name == "icepop":
        hand = (torch.where(shift > 0, 0.0, torch.exp(shift)) * mask)[keep]
        torch.testing.assert_close(batch.is_weights, hand.float(), rtol=1e-5, atol=1e-6)
        even = (torch.arange(mask.shape[1]) % 2 == 0).expand_as(mask)[keep] & mask[keep]
        assert metrics["rollout_correction/masked_tokens"] == pytest.approx(
            float(even.sum() / mask[keep].sum())
        )
    assert "rollout_correction/masked_seqs" in metrics and "rollout_correction/weight_mean" in metrics


def test_rollout_correction_arguments_checked(tiny_policy_dir):
    with pytest.raises(ValueError, match=r"give tis_cap .* or rollout_correction"):
        make_module(tiny_policy_dir, tis_cap=2.0, rollout_correction="tis")
    with pytest.raises(ValueError, match="unknown rollout correction 'tiss'"):
        make_module(tiny_policy_dir, rollout_correction="tiss")


# ---------------------------------------------------------------------- DAPO
def test_dynamic_sampling_drops_all_equal_groups(tiny_policy_dir):
    """Without refill, the copy/dedupe groups (constant reward) are dropped; sort/reverse are kept with
    their rewards, in order."""
    module = make_module(tiny_policy_dir, reward=copy_constant_reward, dynamic_sampling=DynamicSampling())
    exp = collect(module, PROMPTS[:4])
    kept, metrics = module.collector.accept(exp)
    rollout, rewards = kept.rollout, kept.rewards
    assert rollout.prompts == [p for p in PROMPTS[:2] for _ in range(4)]
    torch.testing.assert_close(rewards, exp.rewards[:8])
    assert rollout.texts == exp.rollout.texts[:8]
    torch.testing.assert_close(
        rollout.response_ids, exp.rollout.response_ids[:8, : rollout.response_ids.shape[1]]
    )
    assert metrics["dynamic/informative_frac"] == 0.5 and metrics["dynamic/groups"] == 2.0
    assert metrics["dynamic/full"] == 0.0 and metrics["dynamic/tries"] == 0.0
    assert metrics["reward/raw"] == pytest.approx(exp.rewards.mean().item())


def test_dynamic_sampling_refills_within_the_bound(tiny_policy_dir, data_dir, tmp_path):
    """With refill, the batch's 4 groups are topped up with informative groups of training prompts drawn by
    the seeded generator (bounded tries), so every trained group is a sort/reverse one and the batch is full."""
    module = make_module(
        tiny_policy_dir, reward=copy_constant_reward, dynamic_sampling=DynamicSampling(max_tries=8)
    )
    trained = []
    make_trajectory = module.make_trajectory

    def record(experience):
        trained.append(list(experience.rollout.prompts))
        return make_trajectory(experience)

    module.make_trajectory = record
    fit(module, data_dir, tmp_path, rollouts=2, batch_size=4)
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert len(train) == 2 and module.progress.skipped_rollouts == 0
    for h, prompts in zip(train, trained):
        assert h["dynamic/full"] == 1.0 and h["dynamic/groups"] == 4.0
        assert (
            1 <= h["dynamic/tries"] <= 8
            and h["dynamic/extra_prompts"] >= 4 - 4 * h["dynamic/informative_frac"]
        )
        assert len(prompts) == 16 and not any("copy" in p or "dedupe" in p for p in prompts)
        assert "policy/pg_loss" in h


def test_no_informative_group_is_skipped_and_counted(tiny_policy_dir, data_dir, tmp_path):
    """A constant reward: every group is uninformative, refill gives up after max_tries rounds, the rollout is
    skipped (counted, no optimizer step) rather than crashing."""
    module = make_module(
        tiny_policy_dir, reward=constant_reward, dynamic_sampling=DynamicSampling(max_tries=2)
    )
    trainer = fit(module, data_dir, tmp_path, rollouts=2)
    train = [h for h in module.progress.history if "time/train_s" in h]
    assert [h["rollout/skipped"] for h in train] == [1.0, 1.0] and module.progress.skipped_rollouts == 2
    assert all(h["dynamic/tries"] == 2.0 and h["dynamic/groups"] == 0.0 for h in train)
    assert trainer.global_step == 0


def cut_to(rollout, lengths: list[int], limit: int) -> None:
    """Keep the first ``lengths[j]`` response tokens of sample ``j`` (in place); a sample at ``limit``
    tokens is one cut at the token limit (finish reason "length"), the others stopped."""
    keep = torch.arange(rollout.response_mask.shape[1])[None, :] < torch.tensor(lengths)[:, None]  # (N, T)
    rollout.response_mask = rollout.response_mask & keep
    rollout.logprobs = rollout.logprobs * rollout.response_mask
    rollout.finish_reasons = ["length" if n == limit else "stop" for n in lengths]


@pytest.mark.parametrize("mode", ["filter", "penalty"])
def test_overlong(tiny_policy_dir, mode):
    """Responses of 3, 1, 2, 3 tokens per group with max_new_tokens = 3 (the 3-token ones were cut).
    Filter: the cut ones leave the batch; the group baselines still use their rewards. Penalty with L = 3,
    L_c = 2, factor 0.5: lengths 3, 1, 2 get -0.5, 0, -0.5·(2 - 1)/2 = -0.25, added before the advantages."""
    module = make_module(
        tiny_policy_dir,
        max_new_tokens=3,
        advantage="dr_grpo",
        overlong=Overlong(mode=mode, buffer=2, penalty=0.5),
    )
    exp = collect(module, PROMPTS[:4], HAND_REWARDS)
    assert exp.rollout.response_mask.sum(-1).min() == 3
    cut_to(exp.rollout, [3, 1, 2, 3] * 4, limit=3)
    kept, metrics = module.collector.accept(exp)
    rollout = kept.rollout
    batch, more = make_batch(module, rollout, kept.rewards)
    rewards = module.collector.task_rewards(rollout, kept.rewards)
    if mode == "filter":
        torch.testing.assert_close(rewards, exp.rewards)
        assert more["response/overlong_filtered"] == 8.0 and len(batch) == 8
        stopped = [1, 2, 5, 6, 9, 10, 13, 14]  # the 1- and 2-token responses of each group
        expected = torch.tensor(naive_group(HAND_REWARDS, "dr_grpo", 4))[stopped]
    else:
        penalty = torch.tensor([-0.5, 0.0, -0.25, -0.5] * 4)
        torch.testing.assert_close(rewards, exp.rewards + penalty)
        torch.testing.assert_close(
            penalty, overlong_penalty(rollout.response_lengths, max_length=3, buffer=2, penalty=0.5)
        )
        assert metrics["reward/overlong_penalty"] == pytest.approx(penalty.mean().item())
        expected = torch.tensor(naive_group((exp.rewards + penalty).tolist(), "dr_grpo", 4))
    torch.testing.assert_close(batch.advantages, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- several ranks
def test_several_ranks_keep_rows_without_a_loss_token(tiny_policy_dir):
    """Under 2 ranks (a DDP trainer attached, no process group) the overlong-filtered responses stay in the
    batch, masked out, so every rank runs as many minibatch updates; the others get the advantages of one
    process. A minibatch holding only such rows gives a zero loss whose backward reaches every policy weight
    with a zero gradient (DDP's all-reduce and FSDP2's reduce-scatter need every rank's backward)."""
    module = make_module(
        tiny_policy_dir, max_new_tokens=3, advantage="dr_grpo", overlong=Overlong(mode="filter", buffer=2)
    )
    exp = collect(module, PROMPTS[:4], HAND_REWARDS)
    cut_to(exp.rollout, [3, 1, 2, 3] * 4, limit=3)
    one, _ = make_batch(module, exp.rollout, exp.rewards)
    module.trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert module.trainer.world_size == 2
    many, _ = make_batch(module, exp.rollout, exp.rewards)
    stopped = torch.tensor([1, 2, 5, 6, 9, 10, 13, 14])
    assert len(one) == 8 and len(many) == 16
    assert int(many.loss_mask.sum(-1)[stopped].sum()) == int(many.loss_mask.sum()) == int(one.loss_mask.sum())
    torch.testing.assert_close(many.advantages[stopped], one.advantages, rtol=0, atol=0)
    cut = torch.tensor([0, 3, 4, 7])
    loss, metrics = module.policy_loss(many.select(cut))
    assert loss.item() == 0.0 and metrics == {}
    module.policy.zero_grad(set_to_none=True)
    loss.backward()
    trained = [(n, p) for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and p.grad.abs().max() == 0 for _, p in trained)


@pytest.mark.parametrize("advantage", ["reinforce_pp", "reinforce_pp_baseline"])
def test_make_batch_over_two_ranks_equals_one_process(tiny_policy_dir, reference_dir, advantage):
    """Two modules (threads standing for 2 data-parallel ranks, tests/distributed/test_global_stats.py) build the batch of
    half the groups each: their advantages are those one process builds on the whole rollout, with the batch
    statistics (REINFORCE++'s whitening, REINFORCE++-baseline's std) of the global batch, not their own."""
    from tests.distributed.test_global_stats import ThreadRanks

    def module():
        return make_module(tiny_policy_dir, n=2, advantage=advantage, reference=str(reference_dir),
                           kl=KLPenalty(coef=0.2))  # fmt: skip

    one = module()
    scores = [1.0, -0.5, 0.25, 2.0, 0.0, 0.75, -1.0, 0.5]
    exp = collect(one, PROMPTS[:4], scores)
    assert bool(exp.rollout.response_mask.any(-1).all())
    whole, _ = make_batch(one, exp.rollout, exp.rewards)
    halves = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    parts = [(select_groups([exp.rollout], [g], one.tokenizer.pad_token_id), exp.rewards.view(4, 2)[g].flatten())
             for g in halves]  # fmt: skip
    ranks = [module(), module()]

    def build(rank_part, reduce):
        rank, (rollout, rewards) = rank_part
        ranks[rank].all_reduce_sum = reduce
        ranks[rank].batch_all_reduce = lambda: reduce
        return make_batch(ranks[rank], rollout, rewards)[0]

    threads = ThreadRanks(2)
    batches = threads.run(build, list(enumerate(parts)))
    got = torch.cat([b.advantages for b in batches])  # select_groups keeps the rollout's widths
    torch.testing.assert_close(got, whole.advantages, rtol=0, atol=1e-5)
    assert threads.calls[0] == threads.calls[1] >= 2  # both ranks in every collective
    del ranks[0].all_reduce_sum, ranks[0].batch_all_reduce  # rank 0 on its own: its local statistics
    local = make_batch(ranks[0], *parts[0])[0].advantages
    assert (local - whole.advantages[: len(local)]).abs().max() > 1e-2


# ---------------------------------------------------------------------- fit, resume
def test_fit_logs_the_monitoring_metrics(tiny_policy_dir, data_dir, tmp_path):
    module = make_module(tiny_policy_dir, optim=Optim(lr=1e-3, min_lr_ratio=1.0), gold=char_reward)
    policy0 = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = fit(module, data_dir, tmp_path, rollouts=2, val_batches=1)
    assert not all(torch.equal(v, policy0[k]) for k, v in module.policy.state_dict().items())
    train = [h for h in module.progress.history if "time/train_s" in h]
    for key in (
        "reward/raw", "reward/std", "dynamic/informative_frac", "advantage/std", "kl/ref", "response/length",
        "policy/clip_frac_high", "policy/clip_frac_low", "policy/entropy", "policy/kl", "mismatch/abs_mean",
        "lr/policy",
    ):  # fmt: skip
        assert all(key in h for h in train), key
    for h in train:  # the experience forwards are timed, inside the rollout's train time
        assert h["time/old_logp_s"] > 0 and h["time/ref_logp_s"] > 0
        assert h["time/old_logp_s"] + h["time/ref_logp_s"] < h["time/train_s"]
    assert trainer.global_step == 4  # rollouts of 4 and 2 prompts x 4 samples, minibatches of 8: 2 + 1, 1
    history = json.loads((tmp_path / "policy_gradient_curves.json").read_text())
    assert [h["rollout"] for h in history if "reward/raw" in h] == [1.0, 2.0]
    assert any("val/gold" in h for h in history)


def resume_module(tiny_policy_dir, reference_dir, data_dir):
    return make_module(
        tiny_policy_dir,
        reward=copy_constant_reward,
        advantage="rloo",
        reference=str(reference_dir),
        kl=KLPenalty(coef=0.05, target=1.0, horizon=50),
        kl_loss_coef=0.01,
        tis_cap=2.0,
        dynamic_sampling=DynamicSampling(max_tries=4),
        ptx=PtxMix(
            file=str(data_dir / "sft.jsonl"),
            val_file=str(data_dir / "sft.jsonl"),
            coef=0.1,
            batch_size=3,
            max_length=32,
            max_prompt_length=20,
        ),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=5), samples_per_prompt=2),
        minibatches=Minibatches(size=3, epochs=2),
        optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        gold=char_reward,
    )


@pytest.mark.slow
def test_exact_resume(tmp_path, tiny_policy_dir, reference_dir, data_dir):
    """4 rollouts straight vs. resumed from the checkpoint written after rollout 3: same weights, history
    (timings aside), KL controller and refill generator. 6 training prompts (4 of them copy/dedupe, whose
    groups are uninformative) in batches of 4 and 2, n = 2: dynamic sampling refills the batch in the
    rollouts before the checkpoint and in the one after it."""
    straight = resume_module(tiny_policy_dir, reference_dir, data_dir)
    fit(straight, data_dir, tmp_path / "a", rollouts=4, checkpoint_every=1, val_batches=1)
    train = [h for h in straight.progress.history if "time/train_s" in h]
    assert train[0]["dynamic/tries"] > 0 and train[3]["dynamic/tries"] > 0
    assert "rollout/skipped" not in train[3]
    by_rollout = {}
    for path in (tmp_path / "a" / "ckpt").iterdir():
        saved = torch.load(path, weights_only=True)
        by_rollout[saved["policy_gradient_state"]["rollout"]["rollouts"]] = (path, saved)
    ckpt, saved = by_rollout[3]
    assert not any(k.startswith(("reference.", "reward_model.")) for k in saved["state_dict"])

    resumed = resume_module(tiny_policy_dir, reference_dir, data_dir)
    fit(resumed, data_dir, tmp_path / "b", rollouts=4, ckpt_path=str(ckpt), val_batches=1)
    for (key, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), f"policy.{key} differs after resume"
    assert resumed.kl_ctl.value == straight.kl_ctl.value
    assert torch.equal(
        resumed.collector.refill_generator.get_state(), straight.collector.refill_generator.get_state()
    )
    strip = [{k: v for k, v in h.items() if not k.startswith(TIMING)} for h in straight.progress.history]
    assert [
        {k: v for k, v in h.items() if not k.startswith(TIMING)} for h in resumed.progress.history
    ] == strip
    assert any("val/gold" in h and "val/sft_nll" in h for h in strip)


# ---------------------------------------------------------------------- configs
DAPO = [
    "--model.init_args.clip_high=0.28",
    "--model.init_args.aggregation=token_mean",
    "--model.init_args.dynamic_sampling.max_tries=2",
    "--model.init_args.overlong.mode=filter",
]
GRPO, RLOO = ROOT / "configs/quickstart/grpo.yaml", ROOT / "configs/quickstart/rloo.yaml"
CONFIGS = [  # (config stack, overrides, the run's name)
    ([GRPO], [], "grpo"),
    ([RLOO], [], "rloo"),
    ([RLOO], ["--model.init_args.advantage=reinforce_pp"], "rloo"),
    ([GRPO], DAPO, "grpo"),
    ([GRPO, ROOT / "configs/async/grpo.yaml"], [], "grpo-async"),
    ([GRPO, ROOT / "configs/async/grpo-partial.yaml"], [], "grpo-partial"),
    ([GRPO, ROOT / "configs/speed/token-budget.yaml"], [], "grpo"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("configs", "overrides", "name"),
    CONFIGS,
    ids=["grpo", "rloo", "rloo-reinforce_pp", "grpo-dapo", "grpo-async", "grpo-partial", "grpo-token-budget"],
)
def test_config_tiny_fit(configs, overrides, name, tmp_path, monkeypatch, tiny_policy_dir, rm_dir, data_dir):
    """Each shipped config (and the README's REINFORCE++ and DAPO overrides) runs two rollouts on the tiny
    model through the CLI, with its own logger and checkpoint callback (relative paths land in tmp_path);
    model and data paths overridden."""
    from alignlit.cli import main

    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            *[arg for config in configs for arg in ("--config", str(config))],
            f"--model.init_args.policy={tiny_policy_dir}",
            f"--model.init_args.reward={rm_dir}",
            "--model.init_args.gold=null",
            f"--model.init_args.ptx.file={data_dir / 'sft.jsonl'}",
            f"--model.init_args.ptx.val_file={data_dir / 'sft.jsonl'}",
            "--model.init_args.export_dir=export",
            f"--data.init_args.train_file={data_dir / 'prompts.jsonl'}",
            f"--data.init_args.val_file={data_dir / 'prompts.jsonl'}",
            "--data.init_args.batch_size=4",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.val_check_interval=2",
            *overrides,
        ]
    )
    assert (tmp_path / "export" / "config.json").exists()
    curves = next((tmp_path / "out" / "quickstart" / "logs").rglob("policy_gradient_curves.json"))
    history = json.loads(curves.read_text())
    assert len([h for h in history if "reward/raw" in h]) == 2
    assert [h["rollout"] for h in history if "val/reward" in h] == [0.0, 2.0]  # before training, after 2
    last = torch.load(tmp_path / f"out/quickstart/checkpoints/{name}/last.ckpt", weights_only=True)
    assert last["policy_gradient_state"]["rollout"]["rollouts"] == 2
    if "async" in name or "partial" in name:  # every sample one version older than the policy after step 1
        assert [h["async/staleness_max"] for h in history if "reward/raw" in h] == [0.0, 1.0]
    if "partial" in name:  # batch 1: its first segment from step 0's weights, its second from step 1's
        assert [h["async/token_staleness_max"] for h in history if "reward/raw" in h] == [0.0, 1.0]
    if "token_budget" in str(configs[-1]).replace("-", "_"):
        assert all(h["perf/microbatches"] >= 1 for h in history if "reward/raw" in h)
    if overrides == DAPO:
        assert all(
            "dynamic/informative_frac" in h and "dynamic/tries" in h for h in history if "reward/raw" in h
        )


# ---------------------------------------------------------------------- vLLM
@pytest.mark.vllm
def test_grpo_with_vllm_engine(tmp_path, tokenizer, data_dir):
    """Two GRPO rollouts with `rollout.engine: vllm`: weights are synced after the policy update, the
    parity check (every sync) passes, and the mismatch metrics are logged every rollout."""
    policy_dir = tmp_path / "policy"
    export_pretrained(make_tiny_llama(tokenizer, seed=0, **TINY), tokenizer, policy_dir, stage="init")
    module = PolicyGradientModule(
        policy=str(policy_dir),
        reward=char_reward,
        tis_cap=2.0,
        optim=Optim(lr=1e-3, min_lr_ratio=1.0),
        rollout=RolloutLoop(
            engine="vllm",
            sampling=SamplingParams(max_new_tokens=5),
            samples_per_prompt=4,
            parity_every=1,
            parity_tol=1e-3,
            vllm_args={"max_model_len": 128},
        ),
        minibatches=Minibatches(size=8),
    )
    fit(module, data_dir, tmp_path, rollouts=2)
    assert module.rollout.engine.weight_pushes == 2
    parity = [
        h["rollout/parity_max_abs_diff"]
        for h in module.progress.history
        if "rollout/parity_max_abs_diff" in h
    ]
    assert len(parity) == 2 and max(parity) < 1e-3
    assert all("mismatch/abs_mean" in h for h in module.progress.history if "time/train_s" in h)


def test_dynamic_sampling_refuses_several_processes(tiny_policy_dir):
    """Each rank would keep a different number of groups and take a different number of optimizer steps
    (a hang in the gradient all-reduce): refused before the engine is built."""
    module = make_module(tiny_policy_dir, dynamic_sampling=DynamicSampling())
    module.trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert module.trainer.world_size == 2
    with pytest.raises(ValueError, match="dynamic_sampling keeps a different number of groups on each rank"):
        module.setup("fit")


def test_export_every_writes_the_policy_of_each_point_of_the_run(tiny_policy_dir, data_dir, tmp_path):
    """`ExportEvery(1)` over 3 rollouts (constant LR) writes batch_00001..3: the last is the final export,
    the first equals the export of a run stopped after 1 rollout (same seed), and the index says which."""
    from alignlit.callbacks import ExportEvery
    from alignlit.models import load_policy

    def weights(path):
        return load_policy(path)[0].state_dict()

    def run(rollouts, out, callbacks=()):
        L.seed_everything(0)
        module = make_module(tiny_policy_dir, optim=Optim(lr=1e-3, min_lr_ratio=1.0), export_dir=str(out))
        root = tmp_path / f"root_{out.name}"
        fit(module, data_dir, root, rollouts=rollouts, batch_size=2, epochs=1, callbacks=callbacks)

    snaps = tmp_path / "snaps"
    run(3, tmp_path / "long", [ExportEvery(every_n_batches=1, dirpath=str(snaps))])
    run(1, tmp_path / "short")
    index = [json.loads(line) for line in (snaps / "snapshots.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in index] == [1, 2, 3]
    assert [Path(r["path"]).name for r in index] == ["batch_00001", "batch_00002", "batch_00003"]
    assert all(r["fit_s"] > 0 for r in index)
    final, last, first, short = (
        weights(p)
        for p in (tmp_path / "long", snaps / "batch_00003", snaps / "batch_00001", tmp_path / "short")
    )
    for name, value in final.items():
        assert torch.equal(last[name], value), name
        assert torch.equal(first[name], short[name]), name
    assert any(not torch.equal(first[n], final[n]) for n in final)  # the run moved after the first snapshot
    with pytest.raises(ValueError, match="every_n_batches must be >= 1"):
        ExportEvery(every_n_batches=0, dirpath=str(snaps))
