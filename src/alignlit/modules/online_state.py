"""What an online stage keeps across a restart, and its monitoring curves.

An online checkpoint holds, under ``"<stage>_state"``, one entry per part of the stage,
``{name: part.state_dict()}`` (:meth:`~alignlit.modules.online.OnlineModule.checkpoint_parts`): the
asynchronous pipeline's finished batches (``ahead``, first: saving it drains the producer), the rollout
loop's counters (``rollout``), the collector's refill generator (``collector``), the prompts the filter kept
(``prompts``), the ptx loader's position (``ptx``), the KL controller (``kl``), the run's :class:`Progress`
(``progress``: the policy version, counters, history, minibatch generator, torch RNG) and the stage's own
state (``stage``), written by :func:`save_state`, read by :func:`load_state`. The frozen models are left
out (they reload from disk).
:func:`write_curves` plots the history at the end of fit.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch


class Stateful(Protocol):
    """A part with a state for checkpoints."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class StateOf(NamedTuple):
    """The state of an object that is not a part of its own (the module's counters, a stage's state), as
    the pair of functions that read and restore it."""

    state_dict: Callable[[], Any]
    load_state_dict: Callable[[Any], None]


class Progress:
    """How far an online run is: the policy's version, the rollouts trained and skipped, the monitoring
    history and the minibatch generator; its state holds the torch RNG too.

    Args:
        seed: the minibatch generator's seed (the rollout's).
    """

    def __init__(self, seed: int):
        self.policy_version = 0
        """The version of the policy's weights: the training steps (rollouts) that updated it so far, each
        with all its minibatch steps; recorded on every sample, and the unit of ``rollout.max_staleness``."""
        self.trained_rollouts = self.skipped_rollouts = 0
        self.history: list[dict[str, float]] = []
        """The metrics of every training step and validation, in order (the curves)."""
        self.minibatch_generator = torch.Generator().manual_seed(seed)
        """Draws the minibatches of every step (:class:`~alignlit.modules.trajectory.Minibatches`)."""

    def report(self, stage: str) -> None:
        """Print the run's counters at the end of fit; warn when no rollout was trained."""
        print(
            f"alignlit: {stage}: {self.trained_rollouts} rollout(s) trained, {self.skipped_rollouts} skipped, "
            f"policy version {self.policy_version}"
        )
        if self.trained_rollouts == 0:
            warnings.warn(
                f"{stage}: no rollout was trained (all {self.skipped_rollouts} skipped): the export is the "
                "starting policy",
                stacklevel=2,
            )

    def state_dict(self) -> dict[str, Any]:
        """The counters, the history, the minibatch generator and the torch RNG, for checkpoints."""
        return {
            "policy_version": self.policy_version,
            "trained_rollouts": self.trained_rollouts,
            "skipped_rollouts": self.skipped_rollouts,
            "history": list(self.history),
            "minibatch_generator": self.minibatch_generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the torch RNG included)."""
        self.policy_version = int(state["policy_version"])
        self.trained_rollouts, self.skipped_rollouts = (
            int(state["trained_rollouts"]),
            int(state["skipped_rollouts"]),
        )
        self.history = list(state["history"])
        self.minibatch_generator.set_state(state["minibatch_generator"])
        torch.set_rng_state(state["torch_rng"])


def save_state(checkpoint: dict[str, Any], key: str, parts: dict[str, Stateful], frozen: list[str]) -> None:
    """Save ``{name: part.state_dict()}`` under ``key``, in the parts' order, and leave the frozen models'
    weights (state-dict ``frozen`` prefixes) out of ``checkpoint``: they reload from disk."""
    state = checkpoint["state_dict"]
    for name in [k for k in state if k.startswith(tuple(frozen))]:
        del state[name]
    checkpoint[key] = {name: part.state_dict() for name, part in parts.items()}


def load_state(
    checkpoint: dict[str, Any], key: str, parts: dict[str, Stateful], frozen: dict[str, Any], *, owner: str
) -> None:
    """Restore every part from ``checkpoint[key]`` (refusing a checkpoint without it or one of them) and put
    the frozen models' weights as loaded (``{prefix: module}``) back into its state dict."""
    if key not in checkpoint:
        raise KeyError(f"checkpoint has no {key!r}: it was not written by {owner}")
    for prefix, module in frozen.items():
        checkpoint["state_dict"].update({prefix + k: v for k, v in module.state_dict().items()})
    missing = [name for name in parts if name not in checkpoint[key]]
    if missing:
        raise KeyError(f"the checkpoint's {key!r} has no state for {missing}: it was not written by {owner}")
    for name, part in parts.items():
        part.load_state_dict(checkpoint[key][name])


def write_curves(
    history: list[dict[str, float]], out: str | Path, *, stage: str, panels: Sequence[tuple[str, str]]
) -> Path | None:
    """Plot the monitoring history as a PNG at ``out`` and write it as JSON next to it (None: no history)."""
    from alignlit.eval.plots import plot_curves

    if not history:
        return None
    path = plot_curves({stage: history}, out, panels=panels, title=f"{stage} monitoring")
    path.with_suffix(".json").write_text(json.dumps(history, indent=1) + "\n")
    print(f"alignlit: {stage} curves written to {path}")
    return path
