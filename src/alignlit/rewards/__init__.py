"""Rewards an online stage trains on (``reward:`` in a config): rule-based verifiers, ``(prompts, responses)
-> rewards``, an LLM judge and a preference model (any of them a reward of
:mod:`alignlit.rollout.reward_protocol`).

- :mod:`alignlit.rewards.sim`: :class:`SimVerifier`, the simulated task's answer check (strict / flexible);
- :mod:`alignlit.rewards.math`: math answers checked with ``math-verify`` (the ``env`` extra), in worker
  processes with a per-sample timeout (:mod:`alignlit.rewards.verify_pool`);
- :mod:`alignlit.rewards.reasoning_gym`: reasoning-gym tasks and their scorers (the ``env`` extra);
- :mod:`alignlit.rewards.judge`: :class:`~alignlit.rewards.judge.JudgeReward`, an LLM judge behind an
  OpenAI-compatible endpoint;
- :mod:`alignlit.rewards.preference`: :class:`PreferenceRanking`, a pairwise preference model ranking each
  prompt's samples together.
"""

from alignlit.rewards.preference import PreferenceRanking
from alignlit.rewards.sim import SimVerifier

__all__ = ["PreferenceRanking", "SimVerifier"]
