"""One LightningModule per stage, on two bases: :class:`AlignModule` (every stage) and
:class:`OnlineModule` (the online stages, which train on a :class:`Trajectory` in :class:`Minibatches`)."""

from alignlit.models.lora import LoRA
from alignlit.modules.base import AlignModule, Optim
from alignlit.modules.dpo import DPOModule
from alignlit.modules.kto import KTOModule
from alignlit.modules.online import OnlineModule
from alignlit.modules.online_dpo import OnlineDPOModule
from alignlit.modules.online_parts import KLPenalty, PtxMix, TrainedModel
from alignlit.modules.online_rrhf import OnlineRRHFModule
from alignlit.modules.pairpref import PairwisePrefModule
from alignlit.modules.policy_gradient import PolicyGradientModule
from alignlit.modules.ppo import PPOModule
from alignlit.modules.reward import LengthHead, RewardModule
from alignlit.modules.rrhf import RRHFModule
from alignlit.modules.sft import SFTModule
from alignlit.modules.trajectory import Minibatches, Trajectory

__all__ = [
    "AlignModule",
    "DPOModule",
    "KLPenalty",
    "KTOModule",
    "LengthHead",
    "LoRA",
    "Minibatches",
    "OnlineDPOModule",
    "OnlineModule",
    "OnlineRRHFModule",
    "Optim",
    "PPOModule",
    "PairwisePrefModule",
    "PolicyGradientModule",
    "PtxMix",
    "RRHFModule",
    "RewardModule",
    "SFTModule",
    "TrainedModel",
    "Trajectory",
]
