"""The shipped configs under configs/: every YAML parses in the stacks that use it, and every stack the
README, the docs, the recipes, the examples and the noxfile write down parses.

Layout (configs/README.md): a stage base per stage under ``quickstart/``; overlays for a variant
(``dpo/`` losses, ``async/``, ``served/``, ``verifiable/``), for the paper's size (``paper/``), and
fragments for any stage (``strategies/``, ``lora/``, ``speed/``, ``rollout/``). A run is named like its
export directory; its stack is written in its paper overlay's header (benchmarks/harness/ reads it).
"""

import itertools
import re
import sys
from pathlib import Path

import pytest
import yaml

from alignlit.cli import AlignCLI

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import SCALES, config_stack, header_stack, read_config, runs  # noqa: E402

PRESETS = sorted(CONFIG_DIR.joinpath("strategies").glob("*.yaml"))  # fragments stacked on a stage config
FRAGMENT_FOLDERS = ("strategies", "lora", "speed", "rollout")  # stacked on any stage, each tested below
OVERLAY_FOLDERS = ("paper", "dpo", "async", "served", "verifiable")  # parts of a run's stack
BASE_FOLDERS = ("quickstart", "hh")  # a stage on its own
RUNS = [(scale, name) for scale in SCALES for name in runs()]
#: text that writes `alignlit fit --config ...` commands down
DOCUMENTS = sorted(
    p
    for p in [
        ROOT / "README.md",
        ROOT / "noxfile.py",
        *ROOT.joinpath("docs").rglob("*.md"),
        *ROOT.joinpath("recipes").rglob("*.md"),
        *ROOT.joinpath("recipes").rglob("*.yaml"),
        *ROOT.joinpath("examples").rglob("*"),
        *CONFIG_DIR.rglob("*.yaml"),
        CONFIG_DIR / "README.md",
    ]
    if p.is_file()
)


class ParseOnly(AlignCLI):
    """Parse and validate the config; build nothing (the models it names may not exist yet)."""

    def instantiate_classes(self) -> None:
        pass


def parse(*configs) -> AlignCLI:
    return ParseOnly(args=[arg for c in configs for arg in ("--config", str(c))], run=False)


def folder(path: Path) -> str:
    return path.relative_to(CONFIG_DIR).parts[0]


def test_every_yaml_is_a_base_an_overlay_or_a_fragment():
    known = (*BASE_FOLDERS, *OVERLAY_FOLDERS, *FRAGMENT_FOLDERS)
    for path in CONFIG_DIR.rglob("*.yaml"):
        assert folder(path) in known, f"{path}: in no known folder of configs/"
        has_stage = "class_path" in (yaml.safe_load(path.read_text()).get("model") or {})
        assert has_stage == (folder(path) in BASE_FOLDERS), f"{path}: only a base names the stage class"


@pytest.mark.parametrize(("scale", "name"), RUNS, ids=lambda v: v)
def test_every_run_parses_and_exports_under_its_name(scale, name):
    """Each run (stage base + overlays) parses against the classes it names, writes its export to
    out/<scale>/<name> and logs and checkpoints beside it."""
    stack = config_stack(name, scale)
    cli = parse(*stack)
    cfg = cli.config
    assert cfg.model.class_path.startswith("alignlit.modules.")
    assert cfg.data.class_path.startswith("alignlit.data.")
    assert cfg.model.init_args.export_dir == f"out/{scale}/{name}"
    assert cfg.trainer.logger.init_args.save_dir == f"out/{scale}/logs"
    assert cfg.trainer.logger.init_args.name == name
    for callback in cfg.trainer.callbacks or []:
        if callback.class_path.endswith("ModelCheckpoint"):
            assert callback.init_args.dirpath == f"out/{scale}/checkpoints/{name}"
    if scale == "paper":  # paper sizes are overlays on the quickstart run
        assert (
            stack[:-1] == config_stack(name, "quickstart") and stack[-1] == CONFIG_DIR / f"paper/{name}.yaml"
        )


def test_every_overlay_is_in_a_run():
    used = {path for scale, name in RUNS for path in config_stack(name, scale)}
    for path in CONFIG_DIR.rglob("*.yaml"):
        if folder(path) in OVERLAY_FOLDERS or folder(path) == "quickstart":
            assert path in used, f"{path}: in no run's stack"
    # and the headers of the variant overlays name the stack they are in
    for path in CONFIG_DIR.rglob("*.yaml"):
        if folder(path) in OVERLAY_FOLDERS:
            assert header_stack(path)[-1] == path


@pytest.mark.parametrize("config", sorted(CONFIG_DIR.joinpath("hh").glob("*.yaml")), ids=lambda p: p.name)
def test_standalone_stage_parses(config):
    cfg = parse(config).config
    assert cfg.model.init_args.export_dir and cfg.trainer.logger.init_args.name == config.stem


#: stages that run the same schedule on purpose (the offline preference stages are compared at equal
#: steps), in their quickstart bases and their paper overlays
SAME_SCHEDULE = [
    {f"quickstart/{s}.yaml" for s in ("dpo", "kto", "rft", "rrhf")},
    {f"paper/{s}.yaml" for s in ("dpo", "cdpo", "ipo", "orpo", "simpo", "kto", "rft", "rrhf")},
]


def test_no_config_repeats_another_s_trainer_block():
    """The logger is derived from the export directory (alignlit.cli.run_dir), never written; no two files
    set the same trainer settings or the same checkpoint callback (but the stages of SAME_SCHEDULE)."""
    trainers = {}
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer")
        if trainer:
            assert "logger" not in trainer, f"{path}: the logger follows model.init_args.export_dir"
            trainers[str(path.relative_to(CONFIG_DIR))] = trainer
    for (a, ta), (b, tb) in itertools.combinations(trainers.items(), 2):
        assert ta.get("callbacks") is None or ta.get("callbacks") != tb.get("callbacks"), (a, b)
        assert ta != tb or any({a, b} <= group for group in SAME_SCHEDULE), (
            f"{a} and {b}: the same trainer block"
        )


def commands(text: str) -> list[list[str]]:
    """The config stacks of the `alignlit fit --config a [--config b ...]` commands written in ``text``
    (shell lines, backquoted, continued with a backslash, or as a Python list of strings)."""
    text = text.replace("\\\n", " ")
    stacks = []
    for line in text.splitlines():
        line = line.lstrip("#").strip()
        for match in re.finditer(r"alignlit fit ((?:--config[ =][\w./-]+\.yaml\s*)+)", line):
            stacks.append(re.findall(r"--config[ =]([\w./-]+\.yaml)", match.group(1)))
    for match in re.finditer(r'\[\s*"alignlit",\s*"fit",((?:\s*"--config",\s*"[^"]+",?)+)', text):
        stacks.append(re.findall(r'"--config",\s*"([^"]+)"', match.group(1)))
    return stacks


def test_commands_are_found_in_documents():
    text = (
        "run `alignlit fit --config configs/quickstart/grpo.yaml --config configs/verifiable/grpo.yaml`, or\n"
    )
    text += "alignlit fit --config configs/quickstart/sft.yaml \\\n  --config configs/paper/sft.yaml  # 800 steps\n"
    text += '["alignlit", "fit", "--config", "configs/quickstart/dpo.yaml"],'
    assert commands(text) == [
        ["configs/quickstart/grpo.yaml", "configs/verifiable/grpo.yaml"],
        ["configs/quickstart/sft.yaml", "configs/paper/sft.yaml"],
        ["configs/quickstart/dpo.yaml"],
    ]


def documented_stacks() -> list[tuple[str, ...]]:
    found = set()
    for path in DOCUMENTS:
        for stack in commands(path.read_text(errors="replace")):
            if all((ROOT / c).is_file() for c in stack) and stack[0].startswith(("configs/", "recipes/")):
                found.add(tuple(stack))
    return sorted(found)


DOCUMENTED = documented_stacks()


def test_documented_commands_name_existing_configs():
    """Every `alignlit fit --config` path written in the README, docs, recipes, examples, noxfile and the
    configs' own headers exists (a moved config is a broken command)."""
    missing = []
    for path in DOCUMENTS:
        for stack in commands(path.read_text(errors="replace")):
            missing += [
                f"{path.relative_to(ROOT)}: {c}" for c in stack if "..." not in c and not (ROOT / c).is_file()
            ]
    assert not missing, missing
    assert len(DOCUMENTED) >= 40


@pytest.mark.parametrize(
    "stack", DOCUMENTED, ids=lambda s: "+".join(c.removeprefix("configs/").removesuffix(".yaml") for c in s)
)
def test_documented_stack_parses(stack):
    if stack[0].startswith("recipes/"):
        pytest.importorskip("math_verify") if "gsm8k" in stack[0] else None
    cfg = parse(*(ROOT / c for c in stack)).config
    assert cfg.model.class_path.startswith(("alignlit.modules.", "examples."))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_strategy_preset_stacks_on_a_stage(preset):
    cli = parse(CONFIG_DIR / "quickstart/sft.yaml", preset)
    assert cli.config.trainer.devices in (2, 4)
    assert cli.config.model.class_path == "alignlit.modules.SFTModule"


LORA_PRESETS = sorted(CONFIG_DIR.joinpath("lora").glob("*.yaml"))


@pytest.mark.parametrize("preset", LORA_PRESETS, ids=lambda p: p.name)
def test_lora_preset_stacks_on_its_quickstart_stage(preset):
    """configs/lora/<stage>.yaml on configs/quickstart/<stage>.yaml: the stage keeps its class and data,
    gains the adapter, and writes its export and logs under names of its own."""
    cli = parse(CONFIG_DIR / "quickstart" / preset.name, preset)
    args = cli.config.model.init_args
    assert args.lora.rank == 16 and args.export_dir == f"out/quickstart/{preset.stem}-lora"
    assert cli.config.trainer.logger.init_args.name == f"{preset.stem}-lora"
    assert args.policy == "out/quickstart/sft"


@pytest.mark.parametrize("stage", ["sft", "reward", "ppo"])
def test_compile_preset_appends_its_callback_to_the_stage_callbacks(stage):
    """configs/speed/compile.yaml adds CompileDecoder after the stage's own callbacks (none is lost)."""
    base = parse(CONFIG_DIR / "quickstart" / f"{stage}.yaml")
    cli = parse(CONFIG_DIR / "quickstart" / f"{stage}.yaml", CONFIG_DIR / "speed" / "compile.yaml")
    before = [c.class_path for c in base.config.trainer.callbacks or []]
    after = [c.class_path for c in cli.config.trainer.callbacks]
    assert after == [*before, "alignlit.callbacks.CompileDecoder"]
    assert cli.config.trainer.callbacks[-1].init_args.backend == "inductor"
    assert cli.config.model.class_path == base.config.model.class_path


ONLINE = sorted(
    p.stem for p in CONFIG_DIR.joinpath("quickstart").glob("*.yaml") if "minibatches:" in p.read_text()
)


@pytest.mark.parametrize("stage", ONLINE)
def test_token_budget_preset_stacks_on_every_online_stage(stage):
    """configs/speed/token-budget.yaml sets minibatches.token_budget and keeps the stage's own minibatches."""
    base = parse(CONFIG_DIR / "quickstart" / f"{stage}.yaml").config
    cfg = parse(
        CONFIG_DIR / "quickstart" / f"{stage}.yaml", CONFIG_DIR / "speed" / "token-budget.yaml"
    ).config
    assert base.model.init_args.minibatches.token_budget is None
    assert cfg.model.init_args.minibatches.token_budget == 512
    for key in ("size", "epochs", "steps", "shuffle"):
        assert cfg.model.init_args.minibatches[key] == base.model.init_args.minibatches[key], (stage, key)
    assert cfg.model.class_path == base.model.class_path
    assert len(ONLINE) >= 8  # grpo, rloo, ppo, ppo-vanilla, distill, online-dpo, online-rrhf, multi-turn ones


@pytest.mark.parametrize("stage", ONLINE)
def test_shared_prompt_preset_stacks_on_every_online_stage(stage):
    """configs/speed/shared-prompt.yaml sets the HF engine's static cache and shared prompt, nothing else of
    the rollout."""
    base = parse(CONFIG_DIR / "quickstart" / f"{stage}.yaml").config.model.init_args.rollout.init_args
    rollout = parse(
        CONFIG_DIR / "quickstart" / f"{stage}.yaml", CONFIG_DIR / "speed" / "shared-prompt.yaml"
    ).config.model.init_args.rollout.init_args
    assert base.get("hf") is None or (base.hf.kv_cache, base.hf.share_prompt) == ("dynamic", False)
    assert (rollout.hf.kv_cache, rollout.hf.share_prompt, rollout.hf.compile) == ("static", True, False)
    others = lambda ns: {k: v for k, v in ns.items() if k.split(".")[0] != "hf"}  # noqa: E731
    assert others(rollout) == others(base)


def test_rollout_presets_stack_on_an_online_stage():
    """configs/rollout/icepop.yaml sets the rollout correction, judge.yaml the judge reward, on quickstart GRPO."""
    base = CONFIG_DIR / "quickstart" / "grpo.yaml"
    icepop = parse(base, CONFIG_DIR / "rollout/icepop.yaml")
    args = icepop.config.model.init_args
    assert args.rollout_correction == "icepop" and args.rollout_correction_args == {"low": 0.5, "high": 5.0}
    judge = parse(base, CONFIG_DIR / "rollout/judge.yaml")
    reward = judge.config.model.init_args.reward
    assert reward.class_path == "alignlit.rewards.judge.JudgeReward" and reward.init_args.max_score == 10
    assert judge.config.model.class_path == "alignlit.modules.PolicyGradientModule"


def test_the_logger_follows_the_config_files_export_only():
    """No config logger: CSVLogger beside the export the config files set; a command-line export_dir moves
    the export only; a config's own logger wins."""
    sft = CONFIG_DIR / "quickstart/sft.yaml"
    logger = parse(sft).config.trainer.logger
    assert logger.class_path == "lightning.pytorch.loggers.CSVLogger"
    assert (logger.init_args.save_dir, logger.init_args.name) == ("out/quickstart/logs", "sft")
    cli = ParseOnly(args=["--config", str(sft), "--model.init_args.export_dir=elsewhere/x"], run=False)
    assert cli.config.trainer.logger.init_args.name == "sft"
    cli = ParseOnly(
        args=["--config", str(sft), "--trainer.logger=false", "--trainer.default_root_dir=r"], run=False
    )
    assert cli.config.trainer.logger is False


def test_the_merged_yaml_of_a_run_is_its_parsed_config():
    """benchmarks/harness/'s read_config (the stack merged as YAML) agrees with the parser on what the
    benchmarks read from it."""
    for scale, name in [("quickstart", "grpo-verifiable"), ("paper", "dapo-verifiable"), ("paper", "ppo")]:
        merged, parsed = read_config(name, scale), parse(*config_stack(name, scale)).config
        assert merged["model"]["init_args"]["export_dir"] == parsed.model.init_args.export_dir
        assert merged["model"]["init_args"]["optim"]["lr"] == parsed.model.init_args.optim.lr
        assert merged["trainer"].get("limit_train_batches") == parsed.trainer.limit_train_batches
