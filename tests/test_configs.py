"""Every shipped YAML under configs/ parses against the classes it names (types, required keys)."""

from pathlib import Path

import pytest

from alignlit.cli import AlignCLI

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
PRESETS = sorted(CONFIG_DIR.joinpath("strategies").glob("*.yaml"))  # fragments stacked on a stage config
FRAGMENTS = {  # stacked on a stage config, each tested below
    *PRESETS,
    *CONFIG_DIR.joinpath("lora").glob("*.yaml"),
    *CONFIG_DIR.joinpath("speed").glob("*.yaml"),
    *CONFIG_DIR.joinpath("rollout").glob("*.yaml"),
}
CONFIGS = sorted(set(CONFIG_DIR.rglob("*.yaml")) - FRAGMENTS)


class ParseOnly(AlignCLI):
    """Parse and validate the config; build nothing (the models it names may not exist yet)."""

    def instantiate_classes(self) -> None:
        pass


def test_every_quickstart_config_has_a_paper_twin_and_every_yaml_a_test():
    """Each quickstart stage has its longer twin under configs/paper/ (and back), and every YAML under
    configs/ is a stage config (parsed below) or a fragment of a folder whose tests stack it on a stage."""
    quickstart = {p.name for p in CONFIG_DIR.joinpath("quickstart").glob("*.yaml")}
    paper = {p.name for p in CONFIG_DIR.joinpath("paper").glob("*.yaml")}
    assert quickstart == paper, f"without a twin: {sorted(quickstart ^ paper)}"
    fragment_folders = {"strategies", "lora", "speed", "rollout"}
    for path in CONFIG_DIR.rglob("*.yaml"):
        folder = path.relative_to(CONFIG_DIR).parts[0]
        assert (path in CONFIGS) != (folder in fragment_folders), (
            f"{path}: a stage config or a known fragment"
        )


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


LORA_PRESETS = sorted(CONFIG_DIR.joinpath("lora").glob("*.yaml"))


@pytest.mark.parametrize("preset", LORA_PRESETS, ids=lambda p: p.name)
def test_lora_preset_stacks_on_its_quickstart_stage(preset):
    """configs/lora/<stage>.yaml on configs/quickstart/<stage>.yaml: the stage keeps its class and data,
    gains the adapter, and writes its export and logs under names of its own."""
    cli = ParseOnly(
        args=["--config", str(CONFIG_DIR / "quickstart" / preset.name), "--config", str(preset)], run=False
    )
    args = cli.config.model.init_args
    assert args.lora.rank == 16 and args.export_dir == f"out/quickstart/{preset.stem}-lora"
    assert cli.config.trainer.logger.init_args.name == f"{preset.stem}-lora"
    assert args.policy == "out/quickstart/sft"


@pytest.mark.parametrize("stage", ["sft", "reward", "ppo"])
def test_compile_preset_appends_its_callback_to_the_stage_callbacks(stage):
    """configs/speed/compile.yaml adds CompileDecoder after the stage's own callbacks (none is lost)."""
    base = ParseOnly(args=["--config", str(CONFIG_DIR / "quickstart" / f"{stage}.yaml")], run=False)
    cli = ParseOnly(
        args=[
            "--config",
            str(CONFIG_DIR / "quickstart" / f"{stage}.yaml"),
            "--config",
            str(CONFIG_DIR / "speed" / "compile.yaml"),
        ],
        run=False,
    )
    before = [c.class_path for c in base.config.trainer.callbacks or []]
    after = [c.class_path for c in cli.config.trainer.callbacks]
    assert after == [*before, "alignlit.callbacks.CompileDecoder"]
    assert cli.config.trainer.callbacks[-1].init_args.backend == "inductor"
    assert cli.config.model.class_path == base.config.model.class_path


def test_rollout_presets_stack_on_an_online_stage():
    """configs/rollout/icepop.yaml sets the rollout correction, judge.yaml the judge reward, on quickstart GRPO."""
    base = str(CONFIG_DIR / "quickstart" / "grpo.yaml")
    icepop = ParseOnly(
        args=["--config", base, "--config", str(CONFIG_DIR / "rollout/icepop.yaml")], run=False
    )
    args = icepop.config.model.init_args
    assert args.rollout_correction == "icepop" and args.rollout_correction_args == {"low": 0.5, "high": 5.0}
    judge = ParseOnly(args=["--config", base, "--config", str(CONFIG_DIR / "rollout/judge.yaml")], run=False)
    reward = judge.config.model.init_args.reward
    assert reward.class_path == "alignlit.rewards.judge.JudgeReward" and reward.init_args.max_score == 10
    assert judge.config.model.class_path == "alignlit.modules.PolicyGradientModule"
