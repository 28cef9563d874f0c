"""The simulated task as a reward: load a ``alignlit sim make-data`` directory, score with gold."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from alignlit.sim.data import MANIFEST
from alignlit.sim.task import SimTask


def load_sim(sim_dir: str | Path) -> tuple[SimTask, dict]:
    """The :class:`~alignlit.sim.SimTask` and manifest of a ``alignlit sim make-data`` directory."""
    manifest_path = Path(sim_dir) / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"{manifest_path} not found: run `alignlit sim make-data --out {sim_dir}` first"
        )
    manifest = json.loads(manifest_path.read_text())
    task_args = dict(manifest["task"])
    task_args["ops"] = tuple(task_args["ops"])
    return SimTask(**task_args), manifest


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
