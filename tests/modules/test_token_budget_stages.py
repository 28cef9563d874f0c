"""``minibatches.token_budget`` in the online stages: the gradient of each optimiser step over token-budget
micro-batches equals the one-pass gradient of the whole minibatch (policy gradients under token- and
sequence-mean aggregations with KL and entropy terms; PPO's policy and value losses; online DPO's pairs and
online RRHF's response sets, weighted by their share of the step's items), the no-grad passes
give the same log-probs and values, and the logged micro-batch count and padding share match a hand count.

Rows of very different lengths: prompts cut to 4 real tokens, responses of ``RESPONSE_LENGTHS`` tokens,
so that the rows hold ``LENGTHS = 4 + r`` tokens.
"""

from __future__ import annotations

import dataclasses
import json

import lightning as L
import pytest
import torch

from alignlit.data import PromptDataModule
from alignlit.models import export_pretrained, make_tiny_llama
from alignlit.modules import (
    Minibatches,
    OnlineDPOModule,
    OnlineRRHFModule,
    PolicyGradientModule,
    PPOModule,
)
from alignlit.modules.micro_batches import combine_metrics, even_out, forward_in_budget, padding_bounds
from alignlit.rollout import Experience, RolloutLoop, SamplingParams
from tests.conftest import TINY

PROMPTS = ["\n\nHuman: sort a b c\n\nAssistant:", "\n\nHuman: copy d e f g\n\nAssistant:"]
RESPONSE_LENGTHS = [1, 20, 3, 12, 2, 7, 16, 5]
LENGTHS = [4 + r for r in RESPONSE_LENGTHS]  # [5, 24, 7, 16, 6, 11, 20, 9]
REWARDS = [1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 0.0, 1.0]
BUDGETS = [None, 1, 48, 10_000]
"""None: one pass; 1: a row per micro-batch; 48: 3 micro-batches of the 8 rows (hand count below); 10,000:
one micro-batch of every row, cut to the longest."""


def plain_token_mean(values, mask, *, max_length=None):
    """A loss aggregation given by dotted path, registered without a unit."""
    return (values * mask).sum() / mask.sum()


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory, tokenizer):
    """A second tiny policy, so that the KL term has a gradient."""
    d = tmp_path_factory.mktemp("tb_ref") / "ref"
    export_pretrained(make_tiny_llama(tokenizer, seed=1, **TINY), tokenizer, d, stage="init")
    return d


class Recorder(torch.optim.SGD):
    """SGD with learning rate 0 recording each step's gradients (the weights stay put, so one module
    serves every budget)."""

    def __init__(self, params):
        self.params = list(params)
        super().__init__(self.params, lr=0.0)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() for p in self.params])
        return super().step(closure)


def attach(module, *models) -> list[Recorder]:
    """Recording optimisers for the module's trained models; backward without a trainer."""
    recorders = [Recorder(m.parameters()) for m in models]
    module.optimizers = lambda: recorders
    module.manual_backward = lambda loss: loss.backward()
    return recorders


def experience(module) -> Experience:
    """A rollout of 2 prompts × 4 samples with hand-set prompt (4 tokens) and response lengths."""
    exp = module.rollout.collect(PROMPTS, module.reward)
    r = exp.rollout
    assert r.prompt_mask.sum(-1).min() >= 4
    width = r.prompt_mask.shape[1]
    r.prompt_mask = r.prompt_mask & (torch.arange(width) >= width - 4)[None, :]  # the last 4 tokens
    r.response_mask = torch.arange(r.response_ids.shape[1])[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    r.logprobs = (r.logprobs - 0.1) * r.response_mask  # μ ≠ π_old: importance weights ≠ 1
    r.finish_reasons = ["stop"] * len(r)
    return Experience(r, torch.tensor(REWARDS))


def with_budget(module, budget) -> None:
    module.updates.plan = dataclasses.replace(module.updates.plan, token_budget=budget)
    module.trajectories.token_budget = budget


def assert_grads_close(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for step_got, step_want in zip(got, want):
        for g, w in zip(step_got, step_want):
            torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-6)


def pg_module(tiny_policy_dir, reference_dir, **kwargs):
    module = PolicyGradientModule(
        policy=str(tiny_policy_dir), reward=lambda p, r: [0.0] * len(r), reference=str(reference_dir),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=20), samples_per_prompt=4),
        tis_cap=2.0, kl_loss_coef=0.1, entropy_coef=0.01, **kwargs,
    )  # fmt: skip
    module.rollout.setup(module.policy, module.tokenizer)
    return module


# ---------------------------------------------------------------------- policy gradients
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("size", [8, 3])
def test_policy_gradient_budgets_give_the_one_pass_gradient(
    tiny_policy_dir, reference_dir, aggregation, size
):
    """GRPO with KL and entropy terms and TIS weights: every step's gradient (and grad norm and loss metric)
    is the same under every budget, whether a minibatch is the whole rollout (8 rows) or 3 rows."""
    module = pg_module(
        tiny_policy_dir,
        reference_dir,
        aggregation=aggregation,
        minibatches=Minibatches(size=size, shuffle=False),
    )
    recorder = attach(module, module.policy)[0]
    exp = experience(module)
    results = {}
    for budget in BUDGETS:
        with_budget(module, budget)
        trajectory, _ = module.make_trajectory(exp)
        before = len(recorder.grads)
        metrics = module.train_on(trajectory)
        results[budget] = (recorder.grads[before:], metrics, trajectory)
    grads, metrics, trajectory = results[None]
    assert len(grads) == -(-8 // size)
    assert any(g.abs().max() > 0 for g in grads[0])
    for budget in BUDGETS[1:]:
        got, got_metrics, got_trajectory = results[budget]
        for name in ("old_logprobs", "ref_logprobs", "is_weights"):  # the no-grad passes, split by the budget
            torch.testing.assert_close(
                getattr(got_trajectory, name), getattr(trajectory, name), rtol=1e-5, atol=1e-6
            )
        assert_grads_close(got, grads)
        for key in ("policy/grad_norm", "policy/pg_loss", "policy/kl", "policy/entropy", "policy/ratio_max"):
            assert got_metrics[key] == pytest.approx(metrics[key], rel=2e-4, abs=1e-6), key


def test_micro_batch_count_and_padding_share_by_hand(tiny_policy_dir, reference_dir):
    """Budget 48 over the lengths 5, 24, 7, 16, 6, 11, 20, 9 (longest first: 24 and 20 fill 2 × 24 = 48;
    16 opens the next, which takes 11 and 9 (3 × 16 = 48); 7 opens the last, with 6 and 5): 3 micro-batches
    in one step, padded to 2 × 24, 3 × 16 and 3 × 7 = 117 tokens for 98 real ones. With a budget of 1:
    8 micro-batches, no padding column."""
    module = pg_module(tiny_policy_dir, reference_dir, minibatches=Minibatches(size=8, shuffle=False))
    attach(module, module.policy)
    exp = experience(module)
    for budget, count, share in ((48, 3.0, 1 - 98 / 117), (1, 8.0, 0.0), (10_000, 1.0, 1 - 98 / 8 / 24)):
        with_budget(module, budget)
        module.updates.stats.reset()
        module.train_on(module.make_trajectory(exp)[0])
        assert module.updates.stats.metrics() == {
            "perf/microbatches": count,
            "perf/padding_share": pytest.approx(share, abs=1e-12),
        }
    with_budget(module, None)
    module.updates.stats.reset()
    module.train_on(module.make_trajectory(exp)[0])
    assert module.updates.stats.metrics() == {}  # nothing logged without a budget


def test_fit_with_a_budget_trains_the_same_policy(tiny_policy_dir, reference_dir, tmp_path):
    """Two rollouts of GRPO through a Trainer (responses of up to 12 tokens, 4 rows per optimiser step):
    the policy trained with a 40-token budget (and its gradient norms) is the one trained without, and the budgeted run logs its
    micro-batches (more than one per step: 4 rows of at least 12 prompt tokens exceed 40) and padding share."""
    (tmp_path / "prompts.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"\n\nHuman: sort {' '.join('abcdefgh'[: 2 + i])}\n\nAssistant:"}) + "\n"
            for i in range(6)
        )
    )
    policies, norms = {}, {}
    for budget in (None, 40):
        module = PolicyGradientModule(
            policy=str(tiny_policy_dir), reward=lambda p, r: [float(len(x) % 3) for x in r],
            reference=str(reference_dir), kl_loss_coef=0.1, aggregation="seq_mean_token_mean",
            rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=12), samples_per_prompt=4),
            minibatches=Minibatches(size=4, token_budget=budget),
        )  # fmt: skip
        trainer = L.Trainer(
            accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path / str(budget),
        )  # fmt: skip
        trainer.fit(
            module,
            PromptDataModule(train_file=str(tmp_path / "prompts.jsonl"), val_fraction=0.0, batch_size=2),
        )
        history = [h for h in module.progress.history if "policy/grad_norm" in h]
        assert len(history) == 2
        if budget is None:
            assert not any(k.startswith("perf/") for h in history for k in h)
        else:
            assert all(h["perf/microbatches"] > 1 and 0 <= h["perf/padding_share"] < 1 for h in history)
        policies[budget] = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
        norms[budget] = [h["policy/grad_norm"] for h in history]  # Adam's first steps hide a scale, not this
    assert norms[40] == pytest.approx(norms[None], rel=1e-4)
    for name, value in policies[None].items():
        torch.testing.assert_close(policies[40][name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("count", [5, 11])
def test_more_micro_batches_for_other_ranks_keep_the_gradient(tiny_policy_dir, reference_dir, count):
    """When another data-parallel rank needs more micro-batches (here: the most over the ranks is forced to
    5 or 11 against the 3 of budget 48), the step halves its largest micro-batches (5) and then adds
    fillers weighed 0 (11 > 8 rows): the same gradient as one pass, ``count`` passes logged."""
    module = pg_module(
        tiny_policy_dir, reference_dir, aggregation="seq_mean_token_mean",
        minibatches=Minibatches(size=8, shuffle=False),
    )  # fmt: skip
    recorder = attach(module, module.policy)[0]
    exp = experience(module)
    module.train_on(module.make_trajectory(exp)[0])
    with_budget(module, 48)
    module.updates.count_micro_batches = lambda own: (
        count if own == 3 else pytest.fail(f"{own} micro-batches")
    )
    module.updates.stats.reset()
    metrics = module.train_on(module.make_trajectory(exp)[0])
    assert module.updates.stats.metrics()["perf/microbatches"] == count
    assert_grads_close(recorder.grads[1:], recorder.grads[:1])
    assert metrics["policy/grad_norm"] > 0


# ---------------------------------------------------------------------- PPO
@pytest.mark.parametrize("advantage_norm", ["batch", "minibatch"])
def test_ppo_budgets_give_the_one_pass_gradients(tiny_policy_dir, advantage_norm):
    """PPO's critic (clipped value loss) and actor (clipped surrogate + entropy bonus) steps over two
    minibatches of 4 rows: the same gradients under every budget, the minibatch whitening over the
    minibatch, not a micro-batch."""
    module = PPOModule(
        policy=str(tiny_policy_dir), critic=str(tiny_policy_dir), reward=lambda p, r: [0.0] * len(r),
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=20), samples_per_prompt=4),
        minibatches=Minibatches(size=4, shuffle=False), reward_norm="none", reward_clip=None,
        advantage_norm=advantage_norm, entropy_coef=0.05, value_clip_eps=0.05,
    )  # fmt: skip
    module.rollout.setup(module.policy, module.tokenizer)
    module.rollout.rollouts = 1  # past critic_pretrain_rollouts (0): the actor steps too
    actor, critic = attach(module, module.policy, module.critic)
    with torch.no_grad():  # a critic whose values are not those it is trained towards
        for p in module.critic.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    exp = experience(module)
    results = {}
    for budget in BUDGETS:
        with_budget(module, budget)
        trajectory, _ = module.make_trajectory(exp)
        counts = len(actor.grads), len(critic.grads)
        metrics = module.train_on(trajectory)
        results[budget] = (actor.grads[counts[0] :], critic.grads[counts[1] :], metrics, trajectory)
    actor_grads, critic_grads, metrics, trajectory = results[None]
    assert len(actor_grads) == len(critic_grads) == 2
    for budget in BUDGETS[1:]:
        got_actor, got_critic, got_metrics, got_trajectory = results[budget]
        torch.testing.assert_close(got_trajectory.values, trajectory.values, rtol=1e-5, atol=1e-6)
        assert_grads_close(got_critic, critic_grads)
        assert_grads_close(got_actor, actor_grads)
        for key in (
            "value/loss",
            "policy/policy_loss",
            "policy/entropy",
            "policy/grad_norm",
            "value/grad_norm",
        ):
            assert got_metrics[key] == pytest.approx(metrics[key], rel=2e-4, abs=1e-6), key


# ---------------------------------------------------------------------- arguments and pure parts
def test_bad_budget_names_the_field(tiny_policy_dir, reference_dir):
    for bad in (0, -5, True):
        with pytest.raises(ValueError, match=r"minibatches\.token_budget must be an int >= 1 or None"):
            Minibatches(token_budget=bad)
    with pytest.raises(
        ValueError,
        match=r"minibatches\.token_budget with aggregation 'tests\.modules\..*plain_token_mean'.*has no unit",
    ):
        pg_module(
            tiny_policy_dir, reference_dir, aggregation=f"{__name__}.plain_token_mean",
            minibatches=Minibatches(token_budget=64),
        )  # fmt: skip
    pg_module(tiny_policy_dir, reference_dir, aggregation=f"{__name__}.plain_token_mean")  # no budget: fine


def test_padding_bounds_and_forward_in_budget():
    """The columns that are padding in every row are cut (left of the prompts, right of the responses);
    a function of the rows gives the same values over micro-batches as in one call, 0 on padding."""
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    response_mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    assert padding_bounds(prompt_mask, response_mask) == (1, 3)
    assert padding_bounds(prompt_mask[:1], response_mask[:1]) == (2, 1)
    prompt_ids = torch.arange(8).view(2, 4)
    response_ids = torch.arange(10).view(2, 5) + 10

    def fn(p_ids, p_mask, r_ids, r_mask):  # a row's value depends on its real tokens only
        total = (p_ids * p_mask).sum(-1, keepdim=True) + (r_ids * r_mask).cumsum(-1)
        return total.float() * r_mask

    ids = (prompt_ids, prompt_mask, response_ids, response_mask)
    want = torch.tensor([[2 + 3 + 10, 0, 0, 0, 0], [18 + 15, 18 + 15 + 16, 18 + 15 + 16 + 17, 0, 0]]).float()
    for budget in (None, 1, 5, 100):
        torch.testing.assert_close(forward_in_budget(fn, ids, budget), want, rtol=0, atol=0)


def test_even_out_and_combine_metrics():
    """A rank with fewer micro-batches halves its largest until it has as many as the others, then adds
    fillers; metrics: losses by aggregation share, token means by token share, maxima by max."""
    micro = [torch.tensor([0, 1, 2, 3]), torch.tensor([4])]
    out = even_out(micro, 4, filler=torch.tensor([0]))  # [0..3] halved, then the first half of it
    assert [t.tolist() for t in out] == [[0], [1], [2, 3], [4]]
    assert [t.tolist() for t in even_out([torch.tensor([5])], 3, filler=torch.tensor([0]))] == [[5], [0], [0]]
    records = [
        (
            0.25,
            0.5,
            {"pg_loss": torch.tensor(4.0), "entropy": torch.tensor(1.0), "ratio_max": torch.tensor(1.5)},
        ),
        (
            0.75,
            0.5,
            {"pg_loss": torch.tensor(8.0), "entropy": torch.tensor(3.0), "ratio_max": torch.tensor(1.2)},
        ),
    ]
    combined = combine_metrics(records)
    assert float(combined["pg_loss"]) == 0.25 * 4 + 0.75 * 8
    assert float(combined["entropy"]) == 2.0
    assert float(combined["ratio_max"]) == 1.5


# ---------------------------------------------------------------------- online DPO and online RRHF
SET_PROMPTS = [
    "\n\nHuman: sort a b c\n\nAssistant:",
    "\n\nHuman: copy d\n\nAssistant:",
    "\n\nHuman: reverse h g f e d c b\n\nAssistant:",
    "\n\nHuman: say x y\n\nAssistant:",
]
"""Four prompts of different lengths."""


def spy_encoded(module, encode_name: str = "encode") -> list:
    """Everything the stage's ``encode`` returns, in order (the items a step's micro-batches pack)."""
    out, encode = [], getattr(module, encode_name)

    def spy(*args):
        out.append(encode(*args))
        return out[-1]

    setattr(module, encode_name, spy)
    return out


def run_budgets(module, recorder, trajectory, budgets):
    """Each budget's recorded step gradients, metrics and ``perf/*`` of ``train_on(trajectory)``."""
    results = {}
    for budget in budgets:
        with_budget(module, budget)
        module.updates.stats.reset()
        before = len(recorder.grads)
        metrics = module.train_on(trajectory)
        results[budget] = (recorder.grads[before:], metrics, module.updates.stats.metrics())
    return results


def assert_budgets_agree(results, keys):
    """Every budget's gradients and metrics ``keys`` are the one-pass ones (budget None)."""
    grads, metrics, perf = results[None]
    assert perf == {} and any(g.abs().max() > 0 for g in grads[0])
    for budget, (got, got_metrics, _) in results.items():
        assert_grads_close(got, grads)
        for key in keys:
            assert got_metrics[key] == pytest.approx(metrics[key], rel=2e-4, abs=1e-6), (budget, key)


@pytest.mark.parametrize(("loss_type", "sft_weight"), [("dpo", 0.5), ("ipo", 0.0), ("simpo", 0.2)])
def test_online_dpo_budgets_give_the_one_pass_gradient(
    tiny_policy_dir, reference_dir, tmp_path, loss_type, sft_weight
):
    """Online DPO on pairs of different lengths (3 offline, up to 4 from the rollout), 4 pairs per step:
    every step's gradient, grad norm and loss metrics are the same under every budget (sigmoid DPO with
    the RPO SFT term, IPO, reference-free SimPO with the SFT term). A budget of 1 runs a pair per
    micro-batch, padded as collate_preference pads it (both sequences to the longer one: the padding share
    by hand); 4 × the longest pair's longer sequence runs more than one micro-batch in the step holding
    it and at least two pairs in each (so an unscaled sum of the micro-batch losses would not match)."""
    offline = [
        {"prompt": SET_PROMPTS[i], "chosen": " ok" * (1 + 3 * i), "rejected": " no" * (2 + i)}
        for i in range(3)
    ]
    (tmp_path / "offline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in offline))
    module = OnlineDPOModule(
        policy=str(tiny_policy_dir), reward=lambda p, r: [float(len(x)) for x in r], loss_type=loss_type,
        sft_weight=sft_weight, reference=str(reference_dir),  # SimPO reads none
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=12), samples_per_prompt=3),
        minibatches=Minibatches(size=4, shuffle=False), pairs_from="newest",
        offline_pairs=str(tmp_path / "offline.jsonl"), train_max_length=64, train_max_prompt_length=32,
    )  # fmt: skip
    module.rollout.setup(module.policy, module.tokenizer)
    recorder = attach(module, module.policy)[0]
    encoded = spy_encoded(module)
    trajectory, _ = module.make_trajectory(module.rollout.collect(SET_PROMPTS, module.reward))
    results = run_budgets(module, recorder, trajectory, [None])
    examples = encoded[-1]
    assert len(examples) >= 5 and len(results[None][0]) == -(-len(examples) // 4)
    longest = max(e.length for e in examples)
    results |= run_budgets(module, recorder, trajectory, [1, 4 * longest, 10_000])
    keys = ["dpo/grad_norm", "dpo/loss", "dpo/rewards/margin", "dpo/logps/chosen"]
    assert_budgets_agree(results, keys + (["dpo/sft_loss", "dpo/preference_loss"] if sft_weight else []))
    steps = len(results[None][0])
    real = sum(len(e.chosen.input_ids) + len(e.rejected.input_ids) for e in examples)
    assert results[1][2] == {
        "perf/microbatches": len(examples) / steps,
        "perf/padding_share": pytest.approx(1 - real / sum(2 * e.length for e in examples), abs=1e-12),
    }
    assert 1 < results[4 * longest][2]["perf/microbatches"] <= len(examples) / 2 / steps + 1
    assert results[10_000][2]["perf/microbatches"] == 1.0


def test_online_rrhf_budgets_give_the_one_pass_gradient(tiny_policy_dir, tmp_path):
    """Online RRHF on 4 prompts with response sets of 3, 5, 3 and 4 responses (samples plus extra
    responses), all 4 prompts in one step: the gradient, grad norm and loss metrics are the same under
    every budget. A budget of 1 runs a prompt per micro-batch, padded as the stage pads a set (its
    responses × its longest sequence: the padding share by hand); 2 × the largest set's padded tokens runs
    more than one micro-batch and fewer than one per prompt."""
    extras = [
        {"prompt": SET_PROMPTS[1], "responses": [" a", " a b c d e f g h"]},
        {"prompt": SET_PROMPTS[3], "responses": [" x y x y"]},
    ]
    (tmp_path / "extra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in extras))
    module = OnlineRRHFModule(
        policy=str(tiny_policy_dir), reward=lambda p, r: [float(len(x) % 7) for x in r],
        rollout=RolloutLoop(sampling=SamplingParams(max_new_tokens=12), samples_per_prompt=3),
        minibatches=Minibatches(size=4, steps=1, shuffle=False), extra_responses=str(tmp_path / "extra.jsonl"),
        train_max_length=64, train_max_prompt_length=32,
    )  # fmt: skip
    module.rollout.setup(module.policy, module.tokenizer)
    recorder = attach(module, module.policy)[0]
    sets = []
    response_sets = module.response_sets
    module.response_sets = lambda trajectory: sets.append(response_sets(trajectory)) or sets[-1]
    trajectory, _ = module.make_trajectory(module.rollout.collect(SET_PROMPTS, module.reward))
    results = run_budgets(module, recorder, trajectory, [None])
    encoded = sets[-1][0]
    assert [len(s) for s in encoded] == [3, 5, 3, 4] and len(results[None][0]) == 1
    padded = [len(s) * max(len(e.input_ids) for e in s) for s in encoded]
    middle = 2 * max(padded)
    results |= run_budgets(module, recorder, trajectory, [1, middle, 10_000])
    assert_budgets_agree(results, ["rrhf/grad_norm", "rrhf/loss", "rrhf/rank_loss", "rrhf/sft_loss"])
    real = sum(len(e.input_ids) for s in encoded for e in s)
    assert results[1][2] == {
        "perf/microbatches": 4.0,
        "perf/padding_share": pytest.approx(1 - real / sum(padded), abs=1e-12),
    }
    assert 1 < results[middle][2]["perf/microbatches"] < 4
    assert results[10_000][2]["perf/microbatches"] == 1.0
