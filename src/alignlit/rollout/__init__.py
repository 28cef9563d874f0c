"""Rollout engines: the contract, Hugging Face and vLLM engines, teacher-forced log-probs, parity checks.

``VLLMEngine`` imports vLLM only when built, so this package imports without the vllm extra.
"""

from alignlit.models.forward import position_ids_from_mask, response_logprobs
from alignlit.rollout.base import Rollout, RolloutEngine, SamplingParams
from alignlit.rollout.hf_engine import HFEngine
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

from alignlit.rollout.loop import Experience, RolloutLoop
from alignlit.rollout.prompt_filter import PromptFilter, reward_variance
from alignlit.rollout.reward import (
    Reward,
    RewardFn,
    RewardModel,
    RolloutScorer,
    resolve_reward,
    score_rollout,
    score_texts,
)

__all__ += [
    "Experience",
    "PromptFilter",
    "Reward",
    "RewardFn",
    "RewardModel",
    "RolloutLoop",
    "RolloutScorer",
    "resolve_reward",
    "reward_variance",
    "score_rollout",
    "score_texts",
]

from alignlit.rollout.sampling import Scorer, sample_ranked  # noqa: E402

__all__ += ["Scorer", "sample_ranked"]
