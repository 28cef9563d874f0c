"""The simulated task with a second turn that matters: the environment answers a wrong answer with a hint.

An episode (:class:`SimHintEnvironment`, an alignlit environment: ``reset``/``step``)::

    \\n\\nHuman: sort c a d\\n\\nAssistant: a d c ok done        <- the model's first answer (wrong)
    \\n\\nHuman: copy a c d\\n\\nAssistant:                       <- the environment's hint (hint="answer")
     a c d                                                    <- the model's second answer

The first answer whose symbols are right (its words that are symbols equal the ideal answer; filler words
are not checked here, gold still penalises them) ends the episode, as does the last allowed attempt. Every
hint costs ``turn_cost``, so the episode's gold is

    gold = score(x, final answer) - turn_cost · (turns - 1)

with ``score`` (:func:`final_score`) the task's gold reward ``g`` (:meth:`~alignlit.sim.SimTask.gold_reward`,
``correctness="partial"``) or ``g`` with its correctness term replaced by 1 for the right symbols and 0
otherwise (``"exact"``: a near miss earns nothing). Step rewards make it up: ``-turn_cost`` for each
answered-with-a-hint turn, the score at the end; so the episode's return is its gold. :class:`SimEpisodeGold`
computes the same gold from a transcript (``val/gold``).

A policy trained on single-turn demonstrations has never seen text after its own EOS and does not read a
hint; :func:`write_multiturn_sft` (``alignlit sim make-multiturn-data``) adds second-turn demonstrations
(prompt, wrong first answer, EOS, hint -> a demonstration of the right answer) to the SFT data.

Hints: ``"answer"`` shows the right answer as a copy request (the task's own ``copy`` prompt, a format
the SFT policy knows); ``"length"`` says how many symbols the answer has; ``"none"`` only says "wrong".
With ``tool=True`` the environment also offers a ``check(answer)`` tool (``right`` / ``wrong``; for
:class:`alignlit.rollout.ToolEnvironment`). One attempt is the single-turn task with gold as the reward.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch

from alignlit.data.records import read_records
from alignlit.sim.data import file_name, load_sim, write_jsonl
from alignlit.sim.task import ASSISTANT, HUMAN, VERBOSE_SUFFIXES, SimTask, edit_distance, format_response

HINTS = {
    "answer": HUMAN + "copy{answer}" + ASSISTANT,
    "length": HUMAN + "wrong, the answer has {length} symbols" + ASSISTANT,
    "none": HUMAN + "wrong, try again" + ASSISTANT,
}
CORRECTNESS = ("partial", "exact")
REPLY = re.compile(re.escape(HUMAN.strip("\n")) + r".*?" + re.escape(ASSISTANT.strip("\n")), re.S)


def _task(sim_dir: str | None) -> SimTask:
    return load_sim(sim_dir)[0] if sim_dir is not None else SimTask()


def answer_symbols(task: SimTask, response: str) -> list[str]:
    """The response's words that are symbols of the task (what gold's correctness compares)."""
    return [w for w in response.split() if len(w) == 1 and w in task.symbols]


def final_score(task: SimTask, prompt: str, response: str, correctness: str = "partial") -> float:
    """The score of an episode's final answer: ``"partial"``: the task's gold ``g = c - v - h``
    (:meth:`~alignlit.sim.SimTask.gold_reward`, ``c`` = 1 - normalised edit distance of the symbols);
    ``"exact"``: the same with ``c`` replaced by 1 if the answer's symbols are the ideal answer's, else 0
    (verbosity and harm penalties unchanged), so a near miss earns nothing."""
    gold = task.gold_reward(prompt, response)
    if correctness == "partial":
        return gold
    if correctness != "exact":
        raise ValueError(f"correctness must be one of {CORRECTNESS}, got {correctness!r}")
    symbols, target = answer_symbols(task, response), task.ideal(prompt).split()
    partial = 1.0 - edit_distance(symbols, target) / max(len(symbols), len(target))
    return gold - partial + float(symbols == target)


class SimHintEnvironment:
    """The simulated task as a multi-turn environment with hints (module docstring).

    Args:
        sim_dir: a ``alignlit sim make-data`` directory (its task); None: the default :class:`SimTask`.
        attempts: most answers per episode (1: the single-turn task).
        turn_cost: reward of each hint (the gold's cost per extra turn), >= 0.
        hint: ``"answer"``, ``"length"`` or ``"none"``.
        tool: offer the ``check(answer)`` tool.
        correctness: how the final answer is scored (:func:`final_score`): ``"partial"`` (the task's gold)
            or ``"exact"`` (right symbols or nothing).
    """

    def __init__(
        self,
        sim_dir: str | None = None,
        attempts: int = 2,
        turn_cost: float = 0.1,
        hint: Literal["answer", "length", "none"] = "answer",
        tool: bool = False,
        correctness: Literal["partial", "exact"] = "partial",
    ):
        if attempts < 1 or turn_cost < 0 or hint not in HINTS or correctness not in CORRECTNESS:
            raise ValueError(
                f"SimHintEnvironment: attempts >= 1, turn_cost >= 0, hint in {sorted(HINTS)} and correctness in "
                f"{CORRECTNESS}, got {attempts}, {turn_cost}, {hint!r}, {correctness!r}"
            )
        self.correctness = correctness
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
        return answer_symbols(self.task, response) == self.answer.split()

    def step(self, response: str) -> tuple[str, float, bool]:
        self.attempt += 1
        if self.right(response) or self.attempt >= self.attempts:
            return "", final_score(self.task, self.prompt, response, self.correctness), True
        return hint_text(self.hint, self.answer), -self.turn_cost, False

    def tools(self) -> dict[str, Callable[..., str]]:
        if not self.tool:
            return {}
        return {"check": lambda answer: "right" if self.right(str(answer)) else "wrong"}


def episode_gold(
    task: SimTask, prompt: str, transcript: str, turn_cost: float, correctness: str = "partial"
) -> tuple[float, int, str]:
    """``(gold, turns, final answer)`` of a transcript (model turns separated by the environment's
    ``Human: ... Assistant:`` replies)."""
    turns = REPLY.split(transcript)
    final = turns[-1]
    return final_score(task, prompt, final, correctness) - turn_cost * (len(turns) - 1), len(turns), final


class SimEpisodeGold:
    """The gold of :class:`SimHintEnvironment` episodes from their transcripts, ``(prompts, transcripts)
    -> (N,)``: ``score(x, final answer) - turn_cost · (turns - 1)`` (for ``gold:`` of an online stage).

    Args:
        sim_dir: a ``alignlit sim make-data`` directory; None: the default :class:`SimTask`.
        turn_cost: the environment's ``turn_cost``.
        correctness: the environment's ``correctness`` (:func:`final_score`).
    """

    def __init__(
        self,
        sim_dir: str | None = None,
        turn_cost: float = 0.1,
        correctness: Literal["partial", "exact"] = "partial",
    ):
        if correctness not in CORRECTNESS:
            raise ValueError(f"SimEpisodeGold: correctness must be one of {CORRECTNESS}, got {correctness!r}")
        self.sim_dir, self.turn_cost, self.correctness = sim_dir, turn_cost, correctness
        self.task = _task(sim_dir)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"SimEpisodeGold: {len(prompts)} prompts but {len(responses)} transcripts")
        return torch.tensor(
            [
                episode_gold(self.task, p, r, self.turn_cost, self.correctness)[0]
                for p, r in zip(prompts, responses)
            ],
            dtype=torch.float32,
        )


def hint_text(hint: str, answer: str) -> str:
    """The environment's reply to a wrong answer: ``HINTS[hint]`` for the ideal answer ``answer``."""
    return HINTS[hint].format(answer=answer, length=len(answer.split()))


def wrong_answer(task: SimTask, prompt: str, rng: random.Random, filler: float = 0.5) -> str:
    """A wrong first answer, the kind a sampled policy gives: a ``flawed`` demonstration (one symbol
    swapped, dropped or inserted), followed with probability ``filler`` by a filler phrase."""
    answer = task.demonstration(prompt, rng, kind="flawed")
    if rng.random() < filler:
        answer += format_response(rng.choice(VERBOSE_SUFFIXES).split())
    return answer


def multiturn_demonstration(
    task: SimTask, prompt: str, rng: random.Random, *, hint: str, eos: str
) -> dict[str, str]:
    """A demonstration of the second turn: ``{"prompt": prompt + wrong answer + eos + hint, "response":
    revision}``. The prompt is the episode's context as the model sees it token in / token out (its first
    turn ended by the EOS token it sampled, then the environment's reply); the response, the only part
    trained on, is a demonstration of the right answer drawn like the single-turn ones
    (:meth:`~alignlit.sim.SimTask.demonstration`, the task's ``demo_mix``)."""
    first = wrong_answer(task, prompt, rng)
    context = prompt + first + eos + hint_text(hint, task.ideal(prompt))
    return {"prompt": context, "response": task.demonstration(prompt, rng)}


def write_multiturn_sft(
    sim_dir: str | Path,
    *,
    n_train: int = 5000,
    n_val: int = 250,
    hint: str = "answer",
    eos: str | None = None,
    seed: int = 0,
) -> dict[str, int]:
    """Write ``sft_multiturn_{train,val}.jsonl`` under a ``alignlit sim make-data`` directory: its
    single-turn SFT rows plus :func:`multiturn_demonstration` rows for the first ``n_train`` (``n_val``)
    of their prompts, shuffled with ``seed``. ``eos``: the policy's EOS token as text (default: that of
    ``sim_dir/tokenizer``). Returns the rows written per file."""
    sim_dir = Path(sim_dir)
    task = load_sim(sim_dir)[0]
    if hint not in HINTS:
        raise ValueError(f"hint must be one of {sorted(HINTS)}, got {hint!r}")
    if eos is None:
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(sim_dir / "tokenizer").eos_token
    if not eos:
        raise ValueError(f"{sim_dir / 'tokenizer'} has no EOS token; pass eos=")
    rows = {}
    for split, n in (("train", n_train), ("val", n_val)):
        single = [r.fields for r in read_records(sim_dir / file_name("sft", split))]
        if not 0 <= n <= len(single):
            raise ValueError(f"n_{split}={n}: {file_name('sft', split)} has {len(single)} prompts")
        rng = random.Random(f"alignlit.sim.multiturn_sft:{seed}:{split}")
        multi = [multiturn_demonstration(task, r["prompt"], rng, hint=hint, eos=eos) for r in single[:n]]
        records = single + multi
        rng.shuffle(records)
        write_jsonl(sim_dir / file_name("sft_multiturn", split), records)
        rows[file_name("sft_multiturn", split)] = len(records)
    return rows
