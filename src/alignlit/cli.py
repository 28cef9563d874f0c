"""The ``alignlit`` command.

``alignlit fit|validate|test|predict --config stage.yaml`` runs a stage through LightningCLI (every
field overridable on the command line, ``alignlit fit --help`` and ``--model.help CLASS`` document
them). Other subcommands are plain tools: ``alignlit sim …`` (simulated-feedback data),
``alignlit eval …`` (gold-reward evaluation of a policy), ``alignlit sample …`` (n responses per prompt,
ranked by a reward model: best-of-n, DPO pairs, rejection-sampling data), ``alignlit score …`` (score
records with a trained reward model).
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from alignlit.modules.base import AlignModule

LIGHTNING_SUBCOMMANDS = {"fit", "validate", "test", "predict"}


class AlignCLI(LightningCLI):
    """LightningCLI over alignlit's stages: ``model: class_path: alignlit.modules.<Stage>``."""

    def __init__(self, args=None, run: bool = True):
        super().__init__(
            model_class=AlignModule,
            datamodule_class=LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"use_distributed_sampler": False},
            args=args,
            run=run,
        )

    def _record_config(self) -> None:
        sub = self.config.get("subcommand")
        cfg = self.config[sub] if sub else self.config
        self.model.cli_config = _to_plain(cfg)

    def before_fit(self) -> None:
        self._record_config()


def _to_plain(ns):
    from jsonargparse import Namespace

    if isinstance(ns, Namespace):
        return {k: _to_plain(v) for k, v in vars(ns).items() if not k.startswith("__")}
    if isinstance(ns, dict):
        return {k: _to_plain(v) for k, v in ns.items()}
    if isinstance(ns, (list, tuple)):
        return [_to_plain(v) for v in ns]
    if isinstance(ns, (str, int, float, bool)) or ns is None:
        return ns
    return str(ns)


def _tools() -> dict:
    from alignlit.eval import cli as eval_cli
    from alignlit.eval import score
    from alignlit.rollout import sampling
    from alignlit.sim import cli as sim_cli

    return {"sim": sim_cli.main, "eval": eval_cli.main, "sample": sampling.main, "score": score.main}


USAGE = """usage: alignlit {fit,validate,test,predict} --config STAGE.yaml [--key value ...]
       alignlit sim make-data --out DIR [...]
       alignlit eval --sim DIR --policy DIR [...]
       alignlit sample --policy DIR --prompts FILE --n N --out ranked.jsonl [--scorer RM_DIR|gold] [...]
       alignlit score --model RM_DIR (--input FILE --output scores.jsonl | --pairs FILE)

Run `alignlit fit --help` for the training stages and `alignlit <tool> --help` for the tools."""


def main(argv: list[str] | None = None) -> None:
    explicit = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not argv or argv[0] in {"-h", "--help"}:
        print(USAGE)
        return
    tools = _tools()
    if argv[0] in tools:
        tools[argv[0]](argv[1:])
        return
    if argv[0] not in LIGHTNING_SUBCOMMANDS and not argv[0].startswith("-"):
        sys.exit(f"alignlit: unknown command {argv[0]!r}\n{USAGE}")
    AlignCLI(args=argv if explicit else None)


if __name__ == "__main__":
    main()
