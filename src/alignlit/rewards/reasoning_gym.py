"""``reasoning-gym`` tasks as verifiable rewards, single-turn environments and a prompt DataModule (the
``env`` extra).

A task is one of reasoning-gym's procedural datasets (``basic_arithmetic``, ``chain_sum``, ``leg_counting``,
... ``reasoning_gym.factory.DATASETS``) drawn with a seed: :class:`ReasoningGymTask` holds its train and
validation entries (one draw of ``size + val_size`` items with ``seed``, the first ``size`` for training:
reasoning-gym seeds item ``i`` with ``seed + i``, so two draws with nearby seeds would share items), the
prompt format, and the answer check (the dataset's own ``score_answer`` on the answer extracted).

A small task space draws the same question more than once: the draw's repeats are counted and printed
(training keeps them: they are the task's distribution), and a validation question that is also a
training question is removed from validation, counted and printed (validation measures questions not
trained on); a validation draw left empty is refused.

- :class:`ReasoningGymDataModule`: a :class:`~alignlit.data.PromptDataModule` whose prompts are the
  task's questions (no file);
- :class:`ReasoningGymReward`: ``(prompts, responses) -> (N,)`` the scores;
- :class:`ReasoningGymEnvironment`: the one-step environment (``reset`` → the prompt; ``step`` → the score,
  done), for ``rollout.environment``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from alignlit.data import PromptDataModule
from alignlit.rollout.environment import Step

PROMPT_TEMPLATE = "\n\nHuman: {question}\n\nAssistant:"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_REPORTED: set[str] = set()


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(
            f"reasoning-gym tasks need reasoning-gym: pip install 'alignlit[env]' ({err})"
        ) from err
    return reasoning_gym


def extract_answer(response: str) -> str:
    """The answer in a response: inside its last ``<answer>...</answer>`` if it has one, else the text
    after its last ``answer:`` / ``=``, else its last line (stripped)."""
    tagged = ANSWER.findall(response)
    if tagged:
        return tagged[-1].strip()
    for marker in ("answer:", "Answer:", "="):
        if marker in response:
            return response.rsplit(marker, 1)[1].strip()
    lines = [line for line in response.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class ReasoningGymTask:
    """A reasoning-gym dataset drawn with a seed: prompts, entries and the answer check.

    Args:
        dataset: the reasoning-gym dataset name.
        size: training questions (the draw's first ``size`` items).
        val_size: validation questions (its next ``val_size`` items; 0: none).
        seed: the draw's seed.
        config: the dataset's own options (e.g. ``{min_terms: 2, max_terms: 3}``).
        prompt_template: the prompt, from ``{question}``.
    """

    def __init__(
        self,
        dataset: str,
        size: int = 1000,
        val_size: int = 100,
        seed: int = 0,
        config: dict[str, Any] | None = None,
        prompt_template: str = PROMPT_TEMPLATE,
    ):
        rg = _reasoning_gym()
        if size < 1 or val_size < 0:
            raise ValueError(f"ReasoningGymTask: size >= 1 and val_size >= 0, got {size}, {val_size}")
        self.name, self.prompt_template = dataset, prompt_template
        self.dataset = rg.create_dataset(dataset, size=size + val_size, seed=seed, **dict(config or {}))
        self.train = [self.dataset[i] for i in range(size)]
        drawn_val = [self.dataset[i] for i in range(size, size + val_size)]
        trained = {self.prompt(entry) for entry in self.train}
        self.val = [entry for entry in drawn_val if self.prompt(entry) not in trained]
        self.counts = {
            "train": size,
            "train_unique": len(trained),
            "val_drawn": val_size,
            "val_in_train": val_size - len(self.val),
            "val": len(self.val),
            "val_unique": len({self.prompt(entry) for entry in self.val}),
        }
        """The draw's sizes, repeats and the validation questions removed as training questions."""
        if val_size and not self.val:
            raise ValueError(
                f"ReasoningGymTask {dataset!r} (seed {seed}, config {config}): all {val_size} validation "
                f"questions are also training questions (the task has few distinct questions: "
                f"{len(trained)} in {size} draws); widen the dataset's config or set val_size 0"
            )
        self._report(seed)
        self.entries: dict[str, dict] = {}
        for entry in self.train + self.val:
            self.entries.setdefault(self.prompt(entry), entry)

    def _report(self, seed: int) -> None:
        """Print the draw's repeats and the validation questions removed (once per task and seed)."""
        c = self.counts
        if c["train_unique"] == c["train"] and not c["val_in_train"] and c["val_unique"] == c["val"]:
            return
        line = (
            f"alignlit: reasoning-gym {self.name} (seed {seed}): {c['train']} training questions drawn, "
            f"{c['train_unique']} distinct ({c['train'] - c['train_unique']} repeats)"
        )
        if c["val_drawn"]:
            line += (
                f"; {c['val_in_train']} of {c['val_drawn']} validation questions are training questions and "
                f"were removed from validation, {c['val']} left ({c['val_unique']} distinct)"
            )
        if line not in _REPORTED:
            _REPORTED.add(line)
            print(line, flush=True)

    def prompt(self, entry: dict) -> str:
        return self.prompt_template.format(question=entry["question"])

    def prompts(self, split: str = "train") -> list[str]:
        return [self.prompt(entry) for entry in (self.train if split == "train" else self.val)]

    def score(self, prompt: str, response: str) -> float:
        """The dataset's ``score_answer`` of the response's extracted answer (KeyError for another prompt)."""
        if prompt not in self.entries:
            raise KeyError(f"{self.name}: prompt {prompt!r:.80} is not one of this task's questions")
        return float(self.dataset.score_answer(answer=extract_answer(response), entry=self.entries[prompt]))


class ReasoningGymReward:
    """A reasoning-gym task's answer check as a reward, ``(prompts, responses) -> (N,)`` (see
    :class:`ReasoningGymTask` for the arguments; use the DataModule's)."""

    def __init__(
        self,
        dataset: str,
        size: int = 1000,
        val_size: int = 100,
        seed: int = 0,
        config: dict[str, Any] | None = None,
        prompt_template: str = PROMPT_TEMPLATE,
    ):
        self.task = ReasoningGymTask(dataset, size, val_size, seed, config, prompt_template)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"ReasoningGymReward: {len(prompts)} prompts but {len(responses)} responses")
        return torch.tensor([self.task.score(p, r) for p, r in zip(prompts, responses)], dtype=torch.float32)


class ReasoningGymEnvironment:
    """A reasoning-gym task as a single-turn verifiable environment: ``reset`` shows the prompt, ``step``
    scores the answer and ends the episode (see :class:`ReasoningGymTask` for the arguments)."""

    def __init__(
        self,
        dataset: str,
        size: int = 1000,
        val_size: int = 100,
        seed: int = 0,
        config: dict[str, Any] | None = None,
        prompt_template: str = PROMPT_TEMPLATE,
    ):
        self.task = ReasoningGymTask(dataset, size, val_size, seed, config, prompt_template)
        self.prompt = ""

    def reset(self, prompt: str, *, seed: int) -> str:
        self.prompt = prompt
        return prompt

    def step(self, response: str) -> Step:
        return Step("", self.task.score(self.prompt, response), True)


class ReasoningGymDataModule(PromptDataModule):
    """Prompts drawn from a reasoning-gym task with a seed (train: ``size`` questions, validation:
    ``val_size``); the other arguments are :class:`~alignlit.data.PromptDataModule`'s (``batch_size``,
    ``eval_batch_size``, ``max_prompt_length``, ...)."""

    def __init__(
        self,
        dataset: str,
        size: int = 1000,
        val_size: int = 100,
        task_seed: int = 0,
        config: dict[str, Any] | None = None,
        prompt_template: str = PROMPT_TEMPLATE,
        **kwargs,
    ):
        task = ReasoningGymTask(dataset, size, val_size, task_seed, config, prompt_template)
        val = [{"prompt": p} for p in task.prompts("val")] or None
        super().__init__(records=[{"prompt": p} for p in task.prompts("train")], val_records=val, **kwargs)
        # save_hyperparameters also read this class's `dataset` (the task's name), which the base class
        # would take for a `datasets.load_dataset` spec: the prompts are the records, the name is the task's
        self.hparams["dataset"] = None
        self.hparams["task_dataset"] = dataset
        self.task = task
