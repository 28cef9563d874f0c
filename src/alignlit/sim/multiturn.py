"""The simulated task with a second turn that matters: the environment answers a wrong answer with a hint.

An episode (:class:`SimHintEnvironment`, an alignlit environment: ``reset``/``step``)::

    \\n\\nHuman: sort c a d\\n\\nAssistant: a d c ok done        <- the model's first answer (wrong)
    \\n\\nHuman: copy a c d\\n\\nAssistant:                       <- the environment's hint (hint="answer")
     a c d                                                    <- the model's second answer

The first answer whose symbols are right (its words that are symbols equal the ideal answer; filler words
are not checked here, gold still penalises them) ends the episode, as does the last allowed attempt. Every hint costs ``turn_cost``, so the episode's gold is

    gold = g(x, final answer) - turn_cost · (turns - 1)

with ``g`` the task's gold reward (:meth:`~alignlit.sim.SimTask.gold_reward`). Step rewards make it up:
``-turn_cost`` for each answered-with-a-hint turn, ``g(x, final answer)`` at the end; so the episode's
return is its gold. :class:`SimEpisodeGold` computes the same gold from a transcript (``val/gold``).

Hints: ``"answer"`` shows the right answer as a copy request (the task's own ``copy`` prompt, a format
the SFT policy knows); ``"length"`` says how many symbols the answer has; ``"none"`` only says "wrong".
With ``tool=True`` the environment also offers a ``check(answer)`` tool (``right`` / ``wrong``; for
:class:`alignlit.rollout.ToolEnvironment`). One attempt is the single-turn task with gold as the reward.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from alignlit.sim.reward import load_sim
from alignlit.sim.task import ASSISTANT, HUMAN, SimTask

HINTS = {
    "answer": HUMAN + "copy{answer}" + ASSISTANT,
    "length": HUMAN + "wrong, the answer has {length} symbols" + ASSISTANT,
    "none": HUMAN + "wrong, try again" + ASSISTANT,
}
REPLY = re.compile(re.escape(HUMAN.strip("\n")) + r".*?" + re.escape(ASSISTANT.strip("\n")), re.S)


def _task(sim_dir: str | None) -> SimTask:
    return load_sim(sim_dir)[0] if sim_dir is not None else SimTask()


class SimHintEnvironment:
    """The simulated task as a multi-turn environment with hints (module docstring).

    Args:
        sim_dir: a ``alignlit sim make-data`` directory (its task); None: the default :class:`SimTask`.
        attempts: most answers per episode (1: the single-turn task).
        turn_cost: reward of each hint (the gold's cost per extra turn), >= 0.
        hint: ``"answer"``, ``"length"`` or ``"none"``.
        tool: offer the ``check(answer)`` tool.
    """

    def __init__(
        self,
        sim_dir: str | None = None,
        attempts: int = 2,
        turn_cost: float = 0.1,
        hint: Literal["answer", "length", "none"] = "answer",
        tool: bool = False,
    ):
        if attempts < 1 or turn_cost < 0 or hint not in HINTS:
            raise ValueError(
                f"SimHintEnvironment: attempts >= 1, turn_cost >= 0 and hint in {sorted(HINTS)}, got {attempts}, "
                f"{turn_cost}, {hint!r}"
            )
        self.sim_dir, self.attempts, self.turn_cost, self.hint, self.tool = (
            sim_dir,
            attempts,
            turn_cost,
            hint,
            tool,
        )
        self.task = _task(sim_dir)
        self.prompt, self.answer, self.attempt = "", "", 0

    def reset(self, prompt: str, *, seed: int) -> str:
        self.prompt, self.answer, self.attempt = prompt, self.task.ideal(prompt), 0
        return prompt

    def right(self, response: str) -> bool:
        """The answer's symbols are the ideal answer's (gold's correctness term is 1)."""
        symbols = [w for w in response.split() if len(w) == 1 and w in self.task.symbols]
        return symbols == self.answer.split()

    def step(self, response: str) -> tuple[str, float, bool]:
        self.attempt += 1
        if self.right(response) or self.attempt >= self.attempts:
            return "", self.task.gold_reward(self.prompt, response), True
        reply = HINTS[self.hint].format(answer=self.answer, length=len(self.answer.split()))
        return reply, -self.turn_cost, False

    def tools(self) -> dict[str, Callable[..., str]]:
        if not self.tool:
            return {}
        return {"check": lambda answer: "right" if self.right(str(answer)) else "wrong"}


def episode_gold(task: SimTask, prompt: str, transcript: str, turn_cost: float) -> tuple[float, int, str]:
    """``(gold, turns, final answer)`` of a transcript (model turns separated by the environment's
    ``Human: ... Assistant:`` replies)."""
    turns = REPLY.split(transcript)
    final = turns[-1]
    return task.gold_reward(prompt, final) - turn_cost * (len(turns) - 1), len(turns), final


class SimEpisodeGold:
    """The gold of :class:`SimHintEnvironment` episodes from their transcripts, ``(prompts, transcripts)
    -> (N,)``: ``g(x, final answer) - turn_cost · (turns - 1)`` (for ``gold:`` of an online stage).

    Args:
        sim_dir: a ``alignlit sim make-data`` directory; None: the default :class:`SimTask`.
        turn_cost: the environment's ``turn_cost``.
    """

    def __init__(self, sim_dir: str | None = None, turn_cost: float = 0.1):
        self.sim_dir, self.turn_cost = sim_dir, turn_cost
        self.task = _task(sim_dir)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"SimEpisodeGold: {len(prompts)} prompts but {len(responses)} transcripts")
        return torch.tensor(
            [episode_gold(self.task, p, r, self.turn_cost)[0] for p, r in zip(prompts, responses)],
            dtype=torch.float32,
        )
