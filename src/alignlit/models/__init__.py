"""Model loading, tiny-model and tokenizer factories, and Hugging Face export."""

from alignlit.data.tokenizer import HH_CHAT_TEMPLATE, train_bpe_tokenizer
from alignlit.hub import ModelNotFoundError, Pretrained, RemoteCodeError, resolve_model
from alignlit.models.export import ExportDirError, check_export_dir, export_pretrained, read_metadata
from alignlit.models.loading import (
    NotARewardModelError,
    ScalarHeadModel,
    last_token_index,
    load_policy,
    load_scalar_model,
    load_tokenizer,
)
from alignlit.models.state_dict import full_state_dict
from alignlit.models.tiny import TinyLlama, make_tiny_llama, tiny_llama_config

__all__ = [
    "HH_CHAT_TEMPLATE",
    "ExportDirError",
    "ModelNotFoundError",
    "NotARewardModelError",
    "Pretrained",
    "RemoteCodeError",
    "ScalarHeadModel",
    "TinyLlama",
    "check_export_dir",
    "export_pretrained",
    "full_state_dict",
    "last_token_index",
    "load_policy",
    "load_scalar_model",
    "load_tokenizer",
    "make_tiny_llama",
    "read_metadata",
    "resolve_model",
    "tiny_llama_config",
    "train_bpe_tokenizer",
]

from alignlit.models.ensemble import RewardEnsemble, combine_scores
from alignlit.models.reward_model import (
    ABFormat,
    PreferenceModel,
    RewardModel,
    load_preference_model,
    load_reward_model,
    resolve_model_path,
)

__all__ += [
    "ABFormat",
    "PreferenceModel",
    "RewardEnsemble",
    "RewardModel",
    "combine_scores",
    "load_preference_model",
    "load_reward_model",
    "resolve_model_path",
]
