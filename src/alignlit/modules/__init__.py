"""One LightningModule per stage."""

from alignlit.modules.base import AlignModule
from alignlit.modules.sft import SFTModule

__all__ = ["AlignModule", "SFTModule"]
