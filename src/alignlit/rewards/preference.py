"""A pairwise preference model as a reward: the samples of each prompt ranked together."""

from __future__ import annotations

from typing import Literal

import torch

from alignlit.data.records import read_records
from alignlit.models.reward_model import load_preference_model
from alignlit.rollout.base import Rollout


class PreferenceRanking:
    """A pairwise preference model (a :class:`~alignlit.modules.PairwisePrefModule` export) as the reward
    of an online stage: the ``n`` samples of each prompt are scored together by
    :meth:`~alignlit.models.PreferenceModel.rank` (RLHF-Workflow §2.2, §3.3), so best-of-n and worst-of-n
    come from the preference model. Single samples (validation) score ½ in ``round_robin`` mode.

    Args:
        model: the preference model's export directory.
        mode: ``"round_robin"`` (each sample's mean win probability against the prompt's other samples)
            or ``"reference"`` (its win probability against the prompt's reference response).
        references: records with ``prompt`` and ``response`` fields (e.g. SFT data) giving each
            prompt's reference response; ``mode: reference`` only.
        batch_size: pairs per forward pass (each pair is judged in both orders).
        dtype: dtype the model is loaded in.
    """

    def __init__(
        self,
        model: str,
        mode: Literal["round_robin", "reference"] = "round_robin",
        references: str | None = None,
        batch_size: int = 16,
        dtype: str = "float32",
    ):
        if (mode == "reference") != (references is not None):
            raise ValueError(
                "PreferenceRanking: mode 'reference' needs `references`; 'round_robin' takes none"
            )
        self.ranker = load_preference_model(model, batch_size=batch_size, dtype=dtype)
        self.mode, self.references_file = mode, references
        self.references = (
            {r.text("prompt"): r.text("response") for r in read_records(references)} if references else {}
        )

    @property
    def model(self) -> torch.nn.Module:
        """The preference model's network (an online stage moves it with the module and keeps it frozen)."""
        return self.ranker.model

    def score_rollout(self, rollout: Rollout) -> torch.Tensor:
        """(N,) scores of the samples of ``rollout``, ranked within each prompt's group of ``n``."""
        n = rollout.n
        prompts = rollout.prompts[::n]
        groups = [rollout.texts[i * n : (i + 1) * n] for i in range(len(prompts))]
        refs = None
        if self.mode == "reference":
            missing = [p for p in prompts if p not in self.references]
            if missing:
                raise KeyError(
                    f"{self.references_file}: no reference response for prompt {missing[0]!r} "
                    f"({len(missing)} of {len(prompts)} prompts have none)"
                )
            refs = [self.references[p] for p in prompts]
        return torch.cat(self.ranker.rank(prompts, groups, mode=self.mode, reference_responses=refs))
