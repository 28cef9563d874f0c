"""The prompts an online stage trains and validates on, checked and filtered once at the start of fit.

:class:`TrainingPrompts` refuses, before anything is generated, prompts that leave too few of the policy's
positions for the responses (:meth:`~TrainingPrompts.check`), and applies the prompt filter (ChatGLM §3.4)
to the DataModule's ``train_prompts`` (:meth:`~TrainingPrompts.prepare`); the prompts it kept are its
state, so a resumed run trains on the same ones instead of filtering again.
"""

from __future__ import annotations

from typing import Any

from alignlit.rollout.base import SamplingParams
from alignlit.rollout.loop import RolloutLoop
from alignlit.rollout.prompt_filter import PromptFilter
from alignlit.rollout.reward_protocol import Reward


class TrainingPrompts:
    """The training and validation prompts of an online stage (module docstring).

    Args:
        loop: the rollout loop (its sampling's ``max_new_tokens``, an environment's episode budget; the
            filter samples with it).
        tokenizer: the policy's tokenizer.
        position_limit: the policy's ``max_position_embeddings`` (None: unlimited).
        val_sampling: the validation sampling (its ``max_new_tokens`` counts too).
        prompt_filter: drop training prompts with low reward variance under the initial policy (None: off).
    """

    def __init__(
        self,
        loop: RolloutLoop,
        tokenizer,
        *,
        position_limit: int | None,
        val_sampling: SamplingParams | None = None,
        prompt_filter: PromptFilter | None = None,
    ):
        if position_limit is not None and loop.sampling.max_new_tokens >= position_limit:
            raise ValueError(
                f"rollout.sampling.max_new_tokens ({loop.sampling.max_new_tokens}) leaves no room for a prompt in "
                f"the policy's {position_limit} positions (max_position_embeddings)"
            )
        self.loop, self.tokenizer, self.position_limit = loop, tokenizer, position_limit
        self.val_sampling, self.prompt_filter = val_sampling, prompt_filter
        self.kept: list[str] | None = None
        """The training prompts the prompt filter kept (None: no filter, or not run yet)."""

    def check(self, prompts: list[str], what: str) -> None:
        """Refuse, before anything is generated, prompts that leave too few of the policy's positions for
        ``max_new_tokens`` (``rollout.max_episode_tokens`` with an environment: an episode's response side;
        transformers would only warn, then index past its position table), naming the field that sets the
        length and only advice that can be followed (no limit below 1)."""
        limit = self.position_limit
        if limit is None or not prompts:
            return
        samplings = {"rollout.sampling": self.loop.sampling, "val_sampling": self.val_sampling}
        name, new = max(
            ((f"{k}.max_new_tokens", s.max_new_tokens) for k, s in samplings.items() if s is not None),
            key=lambda item: item[1],
        )
        if self.loop.environment is not None:  # an episode's response side
            name, new = "rollout.max_episode_tokens", self.loop.max_episode_tokens
        lengths = [len(ids) for ids in self.tokenizer(list(prompts))["input_ids"]]
        row = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[row] + new <= limit:
            return
        short = name.rsplit(".", 1)[-1]
        head = (
            f"{what} prompt {row} ({prompts[row][:40]!r}...) has {lengths[row]} tokens: with {short} {new} "
            f"({name}) a sample needs {lengths[row] + new} positions, but the policy has {limit} "
            "(max_position_embeddings). "
        )
        fixes = []
        if new < limit:
            fixes.append(
                f"set the DataModule's max_prompt_length to at most {limit - new} (longer prompts are then "
                "truncated from the left and counted)"
            )
        if lengths[row] < limit:
            fixes.append(f"lower {name} to at most {limit - lengths[row]}")
        if new >= limit:
            head += f"{name} {new} alone needs every position the policy has. "
        advice = " or ".join(fixes) or "shorten the prompts"
        raise ValueError(head + advice[0].upper() + advice[1:])

    def prepare(self, dm, reward: Reward, *, version: int) -> list[str] | None:
        """At the start of fit: check the DataModule's prompts against the policy's positions
        (:meth:`check`) and apply the prompt filter (sampling from the policy at ``version``, scored by
        ``reward``), or restore what it kept from the checkpoint. Returns the training prompts (None: the
        DataModule has none)."""
        prompts = getattr(dm, "train_prompts", None)
        self.check(prompts or [], "training")
        self.check(getattr(dm, "val_prompts", None) or [], "validation")
        if self.prompt_filter is None:
            return prompts
        if prompts is None:
            raise ValueError("prompt_filter needs a DataModule with `train_prompts` (e.g. PromptDataModule)")
        if self.kept is not None:  # restored from the checkpoint: the same prompts, not a re-run
            missing = set(self.kept) - set(prompts)
            if missing:
                raise ValueError(
                    f"the checkpoint's prompt filter kept {len(missing)} prompt(s) the training data does not "
                    f"hold, e.g. {next(iter(missing))!r}: resume with the data the run started with"
                )
            dm.train_prompts = list(self.kept)
            print(
                f"alignlit: prompt filter: the {len(prompts)} training prompts kept at the start, from the checkpoint"
            )
            return dm.train_prompts

        def generate(batch, n, sampling):
            return self.loop.generate(batch, version=version, n=n, sampling=sampling)

        kept, report = self.prompt_filter(generate, reward, prompts, default_sampling=self.loop.sampling)
        if not kept:
            raise ValueError(f"prompt_filter dropped every training prompt ({report}); lower epsilon")
        dm.train_prompts = self.kept = kept
        print(f"alignlit: prompt filter kept {int(report['kept'])} of {int(report['prompts'])} prompts")
        return kept

    def state_dict(self) -> dict[str, Any]:
        """The prompts the filter kept, for checkpoints."""
        return {"kept": self.kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.kept = state["kept"]
