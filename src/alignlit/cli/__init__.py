"""The ``alignlit`` command: every command-line entry point of the project, and nothing else.

``alignlit fit|validate|test|predict --config stage.yaml`` runs a stage through LightningCLI
(:class:`alignlit.cli.lightning.AlignCLI`; every field overridable on the command line, ``alignlit fit
--help`` and ``--model.help CLASS`` document them). The other subcommands are plain argparse tools, one
module each: ``alignlit sim …`` (:mod:`alignlit.cli.sim`, simulated-feedback data), ``alignlit eval …``
(:mod:`alignlit.cli.eval`, gold-reward evaluation of policies), ``alignlit sample …``
(:mod:`alignlit.cli.sample`, n responses per prompt ranked by a reward: best-of-n, DPO pairs,
rejection-sampling data), ``alignlit score …`` (:mod:`alignlit.cli.score`, score records with a trained
reward model), ``alignlit serve …`` (:mod:`alignlit.cli.serve`, a vLLM rollout engine server). The library
functions these tools call live in the library packages (``alignlit.eval``, ``alignlit.rollout``, ``alignlit.sim``); nothing below ``alignlit.cli`` imports it.
"""

from __future__ import annotations

import importlib
import os
import sys

LIGHTNING_SUBCOMMANDS = {"fit", "validate", "test", "predict"}

#: ``alignlit <name>`` -> the module whose ``main(argv)`` runs it (imported only when used)
TOOLS = {
    "sim": "alignlit.cli.sim",
    "eval": "alignlit.cli.eval",
    "sample": "alignlit.cli.sample",
    "score": "alignlit.cli.score",
    "serve": "alignlit.cli.serve",
}

USAGE = """usage: alignlit {fit,validate,test,predict} --config STAGE.yaml [--key value ...]
       alignlit sim make-data --out DIR [...]
       alignlit eval --sim DIR --policy DIR [...]        (the simulated task's gold reward)
       alignlit eval --policy ID|DIR --dataset openai/gsm8k --dataset-name main --split test \
           --columns question:prompt --chat --reward alignlit.rewards.math.MathVerifyReward [...]
       alignlit sample --policy DIR --prompts FILE --n N --out ranked.jsonl [--scorer RM_DIR|gold] [...]
       alignlit score --model RM_DIR (--input FILE --output scores.jsonl | --pairs FILE)
       alignlit serve MODEL_DIR [--port P] [-- vllm serve args]   (a rollout engine for engine: vllm_server)

Run `alignlit fit --help` for the training stages and `alignlit <tool> --help` for the tools."""


def main(argv: list[str] | None = None):
    """Entry point of the ``alignlit`` console script (and of ``python -m alignlit.cli``).

    ``argv`` defaults to ``sys.argv[1:]``; a tool's return value is passed through (tests use it).
    """
    explicit = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from alignlit.quiet import install

    install()  # the benign messages of Lightning and transformers, by exact text (alignlit.quiet)
    if not argv or argv[0] in {"-h", "--help"}:
        print(USAGE)
        return None
    if argv[0] in TOOLS:
        result = importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
        # the console script passes the return value to sys.exit: only an exit status may reach it
        return result if explicit or isinstance(result, int) else None
    if argv[0] not in LIGHTNING_SUBCOMMANDS and not argv[0].startswith("-"):
        sys.exit(f"alignlit: unknown command {argv[0]!r}\n{USAGE}")
    from alignlit.cli.lightning import AlignCLI

    AlignCLI(args=argv if explicit else None)
    return None


def __getattr__(name: str):
    # `from alignlit.cli import AlignCLI` without importing Lightning for the plain tools
    if name == "AlignCLI":
        from alignlit.cli.lightning import AlignCLI

        return AlignCLI
    raise AttributeError(f"module 'alignlit.cli' has no attribute {name!r}")


__all__ = ["LIGHTNING_SUBCOMMANDS", "TOOLS", "USAGE", "AlignCLI", "main"]
