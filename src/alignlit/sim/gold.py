"""The simulated task's gold reward as a reward callable, for a ``alignlit sim make-data`` directory."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from alignlit.sim.data import load_sim


class SimGoldReward:
    """The simulated task's gold reward as a reward callable (for ``reward`` or ``gold`` of online stages).

    Args:
        sim_dir: directory written by ``alignlit sim make-data`` (its ``manifest.json`` defines the task).
    """

    def __init__(self, sim_dir: str):
        self.sim_dir = sim_dir
        self.task, _ = load_sim(sim_dir)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        return torch.tensor(self.task.gold_rewards(list(prompts), list(responses)), dtype=torch.float32)
