"""The rollout side: the engine contract, Hugging Face and vLLM engines, the rollout loop (sync,
generate, score), rewards, parity checks, prompt filtering and ranked sampling; environments, tools and
multi-turn episodes (token in / token out) and the Gymnasium adapter.

``VLLMEngine`` imports vLLM only when built, so this package imports without the vllm extra.
"""

from alignlit.rollout.base import Experience, Rollout, RolloutEngine, SamplingParams
from alignlit.rollout.environment import (
    ChatTemplateToolParser,
    Environment,
    JSONToolParser,
    Step,
    ToolCall,
    ToolCallError,
    ToolEnvironment,
    ToolParser,
)
from alignlit.rollout.episodes import EpisodeReturn, EpisodeStats, run_episodes
from alignlit.rollout.gym import GymEnvironment
from alignlit.rollout.hf_engine import HFEngine, HFEngineOptions
from alignlit.rollout.loop import RolloutLoop
from alignlit.rollout.parity import ParityError, check_parity, logprob_parity
from alignlit.rollout.prompt_filter import PromptFilter, reward_variance
from alignlit.rollout.reward_protocol import (
    Reward,
    RewardFn,
    RolloutScorer,
    TextScorer,
    resolve_reward,
    score_rollout,
    score_texts,
)
from alignlit.rollout.sampling import Scorer, sample_ranked
from alignlit.rollout.vllm_engine import VLLMEngine

__all__ = [
    "ChatTemplateToolParser",
    "Environment",
    "EpisodeReturn",
    "EpisodeStats",
    "Experience",
    "GymEnvironment",
    "HFEngine",
    "HFEngineOptions",
    "JSONToolParser",
    "ParityError",
    "PromptFilter",
    "Reward",
    "RewardFn",
    "Rollout",
    "RolloutEngine",
    "RolloutLoop",
    "RolloutScorer",
    "SamplingParams",
    "Scorer",
    "Step",
    "TextScorer",
    "ToolCall",
    "ToolCallError",
    "ToolEnvironment",
    "ToolParser",
    "VLLMEngine",
    "check_parity",
    "logprob_parity",
    "resolve_reward",
    "reward_variance",
    "run_episodes",
    "sample_ranked",
    "score_rollout",
    "score_texts",
]
