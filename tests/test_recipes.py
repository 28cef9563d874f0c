"""recipes/: every recipe and overlay parses, and every recipe runs with its smoke overlay the way a user
runs it: ``alignlit fit --config recipes/<name>/<recipe>.yaml --config recipes/<name>/<smoke>.yaml`` in a
subprocess, the recipe's hub model id resolved through a real offline Hugging Face cache that holds a tiny
random model of its architecture under that id (tests/hubcache.py), the data read from ../shared/data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from alignlit.cli import AlignCLI
from tests.hubcache import hub_env, make_hub_cache

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
OVERLAYS = {"lora.yaml", "fsdp2.yaml"}


def _recipes() -> list[tuple[Path, Path]]:
    """(recipe, its smoke overlay) pairs: ``smoke.yaml`` beside a folder's one recipe, else
    ``smoke-<recipe>.yaml`` beside each."""
    pairs = []
    for folder in sorted(p for p in RECIPES.iterdir() if p.is_dir()):
        recipes = [
            p
            for p in sorted(folder.glob("*.yaml"))
            if p.name not in OVERLAYS and not p.name.startswith("smoke")
        ]
        for recipe in recipes:
            smoke = folder / ("smoke.yaml" if len(recipes) == 1 else f"smoke-{recipe.stem}.yaml")
            pairs.append((recipe, smoke))
    return pairs


RECIPE_PAIRS = _recipes()


class ParseOnly(AlignCLI):
    def instantiate_classes(self) -> None:
        pass


def _id(pair) -> str:
    return f"{pair[0].parent.name}/{pair[0].stem}"


def test_every_recipe_has_a_page_a_smoke_and_overlays():
    assert len(RECIPE_PAIRS) >= 7
    for recipe, smoke in RECIPE_PAIRS:
        folder = recipe.parent
        assert smoke.is_file(), f"{recipe}: no smoke overlay {smoke.name}"
        assert (folder / "README.md").is_file(), f"{folder}: no README.md"
        for overlay in OVERLAYS:
            assert (folder / overlay).is_file(), f"{folder}: no {overlay}"
        assert f"alignlit fit --config recipes/{folder.name}/{recipe.name}" in recipe.read_text()
    listed = (RECIPES / "README.md").read_text()
    for folder in {r.parent.name for r, _ in RECIPE_PAIRS}:
        assert f"({folder}/README.md)" in listed, f"recipes/README.md does not list {folder}"


@pytest.mark.parametrize("pair", RECIPE_PAIRS, ids=_id)
def test_recipe_and_overlays_parse(pair):
    recipe, smoke = pair
    base = ParseOnly(args=["--config", str(recipe)], run=False).config
    init = base.model.init_args
    model = init.get("policy") or init.get("model")
    assert model == "Qwen/Qwen2.5-0.5B-Instruct", "the recipes name a real hub model"
    data = base.data.init_args
    assert data.get("dataset", {}).get("path", "").count("/") == 1, "the recipes name a real hub dataset"
    for overlay in [smoke, *(recipe.parent / o for o in sorted(OVERLAYS))]:
        cfg = ParseOnly(args=["--config", str(recipe), "--config", str(overlay)], run=False).config
        assert cfg.model.class_path == base.model.class_path
        assert (cfg.model.init_args.get("policy") or cfg.model.init_args.get("model")) == model
    lora = ParseOnly(args=["--config", str(recipe), "--config", str(recipe.parent / "lora.yaml")], run=False)
    assert lora.config.model.init_args.lora.rank >= 8
    fsdp = ParseOnly(args=["--config", str(recipe), "--config", str(recipe.parent / "fsdp2.yaml")], run=False)
    assert fsdp.config.trainer.devices == 4


@pytest.mark.slow
@pytest.mark.parametrize("pair", RECIPE_PAIRS, ids=_id)
def test_recipe_smoke_runs_offline_from_the_hub_cache(pair, hub_cache, tmp_path):
    recipe, smoke = pair
    out = ROOT / "out" / "recipes-smoke"
    cfg = ParseOnly(args=["--config", str(recipe), "--config", str(smoke)], run=False).config
    export = ROOT / cfg.model.init_args.export_dir
    assert export.is_relative_to(out)
    checkpoints = [ROOT / c.init_args.dirpath for c in cfg.trainer.callbacks if "dirpath" in c.init_args]
    logs = ROOT / cfg.trainer.logger.init_args.save_dir / cfg.trainer.logger.init_args.name
    for path in [export, logs, *checkpoints]:  # a rerun starts clean (the smoke's own folders only)
        assert path.is_relative_to(out)
        shutil.rmtree(path, ignore_errors=True)
    teacher = cfg.model.init_args.get("teacher")
    if (
        teacher and teacher != "Qwen/Qwen2.5-0.5B-Instruct"
    ):  # a second hub id: a tiny model of its own weights
        make_hub_cache(hub_cache, teacher, seed=1)
    env = hub_env(
        hub_cache, {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_DATASETS_OFFLINE": "1"}
    )
    cmd = [sys.executable, "-m", "alignlit.cli", "fit", "--config", str(recipe), "--config", str(smoke)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    assert "Traceback" not in res.stderr
    meta = json.loads((export / "alignlit.json").read_text())
    assert (export / "config.json").is_file()
    source = json.dumps(meta)
    assert "Qwen/Qwen2.5-0.5B-Instruct" in source, "the export records the hub id it started from"
    assert "alignlit: " in res.stdout and "records ->" in res.stdout, "set-up prints what it made of the data"
