"""Every shipped YAML under configs/ parses against the classes it names (types, required keys)."""

from pathlib import Path

import pytest

from alignlit.cli import AlignCLI

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
PRESETS = sorted(CONFIG_DIR.joinpath("strategies").glob("*.yaml"))  # fragments stacked on a stage config
CONFIGS = sorted(set(CONFIG_DIR.rglob("*.yaml")) - set(PRESETS))


class ParseOnly(AlignCLI):
    """Parse and validate the config; build nothing (the models it names may not exist yet)."""

    def instantiate_classes(self) -> None:
        pass


def test_configs_exist():
    assert len(CONFIGS) >= 1


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_config_parses(config):
    cli = ParseOnly(args=["--config", str(config)], run=False)
    cfg = cli.config
    assert cfg.model.class_path.startswith("alignlit.modules.")
    assert cfg.data.class_path.startswith("alignlit.data.")
    # the stage's result goes somewhere documented
    assert cfg.model.init_args.get("export_dir"), f"{config}: model.init_args.export_dir is not set"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_strategy_preset_stacks_on_a_stage(preset):
    cli = ParseOnly(
        args=["--config", str(CONFIG_DIR / "quickstart/sft.yaml"), "--config", str(preset)], run=False
    )
    assert cli.config.trainer.devices in (2, 4)
    assert cli.config.model.class_path == "alignlit.modules.SFTModule"
