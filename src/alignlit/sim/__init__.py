"""Simulated human feedback: a task with a gold reward, noisy demonstrations and length-biased annotators.

See ``SimTask`` (prompts, ideal answers, gold reward, demonstrations), ``Annotator`` (simulated
preference labels) and ``make_data`` (JSONL files in the formats real data uses).
"""

from alignlit.sim.annotator import Annotator
from alignlit.sim.data import make_data
from alignlit.sim.task import SimTask

__all__ = ["Annotator", "SimTask", "make_data"]
