"""Rewards an online stage trains on (``reward:`` in a config): rule-based verifiers, ``(prompts, responses)
-> rewards``.

- :mod:`alignlit.rewards.sim`: :class:`SimVerifier`, the simulated task's answer check (strict / flexible);
- :mod:`alignlit.rewards.math`: math answers checked with ``math-verify`` (the ``env`` extra), in worker
  processes with a per-sample timeout (:mod:`alignlit.rewards.verify_pool`);
- :mod:`alignlit.rewards.reasoning_gym`: reasoning-gym tasks and their scorers (the ``env`` extra).
"""

from alignlit.rewards.sim import SimVerifier

__all__ = ["SimVerifier"]
