"""A rule-based answer check for the simulated task, the way GSM8K's answer check is.

The verifier sees a prompt and a response and returns 1.0 if the answer is right, else 0.0. It computes
the right answer from the prompt (``sort c a d`` -> ``a c d``); it reads no data file and never sees the
gold reward. Two checks, named after lm-evaluation-harness's two GSM8K filters:

- ``strict``: the response is exactly the answer: its whitespace-separated words are the ideal answer's
  symbols, in order, and nothing else (no filler word, no harm word). Because the gold reward is 1 only
  for such a response (:meth:`alignlit.sim.SimTask.gold_reward`: correctness 1 needs the right symbols,
  verbosity 0 needs no extra word, and the harm word is not a symbol), ``strict == 1`` exactly when
  ``gold == 1``: the strict verifier is the indicator of gold's maximum. It grades nothing below it (a
  correct answer with one filler word, gold 0.9, scores 0 like an empty one, gold 0).
- ``flexible``: the answer extracted from the response is right: the words that are symbols of the task,
  in order, equal the ideal answer; other words (filler, the harm word) are ignored. ``flexible == 1``
  exactly when gold's correctness term is 1, whatever the verbosity and harm penalties: a proxy whose
  maximisers include responses gold penalises (``" a c d ok done"``: flexible 1, gold 0.8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from alignlit.sim.data import load_sim

MODES = ("strict", "flexible")


class SimVerifier:
    """The simulated task's answer check as a reward callable, ``(prompts, responses) -> (N,)`` of 1.0/0.0.

    Args:
        sim_dir: directory written by ``alignlit sim make-data``; only its ``manifest.json`` (the task's
            symbols and operations) is read, to compute each prompt's answer.
        mode: ``strict`` (the response is exactly the answer) or ``flexible`` (the response's symbols are
            the answer; other words ignored). See the module docstring for how each relates to gold.
    """

    def __init__(self, sim_dir: str, mode: Literal["strict", "flexible"] = "strict"):
        if mode not in MODES:
            raise ValueError(f"SimVerifier: mode must be one of {MODES}, got {mode!r}")
        self.sim_dir, self.mode = sim_dir, mode
        self.task, _ = load_sim(sim_dir)

    def verify(self, prompt: str, response: str) -> bool:
        """Whether ``response`` answers ``prompt`` (ValueError if ``prompt`` is not a task prompt)."""
        if not isinstance(response, str):
            raise ValueError(f"response must be a string, got {type(response).__name__}")
        answer = self.task.ideal(prompt).split()
        words = response.split()
        if self.mode == "flexible":
            words = [w for w in words if len(w) == 1 and w in self.task.symbols]
        return words == answer

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"SimVerifier: {len(prompts)} prompts but {len(responses)} responses")
        return torch.tensor([float(self.verify(p, r)) for p, r in zip(prompts, responses)])
