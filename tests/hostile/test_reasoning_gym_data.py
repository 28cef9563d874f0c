"""Reasoning-gym data (issue 36): a draw from a small task space repeats questions
and puts training questions in validation, without a word. The repeats are now counted and printed, a
validation question that is a training question is removed (counted, printed), and a validation draw left
empty is refused. Expected values come from reasoning-gym's own draw, computed here independently."""

from __future__ import annotations

import pytest

rg = pytest.importorskip("reasoning_gym")

from alignlit.rewards.reasoning_gym import ReasoningGymDataModule, ReasoningGymTask  # noqa: E402

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TEMPLATE = "\n\nHuman: {question}\n\nAssistant:"


def reference(size: int, val_size: int, seed: int):
    data = rg.create_dataset("chain_sum", size=size + val_size, seed=seed, **SMALL)
    questions = [TEMPLATE.format(question=data[i]["question"]) for i in range(size + val_size)]
    return questions[:size], questions[size:]


def test_repeats_are_counted_and_validation_questions_seen_in_training_are_removed(capsys):
    train, val = reference(50, 10, 0)
    kept = [q for q in val if q not in set(train)]
    assert len(set(train)) < 50 and len(kept) < 10  # the case: repeats and an overlap (46 and 9 here)

    task = ReasoningGymTask("chain_sum", size=50, val_size=10, seed=0, config=SMALL)
    assert task.prompts("train") == train and task.prompts("val") == kept
    assert not set(task.prompts("val")) & set(task.prompts("train"))
    assert task.counts == {"train": 50, "train_unique": len(set(train)), "val_drawn": 10,
                           "val_in_train": 10 - len(kept), "val": len(kept), "val_unique": len(set(kept))}  # fmt: skip
    out = capsys.readouterr().out
    assert (
        f"alignlit: reasoning-gym chain_sum (seed 0): 50 training questions drawn, {len(set(train))} distinct "
        f"({50 - len(set(train))} repeats); {10 - len(kept)} of 10 validation questions are training questions "
        f"and were removed from validation, {len(kept)} left ({len(set(kept))} distinct)"
    ) in out

    dm = ReasoningGymDataModule("chain_sum", size=50, val_size=10, task_seed=0, config=SMALL, batch_size=2)
    dm.setup("fit")
    assert dm.val_prompts == kept and not set(dm.val_prompts) & set(dm.train_prompts)


def test_a_validation_draw_made_only_of_training_questions_is_refused():
    train, val = reference(500, 3, 0)
    assert set(val) <= set(train)
    with pytest.raises(
        ValueError, match=r"all 3 validation questions are also training questions .* set val_size 0"
    ):
        ReasoningGymTask("chain_sum", size=500, val_size=3, seed=0, config=SMALL)


def test_a_draw_without_repeats_prints_nothing(capsys):
    task = ReasoningGymTask("basic_arithmetic", size=20, val_size=5, seed=1)
    assert task.counts["train_unique"] == 20 and task.counts["val"] == 5
    assert "reasoning-gym" not in capsys.readouterr().out
