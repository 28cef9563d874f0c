"""``alignlit fit|validate|test|predict``: LightningCLI over alignlit's stages."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO

from alignlit.checkpoint_io import (
    CHECKPOINT_KEY,
    AtomicCheckpointIO,
    check_checkpoint_module,
    read_checkpoint,
)
from alignlit.cli.config_errors import AlignArgumentParser
from alignlit.cli.jsonargparse_internals import parser_actions, set_typehint
from alignlit.cli.resume import config_changes, hparams_changes, refusal
from alignlit.cli.run_dir import default_logger
from alignlit.lightning_internals import subcommand_parser
from alignlit.modules.base import AlignModule

INT_OR_FRACTION = {
    f"trainer.{name}"
    for name in (
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "limit_predict_batches",
        "overfit_batches",
        "val_check_interval",
    )
}
"""Trainer arguments where an integer counts batches and a float is a fraction."""


class AlignCLI(LightningCLI):
    """LightningCLI over alignlit's stages: ``model: class_path: alignlit.modules.<Stage>``.

    On top of LightningCLI it

    - installs :class:`~alignlit.checkpoint_io.AtomicCheckpointIO` (checkpoints written beside their
      destination, fsynced and renamed into place) unless the config names another ``CheckpointIO``;
    - checks a ``--ckpt_path`` before anything is built: a truncated or foreign file, or a checkpoint
      of another stage than the config's ``model``, is an error naming the file and both classes;
    - applies the resume contract (:mod:`alignlit.cli.resume`): the config is compared with the one the
      checkpoint records; changes of where and how long the run goes are applied and logged, changes of
      what it trains are refused naming each field (LightningCLI instead replaced the model's arguments
      by the checkpoint's hyperparameters, silently);
    - reports command-line and config errors in one line naming the field, the file it came from and
      the closest valid name (:mod:`alignlit.cli.config_errors`), without the usage dump;
    - reports a stage's or DataModule's own argument error (``optim.lr must be in (0, 10]``) as a
      command-line error, without jsonargparse's dump of the whole config;
    - reads ``--trainer.limit_train_batches 1`` (and the other batch limits, ``overfit_batches`` and
      ``val_check_interval``) as the integer it is: Lightning annotates them ``float | int``, so the
      parser made ``1`` the float ``1.0`` — 100% of the batches instead of one;
    - runs on one device unless the config says more (``trainer.devices`` defaults to 1, not Lightning's
      ``auto``, which starts a process per GPU; the accelerator stays ``auto``: the GPU where there is one);
    - logs beside the stage's export unless the config names a logger: ``export_dir: out/quickstart/grpo``
      makes the default logger ``CSVLogger(save_dir="out/quickstart/logs", name="grpo")``
      (:mod:`alignlit.cli.run_dir`);
    - refuses ``--trainer.logger false`` without ``--trainer.default_root_dir``: without a logger,
      Lightning writes checkpoints, curves and ``config.yaml`` into the current directory;
    - records the full parsed config, so the stage's export says how it was made.
    """

    def __init__(self, args=None, run: bool = True):
        argv = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        AlignArgumentParser.argv = argv
        self.command = ["alignlit", *argv]
        trainer_defaults: dict[str, Any] = {"use_distributed_sampler": False, "devices": 1}
        if (logger := default_logger(argv)) is not None:
            trainer_defaults["logger"] = logger
        super().__init__(
            parser_class=AlignArgumentParser,
            model_class=AlignModule,
            datamodule_class=LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "alignlit"},
            trainer_defaults=trainer_defaults,
            args=args,
            run=run,
        )

    def add_arguments_to_parser(self, parser) -> None:
        for action in parser_actions(parser):
            if action.dest in INT_OR_FRACTION:
                set_typehint(action, int | float | None)  # int first: "1" is one batch, "1.0" all of them

    def _parse_ckpt_path(self) -> None:
        sub = self.config.get("subcommand")
        ckpt_path = self.config[sub].get("ckpt_path") if sub else None
        if ckpt_path and ckpt_path not in ("last", "best", "hpc", "registry"):
            path = Path(ckpt_path)
            if not path.is_file():
                self._fail(f"--ckpt_path {ckpt_path}: no such checkpoint file")
            checkpoint = read_checkpoint(path, map_location="cpu", mmap=True)
            model = self.config[sub].get("model")
            class_path = getattr(model, "class_path", None) if model is not None else None
            if class_path:
                check_checkpoint_module(checkpoint, class_path, path)
            self._check_resume(checkpoint, ckpt_path, _to_plain(self.config[sub]))
        # not LightningCLI's: it replaces the model's arguments by the checkpoint's hyperparameters

    def _fail(self, message: str):
        """Exit with status 2 and ``message``, as ``alignlit <subcommand>: error: ...``."""
        sub = self.config.get("subcommand") if getattr(self, "config", None) is not None else None
        parser = subcommand_parser(self, sub, self.parser)
        parser.fail(message)

    def _check_resume(self, checkpoint: dict, ckpt_path: str, given: dict[str, Any]) -> None:
        """The resume contract (:mod:`alignlit.cli.resume`): refuse changed settings that the run's
        optimisation depends on, naming each; log the changes that are applied."""
        saved = (checkpoint.get(CHECKPOINT_KEY) or {}).get("config")
        if saved:
            changes = config_changes(saved, given)
        else:
            changes = hparams_changes(checkpoint.get("hyper_parameters") or {}, given.get("model") or {})
            print(
                f"alignlit: {ckpt_path} records no config (written outside `alignlit fit` or by an older "
                "alignlit): only the model's saved hyperparameters are compared with this command line"
            )
        refused = [c for c in changes if not c.applied]
        if refused:
            self._fail(refusal(ckpt_path, refused))
        for change in changes:
            print(f"alignlit: resuming {ckpt_path} with a changed setting: {change}")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as e:
            reasons = _union_errors(str(e))
            if not reasons:
                raise
            # a stage's or DataModule's own argument check, buried by jsonargparse under "Does not validate
            # against any of the Union subtypes" and a dump of the whole config: say only what is wrong
            self._fail("; ".join(reasons))

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Any:
        logger = config.get("logger")
        if (logger is False or logger == []) and not config.get("default_root_dir"):
            self._fail(
                "--trainer.logger false needs --trainer.default_root_dir DIR: without a logger, checkpoints "
                "without a dirpath, curves and config.yaml would be written into the current directory"
            )
        plugins = config.get("plugins")
        plugins = (
            [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        )
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        config["plugins"] = plugins
        configured = config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in [*configured, *callbacks]
        ):
            from alignlit.lightning_internals import rich_available

            if rich_available():  # else Lightning's tqdm bar, which has no "Epoch 0/-2"
                callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def _record_config(self) -> None:
        sub = self.config.get("subcommand")
        cfg = self.config[sub] if sub else self.config
        self.model.cli_config = _to_plain(cfg)
        self.model.cli_command = self.command

    def before_fit(self) -> None:
        self._record_config()


class StepProgressBar(RichProgressBar):
    """Lightning's Rich progress bar, whose description is ``Epoch N`` when the run's length is in steps
    (Lightning's own writes ``Epoch 0/-2`` for ``max_epochs = -1``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            description += f"/{self.trainer.max_epochs - 1}"
        if len(self.validation_description) > len(description):
            description = f"{description:{len(self.validation_description)}}"
        return description


def _union_errors(message: str) -> list[str]:
    """The reasons jsonargparse lists under "Errors:" when no subtype of ``X | None`` could be built
    (without the "Expected a <class 'NoneType'>" of the ``None`` branch)."""
    if "Does not validate against any of the Union subtypes" not in message or "Errors:" not in message:
        return []
    block = message.split("Errors:", 1)[1].split("Given value type:", 1)[0]
    reasons = [line.strip()[2:].strip() for line in block.splitlines() if line.strip().startswith("- ")]
    return [r for r in reasons if not r.startswith("Expected a <class 'NoneType'>")]


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
