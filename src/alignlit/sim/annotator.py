"""Simulated annotators: a noisy, length-biased Bradley-Terry view of the gold reward."""

from __future__ import annotations

import math
import random

from alignlit.sim.task import SimTask, num_words


def sigmoid(z: float) -> float:
    """Logistic sigmoid, without overflow for large ``|z|``."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


class Annotator:
    """An annotator who compares two responses to the same prompt.

    Noise-free preference (Bradley-Terry on the gold reward, plus a length bias)::

        P(y1 ≻ y2) = σ((g1 - g2) / τ + b · (|y1| - |y2|))

    with ``g = SimTask.gold_reward`` and ``|y|`` the number of whitespace tokens. The recorded label is
    then flipped with probability ``label_noise``, so ``P(label = y1) = (1 - ε) P + ε (1 - P)``.

    ``b > 0`` makes annotators prefer longer answers beyond what the gold reward warrants, the bias that
    length balancing and reward/length-correlation diagnostics are about. The default ``b = 0.7`` offsets
    70% of the gold verbosity penalty (``verbosity_penalty / τ = 1`` logit per extra word): annotators still
    prefer the concise correct answer to a padded one, but only by σ(0.3) per extra word. On pairs of
    default demonstrations this makes the chosen response longer than the rejected one on average and
    agrees with the noise-free gold preference on about 63% of the pairs with unequal gold; a
    Bradley-Terry fit of the labels then rewards length clearly (reward/length correlation about +0.4 on
    demonstrations, where gold/length is -0.29), and length balancing roughly halves that.

    Args:
        temperature: ``τ > 0``; smaller is more decisive.
        length_bias: ``b``, per-word logit bonus for the longer response.
        label_noise: ``ε`` in [0, 0.5], probability that a label is flipped.
        seed: seeds the generator :meth:`label` uses when no ``rng`` is passed.
        task: the task whose gold reward the annotator sees (default: ``SimTask()``).
    """

    def __init__(
        self,
        temperature: float = 0.1,
        length_bias: float = 0.7,
        label_noise: float = 0.05,
        seed: int = 0,
        task: SimTask | None = None,
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 <= label_noise <= 0.5:
            raise ValueError(f"label_noise must be in [0, 0.5], got {label_noise}")
        self.temperature = temperature
        self.length_bias = length_bias
        self.label_noise = label_noise
        self.seed = seed
        self.task = task if task is not None else SimTask()
        self._rng = random.Random(f"alignlit.sim.annotator:{seed}")

    def prob_prefers_first(self, g1: float, g2: float, len1: int, len2: int) -> float:
        """Noise-free ``σ((g1 - g2)/τ + b·(len1 - len2))``."""
        return sigmoid((g1 - g2) / self.temperature + self.length_bias * (len1 - len2))

    def prob(self, prompt: str, y1: str, y2: str) -> float:
        """Noise-free probability that ``y1`` is preferred to ``y2`` as an answer to ``prompt``."""
        g1, g2 = self.task.gold_reward(prompt, y1), self.task.gold_reward(prompt, y2)
        return self.prob_prefers_first(g1, g2, num_words(y1), num_words(y2))

    def label(self, prompt: str, y1: str, y2: str, rng: random.Random | None = None) -> bool:
        """True if the annotator prefers ``y1``: a Bernoulli draw of :meth:`prob`, then a flip with
        probability ``label_noise``. Uses ``rng`` (two draws), or the annotator's own seeded generator."""
        rng = self._rng if rng is None else rng
        prefers_first = rng.random() < self.prob(prompt, y1, y2)
        if rng.random() < self.label_noise:
            prefers_first = not prefers_first
        return prefers_first

    def __repr__(self) -> str:
        return (
            f"Annotator(temperature={self.temperature}, length_bias={self.length_bias}, "
            f"label_noise={self.label_noise}, seed={self.seed})"
        )
