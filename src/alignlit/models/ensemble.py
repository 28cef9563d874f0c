"""Reward-model ensembles: several trained reward models scored as one reward.

``RewardEnsemble(models=[...], combine="mean" | "lcb" | "min")`` has the ``score(prompts, responses)`` of a
single reward model, so it goes wherever one does: ``reward:`` of an online stage (as a ``class_path``),
best-of-n selection, ``alignlit.eval.score``. Combining rules (Coste et al. 2024, "Reward Model Ensembles
Help Mitigate Overoptimization"): the mean of the members' scores; a lower confidence bound
``mean - k·std`` over members (the members' disagreement is penalised, so a response only some members
like scores low); the worst case ``min``.

Members trained separately put their scores on different scales and offsets; with ``normalize`` (a file
of prompt/response records, e.g. SFT validation demonstrations) each member's scores are standardised by
its own mean and standard deviation over that file, measured once at load, before they are combined.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from alignlit.models.reward_model import RewardModel, load_reward_model

COMBINE = ("mean", "lcb", "min")


def combine_scores(scores: torch.Tensor, combine: str = "mean", k: float = 1.0) -> torch.Tensor:
    """(N,) combination of (M, N) member scores: ``mean``; ``lcb`` = mean − k·std (std with the M − 1
    denominator); ``min``."""
    if scores.dim() != 2 or scores.shape[0] < 1:
        raise ValueError(f"scores must be (M, N) with M >= 1 members, got shape {tuple(scores.shape)}")
    if combine == "mean":
        return scores.mean(0)
    if combine == "lcb":
        if scores.shape[0] < 2:
            raise ValueError("combine='lcb' needs at least 2 members (a standard deviation over members)")
        return scores.mean(0) - k * scores.std(0)
    if combine == "min":
        return scores.min(0).values
    raise ValueError(f"combine must be one of {COMBINE}, got {combine!r}")


def _reference_texts(path: str) -> tuple[list, list[str]]:
    from alignlit.data.records import parse_prompt_response, read_records

    prompts, responses = [], []
    for record in read_records(path):
        prompt, response = parse_prompt_response(record)
        prompts.append(prompt)
        responses.append(response)
    if len(prompts) < 2:
        raise ValueError(
            f"normalize file {path!r} has {len(prompts)} records; at least 2 are needed for a std"
        )
    return prompts, responses


class RewardEnsemble:
    """Several reward models as one reward (see the module docstring).

    Args:
        models: the members' reward-model directories (at least 2).
        combine: ``"mean"``, ``"lcb"`` (mean − ``k``·std over members) or ``"min"``.
        k: the LCB's multiple of the members' standard deviation.
        normalize: a records file (``{"prompt", "response"}`` rows or any format
            :func:`~alignlit.data.records.parse_prompt_response` reads) on which each member's score mean
            and std are measured once; scores are standardised by them before combining (None: raw).
        batch_size: sequences per forward pass of each member.
        dtype: dtype the members are loaded in.
    """

    def __init__(
        self,
        models: list[str],
        combine: Literal["mean", "lcb", "min"] = "mean",
        k: float = 1.0,
        normalize: str | None = None,
        batch_size: int = 64,
        dtype: str = "float32",
    ):
        if len(models) < 2:
            raise ValueError(f"a reward ensemble needs at least 2 models, got {len(models)}: {models}")
        if combine not in COMBINE:
            raise ValueError(f"combine must be one of {COMBINE}, got {combine!r}")
        if not (math.isfinite(k) and k >= 0):
            raise ValueError(f"k must be a finite number >= 0, got {k}")
        self.paths, self.combine, self.k = list(models), combine, k
        self.members: list[RewardModel] = [
            load_reward_model(p, batch_size=batch_size, dtype=dtype) for p in models
        ]
        #: the members' networks in one module (an online stage moves it with itself and keeps it frozen)
        self.model = nn.ModuleList([m.model for m in self.members])
        m = len(self.members)
        self.offsets, self.scales = torch.zeros(m, 1), torch.ones(m, 1)
        if normalize is not None:
            prompts, responses = _reference_texts(normalize)
            ref = self.member_scores(prompts, responses)
            self.offsets, self.scales = ref.mean(1, keepdim=True), ref.std(1, keepdim=True).clamp_min(1e-6)

    @property
    def tokenizer(self):
        return self.members[0].tokenizer

    @property
    def counts(self) -> dict[str, int]:
        """What the first member's length limits cut (see :attr:`RewardModel.counts`)."""
        return self.members[0].counts

    def describe_truncation(self) -> str | None:
        return self.members[0].describe_truncation()

    def member_scores(self, prompts: Sequence, responses: Sequence[str]) -> torch.Tensor:
        """(M, N) raw scores of every member."""
        return torch.stack([m.score(prompts, responses) for m in self.members])

    def score(self, prompts: Sequence, responses: Sequence[str]) -> torch.Tensor:
        """(N,) combined (standardised, with ``normalize``) score of each ``(prompt, response)``."""
        standard = (self.member_scores(prompts, responses) - self.offsets) / self.scales
        return combine_scores(standard, self.combine, self.k)

    def __repr__(self) -> str:
        return f"RewardEnsemble({len(self.members)} models, combine={self.combine!r}, k={self.k})"
