"""Rollout engines: the contract, Hugging Face and vLLM engines, teacher-forced log-probs, parity checks.

``VLLMEngine`` imports vLLM only when built, so this package imports without the vllm extra.
"""

from alignlit.rollout.base import Rollout, RolloutEngine, SamplingParams
from alignlit.rollout.hf_engine import HFEngine
from alignlit.rollout.logprobs import position_ids_from_mask, response_logprobs
from alignlit.rollout.parity import ParityError, check_parity, logprob_parity
from alignlit.rollout.vllm_engine import VLLMEngine

__all__ = [
    "HFEngine",
    "ParityError",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "check_parity",
    "logprob_parity",
    "position_ids_from_mask",
    "response_logprobs",
]

from alignlit.rollout.loop import (
    Experience,
    RewardModel,
    RolloutLoop,
    RolloutScorer,
    SimGoldReward,
    score_rollout,
)
from alignlit.rollout.prompt_filter import PromptFilter, reward_variance

__all__ += [
    "Experience",
    "PromptFilter",
    "RewardModel",
    "RolloutLoop",
    "RolloutScorer",
    "SimGoldReward",
    "reward_variance",
    "score_rollout",
]

from alignlit.rollout.sampling import Scorer, load_scorer, sample_ranked  # noqa: E402

__all__ += ["Scorer", "load_scorer", "sample_ranked"]
