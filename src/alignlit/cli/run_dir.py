"""Where a stage's curves go when its config names no logger: beside its export.

A stage exporting to ``out/quickstart/grpo`` logs to ``CSVLogger(save_dir="out/quickstart/logs",
name="grpo")``, the layout every shipped config used to spell out in its own ``trainer.logger`` block.
:class:`~alignlit.cli.lightning.AlignCLI` sets it as the Trainer's ``logger`` *default*: a config or
command line that gives ``trainer.logger`` (another logger, another directory, ``false``) replaces it, and
``--print_config`` shows it like any other value. The export directory is the one the ``--config``
files set (the last of them that sets it), read before parsing; a command-line
``--model.init_args.export_dir`` moves the export, not the logs (as when every config spelt out its logger).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from alignlit.cli.config_errors import _load_yaml, config_files


def export_dir(argv: list[str]) -> str | None:
    """The ``model.init_args.export_dir`` the ``--config`` files of a command line set (the last one)."""
    found = None
    for path in config_files(argv):
        try:
            cfg = _load_yaml(path) if path.is_file() else None
        except Exception:  # a broken file is the parser's to report, with its own message
            cfg = None
        model = cfg.get("model") if isinstance(cfg, dict) else None
        init = model.get("init_args") if isinstance(model, dict) else None
        if isinstance(init, dict) and init.get("export_dir"):
            found = str(init["export_dir"])
    return found


def default_logger(argv: list[str]) -> dict[str, Any] | None:
    """``CSVLogger(save_dir=<export parent>/logs, name=<export name>)``, or ``None`` when no config file
    sets an export directory."""
    export = export_dir(argv)
    if not export:
        return None
    path = PurePosixPath(export.rstrip("/"))
    return {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(path.parent / "logs"), "name": path.name},
    }
