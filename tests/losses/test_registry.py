"""The preference-loss registry: containers, the entries (hinge, SimPO, SLiC against hand-computed values;
dpo/ipo against the sum-level functions), registration, resolution of config values, and errors."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from alignlit.losses import (
    PREFERENCE_LOSSES,
    PairLogps,
    ReferenceLogps,
    dpo_loss,
    ipo_loss,
    preference_loss,
    register_preference_loss,
)

PAD = -100.0  # garbage in padding positions: a loss that reads it gives a visibly wrong value


def pair(chosen: list[list[float]], rejected: list[list[float]], dtype=torch.float64) -> PairLogps:
    """PairLogps from per-token log-prob lists, right-padded with PAD (mask False)."""

    def pad(rows):
        width = max(len(r) for r in rows)
        values = torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=dtype)
        mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
        return values, mask

    return PairLogps(*pad(chosen), *pad(rejected))


def reference(chosen: list[float], rejected: list[float]) -> ReferenceLogps:
    return ReferenceLogps(
        torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64)
    )


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


@pytest.fixture
def registry_cleanup():
    """Names registered by a test are removed afterwards."""
    before = set(PREFERENCE_LOSSES)
    yield
    for name in set(PREFERENCE_LOSSES) - before:
        del PREFERENCE_LOSSES[name]


# ---------------------------------------------------------------------- containers
def test_pair_logps_sums_lengths_and_means_ignore_padding():
    """chosen rows [-1, -2, -3] and [-4]: sums (-6, -4), lengths (3, 1), means (-2, -4); the PAD values
    in the masked positions do not enter."""
    p = pair([[-1.0, -2.0, -3.0], [-4.0]], [[-2.0, -4.0], [-1.0, -1.0, -1.0]])
    assert p.chosen_sum.tolist() == [-6.0, -4.0]
    assert p.rejected_sum.tolist() == [-6.0, -3.0]
    assert p.chosen_length.tolist() == [3, 1] and p.rejected_length.tolist() == [2, 3]
    assert p.chosen_mean.tolist() == [-2.0, -4.0] and p.rejected_mean.tolist() == [-3.0, -1.0]
    assert len(p) == 2
    ref = p.as_reference()
    assert ref.chosen_sum.tolist() == [-6.0, -4.0] and ref.rejected_sum.tolist() == [-6.0, -3.0]


def test_container_errors_name_the_field():
    values, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"PairLogps.chosen must have shape \(B, L\), got \(3,\)"):
        PairLogps(torch.zeros(3), mask, values, mask)
    with pytest.raises(
        ValueError,
        match=r"PairLogps.rejected has shape \(2, 3\) but PairLogps.rejected_mask has shape \(2, 2\)",
    ):
        PairLogps(values, mask, values, mask[:, :2])
    with pytest.raises(TypeError, match=r"PairLogps.chosen_mask must be a bool tensor, got torch.float32"):
        PairLogps(values, mask.float(), values, mask)
    with pytest.raises(ValueError, match=r"PairLogps.chosen has 2 rows but PairLogps.rejected has 1"):
        PairLogps(values, mask, values[:1], mask[:1])
    with pytest.raises(ValueError, match=r"the rejected responses at batch indices \[1\] have no token"):
        _ = pair([[-1.0], [-1.0]], [[-1.0], []]).rejected_mean
    with pytest.raises(ValueError, match=r"ReferenceLogps.chosen_sum must have shape \(B,\), got \(2, 1\)"):
        ReferenceLogps(torch.zeros(2, 1), torch.zeros(2))
    with pytest.raises(
        ValueError,
        match=r"ReferenceLogps.chosen_sum has shape \(2,\) but ReferenceLogps.rejected_sum has shape \(3,\)",
    ):
        ReferenceLogps(torch.zeros(2), torch.zeros(3))


# ---------------------------------------------------------------------- entries
def test_simpo_by_hand():
    """β = 2, γ = 0.5. Pair 1: means ℓ_w/|y_w| = -6/3 = -2, ℓ_l/|y_l| = -6/2 = -3,
    h = 2·(-2 - -3) - 0.5 = 1.5, -log σ(1.5) = softplus(-1.5) = 0.2014133 (on sums the pair would tie).
    Pair 2: means -4/1 = -4 and -3/3 = -1, h = 2·(-3) - 0.5 = -6.5, softplus(6.5) = 6.5015023.
    Loss (0.2014133 + 6.5015023)/2 = 3.3514578. Rewards β·mean: chosen (-4, -8) -> -6, rejected (-6, -2)
    -> -4; margins (2, -6): mean -2, accuracy 1/2. ∂L/∂(each chosen token of pair 1) =
    ½·(-σ(-1.5))·β/|y_w| = ½·(-0.1824255)·(2/3) = -0.0608085; padding gets 0."""
    p = pair([[-1.0, -2.0, -3.0], [-4.0]], [[-2.0, -4.0], [-1.0, -1.0, -1.0]])
    chosen = p.chosen.clone().requires_grad_(True)
    p = PairLogps(chosen, p.chosen_mask, p.rejected, p.rejected_mask)
    loss, metrics = PREFERENCE_LOSSES["simpo"].fn(p, None, beta=2.0, gamma=0.5)
    assert loss.item() == pytest.approx(3.3514578, abs=1e-7)
    assert (softplus(-1.5) + softplus(6.5)) / 2 == pytest.approx(3.3514578, abs=1e-7)
    assert metrics["rewards/chosen"].item() == pytest.approx(-6.0)
    assert metrics["rewards/rejected"].item() == pytest.approx(-4.0)
    assert metrics["rewards/margin"].item() == pytest.approx(-2.0)
    assert metrics["rewards/accuracy"].item() == pytest.approx(0.5)
    assert metrics["logps/chosen"].item() == pytest.approx(-5.0)  # mean of sums (-6, -4)
    loss.backward()
    assert chosen.grad[0].tolist() == pytest.approx([-0.0608085] * 3, abs=1e-7)
    assert chosen.grad[1, 1:].abs().sum().item() == 0.0  # padding


def test_simpo_margin_gamma_shifts_the_logit():
    """One pair with equal means (h = -γ): γ = 0 gives ln 2; γ = 1 gives softplus(1) = 1.3132617."""
    p = pair([[-1.0, -1.0]], [[-1.0]])
    assert PREFERENCE_LOSSES["simpo"].fn(p, None, gamma=0.0)[0].item() == pytest.approx(math.log(2))
    assert PREFERENCE_LOSSES["simpo"].fn(p, None, gamma=1.0)[0].item() == pytest.approx(1.3132617, abs=1e-7)


def test_slic_by_hand():
    """δ = 1. Sums (ℓ_w, ℓ_l): (-6, -6) -> max(0, 1 + 6 - 6) = 1; (-4, -3) -> max(0, 1 + 4 - 3) = 2;
    (-1, -5) -> max(0, 1 + 1 - 5) = 0. Mean 1. The third pair is past the margin: zero gradient.
    Rewards are the sums: chosen mean -11/3, rejected mean -14/3, accuracy 1/3 (only -1 > -5)."""
    p = pair([[-1.0, -2.0, -3.0], [-4.0], [-1.0]], [[-2.0, -4.0], [-1.0, -1.0, -1.0], [-5.0]])
    chosen = p.chosen.clone().requires_grad_(True)
    p = PairLogps(chosen, p.chosen_mask, p.rejected, p.rejected_mask)
    loss, metrics = PREFERENCE_LOSSES["slic"].fn(p, None, delta=1.0)
    assert loss.item() == pytest.approx(1.0)
    assert metrics["rewards/chosen"].item() == pytest.approx(-11 / 3)
    assert metrics["rewards/rejected"].item() == pytest.approx(-14 / 3)
    assert metrics["rewards/accuracy"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert chosen.grad[2, 0].item() == 0.0
    assert chosen.grad[0].tolist() == pytest.approx([-1 / 3] * 3)  # ∂/∂ℓ_w of (1/3)·(δ - ℓ_w + ℓ_l)
    # δ = 0.5 moves the first pair to 0.5 and the second to 1.5: mean (0.5 + 1.5 + 0)/3 = 2/3
    assert PREFERENCE_LOSSES["slic"].fn(p, None, delta=0.5)[0].item() == pytest.approx(2 / 3)


def test_hinge_by_hand():
    """β = 0.5, h = β·((ℓ_w - r_w) - (ℓ_l - r_l)). Policy (-1, -3) vs reference (-2, -2): h = 0.5·(1 + 1) = 1,
    max(0, 1 - 1) = 0. Policy (-2, -2) vs (-1, -3): h = 0.5·(-1 - 1) = -1, max(0, 2) = 2. Policy (-1.5, -2)
    vs (-2, -2): h = 0.5·0.5 = 0.25, 0.75. Mean (0 + 2 + 0.75)/3 = 0.9166667. Margin mean (1 - 1 + 0.25)/3
    = 0.0833333; accuracy 2/3."""
    p = pair([[-1.0], [-2.0], [-0.5, -1.0]], [[-3.0], [-1.0, -1.0], [-2.0]])
    ref = reference([-2.0, -1.0, -2.0], [-2.0, -3.0, -2.0])
    loss, metrics = PREFERENCE_LOSSES["hinge"].fn(p, ref, beta=0.5)
    assert loss.item() == pytest.approx(0.9166667, abs=1e-7)
    assert metrics["rewards/margin"].item() == pytest.approx(0.0833333, abs=1e-7)
    assert metrics["rewards/accuracy"].item() == pytest.approx(2 / 3)


def test_dpo_and_ipo_entries_are_the_sum_level_losses():
    """The registry's dpo/ipo read the policy's sums and call dpo_loss/ipo_loss: same values."""
    p = pair([[-1.0, -0.5], [-2.0]], [[-3.0], [-0.2, -0.3, -0.1]])
    ref = reference([-2.0, -1.0], [-2.0, -1.5])
    sums = (p.chosen_sum, p.rejected_sum, ref.chosen_sum, ref.rejected_sum)
    got, _ = PREFERENCE_LOSSES["dpo"].fn(p, ref, beta=0.3, label_smoothing=0.1)
    assert got.item() == dpo_loss(*sums, beta=0.3, label_smoothing=0.1)[0].item()
    got, _ = PREFERENCE_LOSSES["ipo"].fn(p, ref, beta=0.3)
    assert got.item() == ipo_loss(*sums, beta=0.3)[0].item()


def test_entries_validate_their_arguments():
    p = pair([[-1.0]], [[-2.0]])
    ref = reference([-1.0], [-1.0])
    with pytest.raises(ValueError, match="beta must be > 0, got 0"):
        PREFERENCE_LOSSES["simpo"].fn(p, None, beta=0.0)
    with pytest.raises(ValueError, match=r"gamma must be >= 0, got -0.1"):
        PREFERENCE_LOSSES["simpo"].fn(p, None, gamma=-0.1)
    with pytest.raises(ValueError, match="gamma must be >= 0, got nan"):
        PREFERENCE_LOSSES["simpo"].fn(p, None, gamma=float("nan"))
    with pytest.raises(ValueError, match="delta must be >= 0, got -1"):
        PREFERENCE_LOSSES["slic"].fn(p, None, delta=-1.0)
    with pytest.raises(ValueError, match="beta must be > 0, got -1"):
        PREFERENCE_LOSSES["hinge"].fn(p, ref, beta=-1.0)
    with pytest.raises(
        ValueError, match=r"policy_chosen_logps has shape \(1,\) but ref_chosen_logps has shape \(2,\)"
    ):
        PREFERENCE_LOSSES["hinge"].fn(p, reference([-1.0, -1.0], [-1.0, -1.0]), beta=0.1)


# ---------------------------------------------------------------------- registry and resolution
def test_builtin_names_and_reference_needs():
    assert {
        name: e.needs_reference
        for name, e in PREFERENCE_LOSSES.items()
        if name in {"dpo", "ipo", "hinge", "simpo", "slic"}
    } == {
        "dpo": True,
        "ipo": True,
        "hinge": True,
        "simpo": False,
        "slic": False,
    }


def test_preference_loss_binds_and_checks_arguments():
    bound = preference_loss("simpo", {"beta": 2.5})
    assert (bound.name, dict(bound.args), bound.needs_reference) == ("simpo", {"beta": 2.5}, False)
    with pytest.raises(
        ValueError, match=r"loss_type 'kto' is not a registered preference loss \(one of \['dpo'"
    ):
        preference_loss("kto")
    with pytest.raises(
        ValueError, match=r"loss_args: preference loss 'slic' has no argument 'beta' \(its arguments: delta\)"
    ):
        preference_loss("slic", {"beta": 1.0})
    with pytest.raises(ValueError, match="beta must be > 0, got 0"):  # a value checked at binding time
        preference_loss("hinge", {"beta": 0})
    with pytest.raises(ValueError, match=r"loss_type 'no_such_module.loss': cannot import it"):
        preference_loss("no_such_module.loss")


def test_reference_free_loss_receives_none_and_reference_loss_requires_one(registry_cleanup):
    seen = []

    @register_preference_loss("test_spy", needs_reference=False)
    def spy(policy, reference):
        seen.append(reference)
        return policy.chosen_sum.mean(), {}

    bound = preference_loss("test_spy")
    bound(pair([[-1.0]], [[-2.0]]), reference([-1.0], [-1.0]))
    assert seen[-1] is None
    with pytest.raises(ValueError, match="preference loss 'dpo' needs reference log-probs, got None"):
        preference_loss("dpo")(pair([[-1.0]], [[-2.0]]), None)
    with pytest.raises(ValueError, match="reference log-probs have 2 pairs but the policy's have 1"):
        preference_loss("dpo")(pair([[-1.0]], [[-2.0]]), reference([-1.0, -1.0], [-1.0, -1.0]))


def test_registration_errors(registry_cleanup):
    with pytest.raises(ValueError, match="preference loss 'dpo' is already registered"):
        register_preference_loss("dpo")(lambda policy, reference: None)
    with pytest.raises(
        TypeError, match=r"must have the signature fn\(policy, reference, \*, <hyperparameters>\)"
    ):

        @register_preference_loss("test_bad")
        def bad(policy, *, beta=0.1):
            return policy.chosen_sum.mean(), {}


def test_returned_values_are_checked_and_metrics_detached(registry_cleanup):
    @register_preference_loss("test_float", needs_reference=False)
    def returns_float(policy, reference):
        return 1.0, {}

    with pytest.raises(TypeError, match=r"preference loss 'test_float' must return \(loss, metrics\)"):
        preference_loss("test_float")

    @register_preference_loss("test_grad", needs_reference=False)
    def grad_metric(policy, reference):
        value = policy.chosen_sum.mean()
        return value, {"value": value}

    p = pair([[-1.0]], [[-2.0]])
    p = PairLogps(p.chosen.clone().requires_grad_(True), p.chosen_mask, p.rejected, p.rejected_mask)
    loss, metrics = preference_loss("test_grad")(p, None)
    assert loss.requires_grad and not metrics["value"].requires_grad


def test_dotted_path_imports_and_finds_a_registered_function(tmp_path, monkeypatch, registry_cleanup):
    """A researcher's module registers its loss on import; `loss_type: mylosses.length_margin` resolves it."""
    (tmp_path / "mylosses.py").write_text(
        "from alignlit.losses import register_preference_loss\n"
        "@register_preference_loss('length_margin', needs_reference=False)\n"
        "def length_margin(policy, reference, *, scale: float = 1.0):\n"
        "    return scale * (policy.rejected_mean - policy.chosen_mean).mean(), {}\n"
        "def unregistered(policy, reference):\n"
        "    return policy.chosen_sum.mean(), {}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mylosses", raising=False)
    bound = preference_loss("mylosses.length_margin", {"scale": 2.0})
    assert (bound.name, bound.needs_reference) == ("length_margin", False)
    # means -1 and -2: 2·(-2 - -1) = -2
    assert bound(pair([[-1.0]], [[-2.0]]), None)[0].item() == pytest.approx(-2.0)
    assert preference_loss("length_margin").name == "length_margin"  # registered by the import
    with pytest.raises(ValueError, match=r"loss_type 'mylosses.unregistered' is not registered"):
        preference_loss("mylosses.unregistered")
    monkeypatch.delitem(sys.modules, "mylosses")


class ScaledSLiC:
    """A loss object: SLiC's hinge times a weight, reference-free."""

    needs_reference = False

    def __init__(self, weight: float = 1.0):
        if weight <= 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        self.weight = weight

    def __call__(self, policy, reference):
        assert reference is None
        loss = self.weight * torch.relu(1.0 - policy.chosen_sum + policy.rejected_sum).mean()
        return loss, {"hinge": loss}


def test_loss_objects_are_bound_as_they_are():
    """(-1, -2): max(0, 1 - 1) = 0; (-2, -1): max(0, 1 + 1) = 2; mean 1, times weight 3 = 3."""
    bound = preference_loss(ScaledSLiC(3.0))
    assert bound.name == "tests.losses.test_registry.ScaledSLiC" and not bound.needs_reference
    assert bound(pair([[-1.0], [-2.0]], [[-2.0], [-1.0]]), reference([0.0, 0.0], [0.0, 0.0]))[0].item() == 3.0
    with pytest.raises(ValueError, match=r"loss_args \['beta'\] apply to registered losses only"):
        preference_loss(ScaledSLiC(), {"beta": 0.1})
    with pytest.raises(TypeError, match="loss_type must be a name or a callable loss object, got int"):
        preference_loss(3)


def test_orpo_by_hand():
    """λ = 0.5. Pair 1: ℓ̄_w = -2/2 = -1, ℓ̄_l = -2/1 = -2; logodds = ℓ̄ - log(1 - e^ℓ̄):
    -1 - ln(1 - e^-1) = -0.5413249, -2 - ln(1 - e^-2) = -1.8545865, ratio 1.3132617,
    -log σ(1.3132617) = ln(1 + e^-1.3132617) = 0.2381830. Pair 2 (chosen worse): ℓ̄_w = -3, ℓ̄_l = -0.5:
    -3 - ln(1 - e^-3) = -2.9489313, -0.5 - ln(1 - e^-0.5) = 0.4327521, ratio -3.3816829,
    softplus(3.3816829) = 3.4151082. Loss 0.5·(0.2381830 + 3.4151082)/2."""

    def logodds(m):
        return m - math.log(1 - math.exp(m))

    p = pair([[-1.0, -1.0], [-3.0]], [[-2.0], [-0.5, -0.5]])
    loss, metrics = preference_loss("orpo", {"beta": 0.5})(p, None)
    r1 = logodds(-1.0) - logodds(-2.0)
    r2 = logodds(-3.0) - logodds(-0.5)
    assert r1 == pytest.approx(1.3132617, abs=1e-6) and r2 == pytest.approx(-3.3816829, abs=1e-6)
    want = 0.5 * (softplus(-r1) + softplus(-r2)) / 2
    assert loss.item() == pytest.approx(want, abs=1e-9)
    assert softplus(-r1) == pytest.approx(0.2381830, abs=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.5 * (-1.0 + -3.0) / 2)
    assert metrics["rewards/accuracy"].item() == pytest.approx(0.5)
    assert metrics["orpo/log_odds_ratio"].item() == pytest.approx((r1 + r2) / 2)
    assert not PREFERENCE_LOSSES["orpo"].needs_reference
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss("orpo", {"beta": 0.0})
    certain = pair([[0.0]], [[-1.0]])  # a chosen response of probability 1: clamped, finite
    assert torch.isfinite(preference_loss("orpo", {"beta": 1.0})(certain, None)[0])
