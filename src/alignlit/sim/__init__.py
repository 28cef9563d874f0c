"""Simulated human feedback: a task with a gold reward, noisy demonstrations and length-biased annotators.

See ``SimTask`` (prompts, ideal answers, gold reward, demonstrations), ``Annotator`` (simulated
preference labels), ``make_data`` (JSONL files in the formats real data uses), ``load_sim`` and
``SimGoldReward`` (the gold reward of a written data directory as a reward callable),
``write_tokenizer`` (a BPE tokenizer trained on the written text); ``SimHintEnvironment`` and
``SimEpisodeGold`` (the multi-turn task: a wrong answer gets a hint, each hint costs). ``alignlit sim`` is
:mod:`alignlit.cli.sim`.
"""

from alignlit.sim.annotator import Annotator
from alignlit.sim.data import load_sim, make_data, write_tokenizer
from alignlit.sim.gold import SimGoldReward
from alignlit.sim.multiturn import SimEpisodeGold, SimHintEnvironment
from alignlit.sim.task import SimTask

__all__ = [
    "Annotator",
    "SimEpisodeGold",
    "SimGoldReward",
    "SimHintEnvironment",
    "SimTask",
    "load_sim",
    "make_data",
    "write_tokenizer",
]
