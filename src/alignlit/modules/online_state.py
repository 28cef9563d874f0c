"""What an online stage keeps across a restart, and its monitoring curves.

:class:`OnlineCheckpoints` holds the methods :class:`~alignlit.modules.online.OnlineModule` takes from this
base: every piece of online state goes into the checkpoint (the rollout loop's counters, the policy
version, the minibatch and refill generators, the KL controller, the prompts the filter kept, the
rollouts generated ahead by an asynchronous pipeline, the history, the ptx loader's position, the torch
RNG, and the stage's own ``online_state_dict``), the frozen models are left out (they reload from disk),
and the history is written as a PNG and JSON at the end of fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from alignlit.modules.collect import experience_state, load_experience


class OnlineCheckpoints:
    """Checkpoints and curves of :class:`~alignlit.modules.online.OnlineModule` (module docstring)."""

    @property
    def state_key(self) -> str:
        return f"{self.stage}_state"

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the online state; leave the frozen models out (they reload from disk)."""
        prefixes = tuple(self.frozen_prefixes())
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(prefixes)]:
            del state[key]
        pipeline = self.rollout.pipeline
        ahead = pipeline.drain() if pipeline is not None else {}  # first: the producer's state settles
        checkpoint[self.state_key] = {
            "ahead": {j: experience_state(result) for j, result in ahead.items()},
            "ahead_versions": {j: pipeline.submitted[j] for j in ahead} if ahead else {},
            "rollout": self.rollout.state_dict(),
            "policy_version": self.policy_version,
            "minibatch_generator": self.minibatch_generator.get_state(),
            "refill_generator": self.refill_generator.get_state(),
            "kl_ctl": self.kl_ctl.state_dict() if self.kl_ctl is not None else None,
            "kept_prompts": self.kept_prompts,
            "history": list(self.history),
            "skipped_rollouts": self.skipped_rollouts,
            "trained_rollouts": self.trained_rollouts,
            "ptx_loader": self.ptx_mixer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            **self.online_state_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get(self.state_key)
        if state is None:
            raise KeyError(
                f"checkpoint has no {self.state_key!r}: it was not written by {type(self).__name__}"
            )
        for prefix in self.frozen_prefixes():
            module = getattr(self, prefix.rstrip("."))
            checkpoint["state_dict"].update({prefix + k: v for k, v in module.state_dict().items()})
        self.rollout.load_state_dict(state["rollout"])
        self.policy_version = int(state["policy_version"])
        self.minibatch_generator.set_state(state["minibatch_generator"])
        self.refill_generator.set_state(state["refill_generator"])
        if self.kl_ctl is not None:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.kept_prompts = state["kept_prompts"]
        self.restored_batches = (
            {int(j): load_experience(result) for j, result in state["ahead"].items()},
            {int(j): int(v) for j, v in state["ahead_versions"].items()},
        )
        self.resume_notice = self.async_resume_notice()
        if self.resume_notice:
            print(self.resume_notice, flush=True)
        self.history = list(state["history"])
        self.skipped_rollouts, self.trained_rollouts = (
            int(state["skipped_rollouts"]),
            int(state["trained_rollouts"]),
        )
        self.ptx_mixer.load_state_dict(state["ptx_loader"])
        torch.set_rng_state(state["torch_rng"])
        self.load_online_state_dict(state)

    def async_resume_notice(self) -> str:
        """The notice of a resume that cannot match an uninterrupted run ("" when it can).

        With ``max_staleness = k``, a checkpoint holds the ``k`` batches generated ahead of its step, from
        the weights of ``k`` steps earlier. A checkpoint written within ``k`` steps of the end its run had
        planned (at the end of a finished run, say) has fewer: its run never generated the batches past its
        end. Resumed with a longer run (``max_epochs`` raised), those batches are generated from the
        weights of the resume, staleness 0 instead of up to ``k``: a valid run, but not the one a run planned
        that long from the start would have trained (its weights from earlier versions are gone)."""
        k, index = self.rollout.max_staleness, self.rollout.rollouts
        missing = [j for j in range(index, index + k) if j not in self.restored_batches[0]]
        if not k or not index or not missing:
            return ""
        steps = ", ".join(map(str, missing))
        return (
            f"alignlit: notice: this checkpoint (rollout step {index}, max_staleness {k}) holds no rollouts "
            f"generated ahead for step(s) {steps}: it was written at (or within {k} steps of) the end its run "
            f"had planned. If this run trains them, they are generated from the resumed weights (staleness 0), "
            f"not from the weights of {k} step(s) earlier as in a run planned this long from the start, so the "
            "result is a valid asynchronous run but not bit-identical to that one."
        )

    def write_curves(self) -> Path | None:
        """Plot the monitoring history (PNG) and write it as JSON next to it, on rank 0; None without
        history and on the other ranks. Every rank calls it (``trainer.log_dir`` is a collective)."""
        out = self.curves_file
        if out is None:
            root = self.trainer.log_dir or self.trainer.default_root_dir
            out = str(Path(root) / f"{self.stage}_curves.png")
        if not self.history or self.global_rank != 0:
            return None
        from alignlit.eval.plots import plot_curves

        path = plot_curves(
            {self.stage: self.history}, out, panels=self.curve_panels, title=f"{self.stage} monitoring"
        )
        path.with_suffix(".json").write_text(json.dumps(self.history, indent=1) + "\n")
        print(f"alignlit: {self.stage} curves written to {path}")
        return path
