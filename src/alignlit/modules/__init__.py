"""One LightningModule per stage."""

from alignlit.models.lora import LoRA
from alignlit.modules.base import AlignModule, Optim
from alignlit.modules.online import KLPenalty, OnlineModule, PtxMix
from alignlit.modules.sft import SFTModule

__all__ = ["AlignModule", "KLPenalty", "LoRA", "OnlineModule", "Optim", "PtxMix", "SFTModule"]

from alignlit.modules.ppo import PPOModule

__all__ += ["PPOModule"]

from alignlit.modules.reward import RewardModule  # noqa: E402

__all__ += ["RewardModule"]

from alignlit.modules.pairpref import PairwisePrefModule  # noqa: E402

__all__ += ["PairwisePrefModule"]

from alignlit.modules.dpo import DPOModule  # noqa: E402
from alignlit.modules.rrhf import RRHFModule  # noqa: E402

__all__ += ["DPOModule", "RRHFModule"]

from alignlit.modules.policy_gradient import PolicyGradientModule  # noqa: E402

__all__ += ["PolicyGradientModule"]

from alignlit.modules.online_dpo import OnlineDPOModule, PreferenceRanking  # noqa: E402

__all__ += ["OnlineDPOModule", "PreferenceRanking"]

from alignlit.modules.online_rrhf import OnlineRRHFModule  # noqa: E402

__all__ += ["OnlineRRHFModule"]
