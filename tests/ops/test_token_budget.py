"""Token-budget micro-batches (alignlit.ops.token_budget_microbatches) and the loss shares that make their
accumulated gradient the whole minibatch's (alignlit.losses.aggregation_share), for every aggregation and
several budgets."""

from __future__ import annotations

import pytest
import torch

from alignlit.losses import LOSS_AGGREGATIONS, aggregation_share, policy_gradient_loss, register_aggregation
from alignlit.ops import token_budget_microbatches


def test_packing_by_hand():
    # lengths 5, 2, 9, 3, 9 with budget 18: sorted 9(2), 9(4), 5(0), 3(3), 2(1)
    # [2, 4]: 2 x 9 = 18 fits; adding 5 -> 3 x 9 = 27 > 18: new batch [0] (5); + 3 -> 2 x 5 = 10;
    # + 2 -> 3 x 5 = 15 <= 18: [0, 3, 1]
    batches = token_budget_microbatches([5, 2, 9, 3, 9], 18)
    assert [b.tolist() for b in batches] == [[2, 4], [0, 1, 3]]
    # a row over the budget stands alone; every row exactly once at any budget
    assert [b.tolist() for b in token_budget_microbatches([30, 2, 2], 10)] == [[0], [1, 2]]
    for budget in (1, 4, 9, 17, 100):
        rows = torch.cat(token_budget_microbatches([5, 2, 9, 3, 9, 0], budget)).sort().values
        assert rows.tolist() == list(range(6))
    assert len(token_budget_microbatches([5, 2, 9, 3, 9], 1000)) == 1
    with pytest.raises(ValueError, match="budget must be >= 1"):
        token_budget_microbatches([1], 0)


def test_packing_items_of_several_sequences():
    # items of 2, 3, 1, 2 sequences, longest 9, 4, 5, 9, budget 40: sorted 9(0), 9(3), 5(2), 4(1)
    # [0, 3]: 4 sequences x 9 = 36; + item 2 -> 5 x 9 = 45 > 40: [2] (1 x 5); + item 1 -> 4 x 5 = 20: [1, 2]
    batches = token_budget_microbatches([9, 4, 5, 9], 40, sizes=[2, 3, 1, 2])
    assert [b.tolist() for b in batches] == [[0, 3], [1, 2]]
    assert [b.tolist() for b in token_budget_microbatches([9, 4, 5, 9], 40)] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="sizes must be 2 counts >= 1"):
        token_budget_microbatches([1, 2], 10, sizes=[1, 0])


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
@pytest.mark.parametrize("budget", [6, 12, 25, 1000])
def test_accumulated_gradient_equals_the_minibatch_gradient(aggregation, budget):
    g = torch.Generator().manual_seed(0)
    n, t = 7, 6
    lengths = torch.tensor([6, 1, 4, 0, 6, 3, 2])  # row 3 has no loss token
    mask = torch.arange(t)[None, :] < lengths[:, None]
    logits = torch.randn(n, t, generator=g, requires_grad=True)
    old = (torch.randn(n, t, generator=g) * 0.1 - 1.0) * mask
    adv = torch.randn(n, t, generator=g) * mask
    ref = (torch.randn(n, t, generator=g) * 0.1 - 1.0) * mask
    entropy = torch.rand(n, t, generator=g) * mask

    def loss_of(rows):
        lp = (torch.nn.functional.logsigmoid(logits[rows]) - 0.3) * mask[rows]
        loss, _ = policy_gradient_loss(
            lp, old[rows], adv[rows], mask[rows], clip_low=0.2, clip_high=0.28, aggregation=aggregation,
            max_length=t, ref_logprobs=ref[rows], kl_coef=0.1, kl_estimator="k3",
            entropy=entropy[rows] + 0 * lp, entropy_coef=0.01,
        )  # fmt: skip
        return loss

    full = loss_of(torch.arange(n))
    (want,) = torch.autograd.grad(full, logits)
    total = torch.zeros(())
    for rows in token_budget_microbatches(lengths + 3, budget):  # + a 3-token prompt per row
        share = aggregation_share(aggregation, mask[rows], mask)
        if share == 0:
            continue
        total = total + share * loss_of(rows)
    (got,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(total.detach(), full.detach(), atol=1e-6, rtol=1e-5)


def test_shares_by_hand_and_unknown_units_refused():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]]).bool()
    micro = mask[[0, 2]]
    assert aggregation_share("token_mean", micro, mask) == pytest.approx(2 / 6)
    assert aggregation_share("seq_mean_token_mean", micro, mask) == pytest.approx(1 / 3)
    assert aggregation_share("seq_mean_token_sum_norm", micro, mask) == pytest.approx(2 / 4)
    assert aggregation_share(LOSS_AGGREGATIONS["token_mean"], micro, mask) == pytest.approx(2 / 6)

    @register_aggregation("test_unitless_sum")
    def unitless(values, mask, *, max_length):
        return (values * mask).sum()

    try:
        with pytest.raises(ValueError, match="has no unit"):
            aggregation_share("test_unitless_sum", micro, mask)
    finally:
        LOSS_AGGREGATIONS.pop("test_unitless_sum")
