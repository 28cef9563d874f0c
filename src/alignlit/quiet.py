"""The one place where alignlit silences what its dependencies say and is benign for alignlit.

Each entry of :data:`BENIGN` names one message by its exact text and why it is benign; nothing else is
filtered, so every other warning (a real problem: a config that logs less often than it trains, a
missing weight, a deprecation in your own code) is printed as before. Where the fact behind a message
is worth knowing, alignlit says it in one line of its own words instead.

:func:`install` applies the table to the process (``alignlit`` does, for every command); library code
that knows a message is expected in one call (a fresh reward head's load report) uses
:func:`expected_load_report`. (``alignlit fit``'s progress bar without Lightning's ``Epoch 0/-2`` is
:class:`alignlit.cli.lightning.StepProgressBar`.)
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Benign:
    """One message, by exact text (a regex of its fixed words), and why it needs no action."""

    pattern: str
    why: str
    #: alignlit's own line in its place (from the match), or None to say nothing
    say: Callable[[re.Match], str] | None = None

    def match(self, text: str) -> re.Match | None:
        return re.match(self.pattern, text, flags=re.S)


BENIGN = (
    Benign(
        r"`isinstance\(treespec, LeafSpec\)` is deprecated, use `isinstance\(treespec, TreeSpec\) and "
        r"treespec\.is_leaf\(\)` instead\.$",
        "Lightning 2.6's own code calls a function torch 2.10 deprecated; nothing a user can change",
    ),
    Benign(
        r"Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization "
        r"state was saved\. The checkpoint will contain the model state AFTER optimization\.",
        "the online stages optimise manually and are checkpointed after a rollout's updates, which is the "
        "state a resume continues from (printed once per checkpoint, with 13 lines of example code)",
    ),
    Benign(
        r"Found (\d+) module\(s\) in eval mode at the start of training\. This may lead to unexpected "
        r"behavior during training\. If this is intentional, you can ignore this warning\.$",
        "alignlit trains with dropout off and keeps frozen models (reference, reward, a preference model) "
        "in eval mode, by design",
        say=lambda m: (
            f"{m.group(1)} modules are in eval mode at the start of training, as alignlit intends: frozen "
            "models (reference, reward) and trained ones with dropout off"
        ),
    ),
    Benign(
        r"Checkpoint directory .+ exists and is not empty\.$",
        "alignlit refuses a run whose checkpoint folder holds another run's checkpoints "
        "(alignlit.callbacks.CheckpointStageStamp); what Lightning warns about here is a resume into its own "
        "run's folder",
    ),
    Benign(
        r"💡 Tip: For seamless cloud (logging and experiment tracking|uploads and versioning), try installing "
        r"\[(litlogger|litmodels)\]",
        "an advertisement for Lightning's cloud services",
    ),
)
"""Every message alignlit's commands leave out or rephrase."""

LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def benign(text: str) -> tuple[Benign, re.Match] | None:
    """The :data:`BENIGN` entry ``text`` is, with its match; None for any other message."""
    for entry in BENIGN:
        m = entry.match(text)
        if m:
            return entry, m
    return None


class _BenignRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _handled(record.getMessage()) is False


def _handled(text: str) -> bool:
    """True when ``text`` is benign (and alignlit's own line, if any, was printed)."""
    found = benign(text)
    if found is None:
        return False
    entry, m = found
    if entry.say is not None:
        print(f"alignlit: {entry.say(m)}", file=sys.stderr, flush=True)
    return True


_installed = False


def install() -> None:
    """Apply :data:`BENIGN` to this process: warnings and Lightning's info messages that match an
    entry are left out (or replaced by alignlit's line); everything else is shown as before."""
    global _installed
    if _installed:
        return
    _installed = True
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not _handled(str(message)):
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    for name in LIGHTNING_INFO_LOGGERS:
        logging.getLogger(name).addFilter(_BenignRecords())


class _LoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextmanager
def expected_load_report() -> Iterator[None]:
    """Leave out transformers' load report of the ``from_pretrained`` calls inside: for a call whose
    missing and unexpected weights the caller checks itself (a fresh scalar head on a causal LM, whose
    ``lm_head`` is unused) and reports in its own words."""
    logger = logging.getLogger("transformers.modeling_utils")
    report = _LoadReport()
    logger.addFilter(report)
    try:
        yield
    finally:
        logger.removeFilter(report)
