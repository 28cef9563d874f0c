"""The Trajectory's row selection, the Minibatches plan and the live PhaseDisplay of the online base."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from alignlit.modules import Minibatches, Trajectory
from alignlit.modules.online_parts import PhaseDisplay


def trajectory(loss_rows: list[list[bool]]) -> Trajectory:
    """A 3-sample trajectory (P = 2, T = 3) whose loss mask is ``loss_rows``; the other fields count rows."""
    n, t = len(loss_rows), len(loss_rows[0])
    rows = torch.arange(n, dtype=torch.float32)
    per_token = rows[:, None].expand(n, t).clone()
    return Trajectory(
        prompts=[f"p{i}" for i in range(n)], texts=[f"y{i}" for i in range(n)], finish_reasons=["stop"] * n, n=1,
        group=torch.arange(n), version=torch.zeros(n, dtype=torch.long),
        prompt_ids=torch.arange(2 * n).view(n, 2), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.arange(t * n).view(n, t), attention_mask=torch.ones(n, t, dtype=torch.bool),
        action_mask=torch.ones(n, t, dtype=torch.bool), loss_mask=torch.tensor(loss_rows),
        behaviour_logprobs=per_token, scores=rows, rewards=rows + 10, old_logprobs=per_token + 1,
    )  # fmt: skip


def test_select_takes_every_per_sample_field():
    traj = trajectory([[True, True, False], [False, False, False], [True, False, False]])
    picked = traj.select(torch.tensor([2, 0]))
    assert picked.prompts == ["p2", "p0"] and picked.texts == ["y2", "y0"] and len(picked) == 2
    assert picked.rewards.tolist() == [12.0, 10.0] and picked.old_logprobs[:, 0].tolist() == [3.0, 1.0]
    assert picked.response_ids.tolist() == [[6, 7, 8], [0, 1, 2]]
    assert picked.ref_logprobs is None and picked.n == 1
    kept = traj.with_loss_tokens()  # the row without a loss token leaves
    assert kept.prompts == ["p0", "p2"] and kept.loss_mask.sum().item() == 3
    full = trajectory([[True, False, False]] * 3)
    assert full.with_loss_tokens() is full


def test_minibatch_plan_counts_and_shuffles():
    """10 rows, size 4, 3 epochs: each epoch is a permutation of 0..9 cut as 4 + 4 + 2 (9 minibatches)."""
    generator = torch.Generator().manual_seed(0)
    batches = list(Minibatches(size=4, epochs=3).plan(10, generator))
    assert [len(b) for b in batches] == [4, 4, 2] * 3
    orders = [torch.cat(batches[3 * e : 3 * e + 3]).tolist() for e in range(3)]
    assert all(sorted(order) == list(range(10)) for order in orders)
    assert orders[0] != orders[1] or orders[1] != orders[2]  # shuffled per epoch
    plain = Minibatches(size=4, shuffle=False).plan(5, generator)
    assert [b.tolist() for b in plain] == [[0, 1, 2, 3], [4]]


def test_minibatch_steps_repeat_passes():
    """steps = 5 over 3 rows in minibatches of 2: passes 2 + 1, 2 + 1, then 2 of a third pass."""
    plain = Minibatches(size=2, steps=5, shuffle=False).plan(3, torch.Generator())
    assert [b.tolist() for b in plain] == [[0, 1], [2], [0, 1], [2], [0, 1]]
    generator = torch.Generator().manual_seed(1)
    shuffled = [b.tolist() for b in Minibatches(size=2, steps=5).plan(3, generator)]
    assert len(shuffled) == 5 and sorted(shuffled[0] + shuffled[1]) == [0, 1, 2]


def test_minibatch_plan_resumes_from_the_generator_state():
    """The stage saves its generator: a plan drawn after restoring it is the one an uninterrupted run draws."""
    generator = torch.Generator().manual_seed(7)
    list(Minibatches(size=2, epochs=2).plan(6, generator))
    state = generator.get_state()
    expected = [b.tolist() for b in Minibatches(size=2, epochs=2).plan(6, generator)]
    restored = torch.Generator()
    restored.set_state(state)
    assert [b.tolist() for b in Minibatches(size=2, epochs=2).plan(6, restored)] == expected


def test_bad_minibatches():
    with pytest.raises(ValueError, match="size and epochs must be >= 1"):
        Minibatches(size=0)
    with pytest.raises(ValueError, match=r"give epochs .* or steps"):
        Minibatches(epochs=2, steps=2)
    with pytest.raises(ValueError, match="cannot make minibatches of 0 rows"):
        list(Minibatches().plan(0, torch.Generator()))


def test_phase_display_sets_the_tqdm_description():
    """The live callback: Lightning's TQDM bar shows 'Epoch e [phase]'; without a bar nothing happens."""

    class Tqdm:
        def __init__(self):
            self.descriptions = []

        def set_description(self, text, refresh=True):
            self.descriptions.append(text)

    bar = TQDMProgressBar()
    bar._train_progress_bar = Tqdm()

    class Trainer:
        current_epoch = 2
        progress_bar_callback = bar

    PhaseDisplay().show(Trainer(), "rollout")
    PhaseDisplay().show(Trainer(), "train")
    assert bar.train_progress_bar.descriptions == ["Epoch 2 [rollout]", "Epoch 2 [train]"]
    Trainer.progress_bar_callback = None
    PhaseDisplay().show(Trainer(), "rollout")  # no bar: nothing to show, no error
