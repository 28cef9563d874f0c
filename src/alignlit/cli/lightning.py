"""``alignlit fit|validate|test|predict``: LightningCLI over alignlit's stages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO

from alignlit.checkpoint_io import AtomicCheckpointIO, check_checkpoint_module, read_checkpoint
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
    - reports a stage's or DataModule's own argument error (``optim.lr must be in (0, 10]``) as a
      command-line error, without jsonargparse's dump of the whole config;
    - reads ``--trainer.limit_train_batches 1`` (and the other batch limits, ``overfit_batches`` and
      ``val_check_interval``) as the integer it is: Lightning annotates them ``float | int``, so the
      parser made ``1`` the float ``1.0`` — 100% of the batches instead of one;
    - refuses ``--trainer.logger false`` without ``--trainer.default_root_dir``: without a logger,
      Lightning writes checkpoints, curves and ``config.yaml`` into the current directory;
    - records the full parsed config, so the stage's export says how it was made.
    """

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

    def add_arguments_to_parser(self, parser) -> None:
        for action in parser._actions:
            if action.dest in INT_OR_FRACTION and hasattr(action, "_typehint"):
                action._typehint = int | float | None  # int first: "1" is one batch, "1.0" all of them

    def _parse_ckpt_path(self) -> None:
        sub = self.config.get("subcommand")
        ckpt_path = self.config[sub].get("ckpt_path") if sub else None
        if ckpt_path and ckpt_path not in ("last", "best", "hpc", "registry"):
            path = Path(ckpt_path)
            if not path.is_file():
                self.parser.error(f"--ckpt_path {ckpt_path}: no such checkpoint file")
            checkpoint = read_checkpoint(path, map_location="cpu", mmap=True)
            model = self.config[sub].get("model")
            class_path = getattr(model, "class_path", None) if model is not None else None
            if class_path:
                check_checkpoint_module(checkpoint, class_path, path)
        super()._parse_ckpt_path()

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as e:
            reasons = _union_errors(str(e))
            if not reasons:
                raise
            # a stage's or DataModule's own argument check, buried by jsonargparse under "Does not validate
            # against any of the Union subtypes" and a dump of the whole config: say only what is wrong
            self.parser.error("; ".join(reasons))

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Any:
        logger = config.get("logger")
        if (logger is False or logger == []) and not config.get("default_root_dir"):
            self.parser.error(
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
        return super()._instantiate_trainer(config, callbacks)

    def _record_config(self) -> None:
        sub = self.config.get("subcommand")
        cfg = self.config[sub] if sub else self.config
        self.model.cli_config = _to_plain(cfg)

    def before_fit(self) -> None:
        self._record_config()


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
